package remote

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
)

// TLSFiles are the PEM files of one side of the API, as a Kubernetes
// Secret of type kubernetes.io/tls with a ca.crt mounts them: this side's
// certificate and key, and the CA that signs the other side's.
type TLSFiles struct {
	Cert, Key, CA string
}

func (f TLSFiles) check() error {
	if f.Cert == "" || f.Key == "" || f.CA == "" {
		return errNoTLS
	}
	return nil
}

// load reads the files.
func (f TLSFiles) load() (tls.Certificate, *x509.CertPool, error) {
	if err := f.check(); err != nil {
		return tls.Certificate{}, nil, err
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("loading the certificate %s and key %s: %w", f.Cert, f.Key, err)
	}
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("reading the CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return tls.Certificate{}, nil, fmt.Errorf("%s holds no PEM certificate", f.CA)
	}
	return cert, pool, nil
}

// clientConfig is the controller's side: its certificate, and the CA that
// must have signed the target's for serverName.
func (f TLSFiles) clientConfig(serverName string) (*tls.Config, error) {
	cert, pool, err := f.load()
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ServerName:   serverName,
	}, nil
}

// ServerConfig is the target's side: every connection must present a
// client certificate the CA signed for client authentication. The files
// are read at every handshake, so a rotated Secret takes effect at once;
// files that cannot be read refuse the connection rather than serve
// without authentication.
func (f TLSFiles) ServerConfig() (*tls.Config, error) { return f.ServerConfigNaming("") }

// ClientConfig is the controller's side towards another server of the
// same CA: its certificate, and the CA that must have signed the server's
// for serverName.
func (f TLSFiles) ClientConfig(serverName string) (*tls.Config, error) {
	cfg, err := f.clientConfig(serverName)
	if err != nil {
		return nil, err
	}
	cfg.NextProtos = []string{"h2"}
	return cfg, nil
}

// ServerConfigNaming is ServerConfig that also requires the client's
// certificate to name clientName (none: any name), so that of the
// certificates one CA signs only those made for this service get in.
func (f TLSFiles) ServerConfigNaming(clientName string) (*tls.Config, error) {
	if _, _, err := f.load(); err != nil {
		return nil, err
	}
	var verify func(tls.ConnectionState) error
	if clientName != "" {
		verify = func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return fmt.Errorf("no client certificate")
			}
			if err := cs.PeerCertificates[0].VerifyHostname(clientName); err != nil {
				return fmt.Errorf("the client's certificate is not one for %s: %w", clientName, err)
			}
			return nil
		}
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cert, pool, err := f.load()
			if err != nil {
				return nil, err
			}
			return &tls.Config{
				MinVersion:       tls.VersionTLS13,
				Certificates:     []tls.Certificate{cert},
				ClientCAs:        pool,
				ClientAuth:       tls.RequireAndVerifyClientCert,
				NextProtos:       []string{"h2", "http/1.1"},
				VerifyConnection: verify,
			}, nil
		},
	}, nil
}

// DialTLS makes a connection with dial and does the client's side of
// mutual TLS over it, checking the server's certificate for serverName. The
// files are read at every connection, so a rotated certificate takes effect
// without a restart; nextProtos is the ALPN offered (nil: none).
func (f TLSFiles) DialTLS(ctx context.Context, dial func(ctx context.Context, network, addr string) (net.Conn, error),
	network, addr, serverName string, nextProtos []string) (net.Conn, error) {
	cfg, err := f.clientConfig(serverName)
	if err != nil {
		return nil, err
	}
	cfg.NextProtos = nextProtos
	raw, err := dial(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	conn := tls.Client(raw, cfg)
	if err := conn.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, err
	}
	return conn, nil
}

// Package peer connects the controllers of one driver to each other, so
// that a standby can forward the Controller calls it receives to the
// acting controller.
//
// Kubernetes' sidecars elect their leaders each on a Lease of their own,
// so the external-attacher's leader may sit beside a standby driver while
// the provisioner's sits beside the acting one. Every replica therefore
// takes calls, and one acts: a standby sends them on, unchanged, to the
// controller the storage targets' leases name, over mutual TLS with
// certificates of the controllers' CA that name ServerName. A standby that
// reads no lease (cut off from the targets, or arbitrated by lock files,
// which name no holder's address) asks the listed peers (--controller-peers)
// in turn: only the acting one takes the call, the others refuse it as
// "not acting", and the standby tries the next, as it does past an address
// where no controller answers.
package peer

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/pkg/backend/remote"
)

// ServerName is the name every controller's certificate carries for its
// peers, whatever address they dial it at: pods come and go with new
// addresses, and the name says "a controller of this driver".
const ServerName = "modeguard-controller-peer"

// ServerCredentials are the peer listener's: mutual TLS, the client's
// certificate signed by files' CA and naming ServerName.
func ServerCredentials(files remote.TLSFiles) (credentials.TransportCredentials, error) {
	cfg, err := files.ServerConfigNaming(ServerName)
	if err != nil {
		return nil, fmt.Errorf("the controller's peer listener needs mutual TLS (--tls-cert, --tls-key, --tls-ca): %w", err)
	}
	return credentials.NewTLS(cfg), nil
}

// Address is what a controller advertises of --controller-peer-listen
// (tcp://HOST:PORT): HOST:PORT, which must name this controller, not every
// address of its host.
func Address(listen string) (string, error) {
	hostPort, ok := strings.CutPrefix(listen, "tcp://")
	if !ok {
		return "", fmt.Errorf("--controller-peer-listen %q: give tcp://HOST:PORT", listen)
	}
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil || port == "" || port == "0" {
		return "", fmt.Errorf("--controller-peer-listen %q: give tcp://HOST:PORT with a port: %v", listen, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return "", fmt.Errorf("--controller-peer-listen %q: give the address other controllers reach this one at (in a pod, $(POD_IP)), not every address", listen)
	}
	return hostPort, nil
}

// Dialer reaches the acting controller: where find says it is, else
// among the listed peers. It keeps one connection per address.
type Dialer struct {
	files remote.TLSFiles
	cfg   DialerConfig

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// DialerConfig says where a Dialer looks for the acting controller.
type DialerConfig struct {
	// Find answers the acting controller's address from the storage
	// targets' leases, or why none is known; nil where there are none.
	Find func() (string, error)
	// Peers are HOST:PORT entries (--controller-peers), tried when Find
	// knows no address; a HOST that is a name stands for every address it
	// resolves to at the time (a headless Service: every replica).
	Peers []string
	// Self is this controller's own advertised address, never dialled.
	Self string
	// LookupHost resolves a name; nil: the system's resolver.
	LookupHost func(ctx context.Context, host string) ([]string, error)
}

// NewDialer makes a Dialer with the controller's certificate files.
func NewDialer(files remote.TLSFiles, cfg DialerConfig) *Dialer {
	if cfg.LookupHost == nil {
		cfg.LookupHost = net.DefaultResolver.LookupHost
	}
	return &Dialer{files: files, cfg: cfg, conns: map[string]*grpc.ClientConn{}}
}

// Acting answers connections to the controllers that may be acting, to
// try in order: the one the leases name, else every listed peer but this
// controller.
func (d *Dialer) Acting(ctx context.Context) ([]grpc.ClientConnInterface, error) {
	var why error
	if d.cfg.Find != nil {
		addr, err := d.cfg.Find()
		if err == nil {
			c, err := d.conn(addr)
			if err != nil {
				return nil, err
			}
			return []grpc.ClientConnInterface{c}, nil
		}
		why = err
	}
	if len(d.cfg.Peers) == 0 {
		if why == nil {
			why = fmt.Errorf("no acting controller is known, and no peers are listed (--controller-peers)")
		}
		return nil, why
	}
	addrs, err := d.listed(ctx)
	if err != nil {
		return nil, err
	}
	var conns []grpc.ClientConnInterface
	for _, addr := range addrs {
		c, err := d.conn(addr)
		if err != nil {
			return nil, err
		}
		conns = append(conns, c)
	}
	return conns, nil
}

// listed resolves the listed peers, leaving out this controller.
func (d *Dialer) listed(ctx context.Context) ([]string, error) {
	var addrs []string
	var failed []string
	for _, entry := range d.cfg.Peers {
		host, port, err := net.SplitHostPort(entry)
		if err != nil {
			return nil, fmt.Errorf("controller peer %q: %w", entry, err)
		}
		hosts := []string{host}
		if net.ParseIP(host) == nil {
			if hosts, err = d.cfg.LookupHost(ctx, host); err != nil {
				failed = append(failed, fmt.Sprintf("%s: %v", host, err))
				continue
			}
		}
		for _, h := range hosts {
			if addr := net.JoinHostPort(h, port); addr != d.cfg.Self && !slices.Contains(addrs, addr) {
				addrs = append(addrs, addr)
			}
		}
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("no other controller is listed in %v (%s)", d.cfg.Peers, strings.Join(failed, "; "))
	}
	return addrs, nil
}

// conn answers the connection to the controller at addr.
func (d *Dialer) conn(addr string) (*grpc.ClientConn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if c, ok := d.conns[addr]; ok {
		return c, nil
	}
	files := d.files
	// The TLS is done here so that the name checked is ServerName
	// whatever address is dialed.
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		var nd net.Dialer
		return files.DialTLS(ctx, nd.DialContext, "tcp", addr, ServerName, []string{"h2"})
	}
	c, err := grpc.NewClient("passthrough:///"+addr, grpc.WithContextDialer(dial),
		// Secured by the dialer's TLS above.
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("the controller at %s: %w", addr, err)
	}
	d.conns[addr] = c
	return c, nil
}

// Close drops every connection.
func (d *Dialer) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for addr, c := range d.conns {
		c.Close()
		delete(d.conns, addr)
	}
}

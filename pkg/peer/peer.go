// Package peer connects the controllers of one driver to each other, so
// that a standby can forward the Controller calls it receives to the
// acting controller.
//
// Kubernetes' sidecars elect their leaders each on a Lease of their own,
// so the external-attacher's leader may sit beside a standby driver while
// the provisioner's sits beside the acting one. Every replica therefore
// takes calls, and one acts: a standby sends them on, unchanged, to the
// controller the storage targets' leases name, over mutual TLS with
// certificates of the controllers' CA that name ServerName.
package peer

import (
	"context"
	"fmt"
	"net"
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

// Dialer reaches the acting controller, where find says it is, keeping one
// connection per address.
type Dialer struct {
	files remote.TLSFiles
	find  func() (string, error)

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// NewDialer makes a Dialer with the controller's certificate files; find
// answers the acting controller's address, or why none is known.
func NewDialer(files remote.TLSFiles, find func() (string, error)) *Dialer {
	return &Dialer{files: files, find: find, conns: map[string]*grpc.ClientConn{}}
}

// Acting answers a connection to the acting controller.
func (d *Dialer) Acting(context.Context) (grpc.ClientConnInterface, error) {
	addr, err := d.find()
	if err != nil {
		return nil, err
	}
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
		return nil, fmt.Errorf("the acting controller at %s: %w", addr, err)
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

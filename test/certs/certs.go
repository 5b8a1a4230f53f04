// Package certs makes certificate authorities and certificates for tests
// of the storage target's mutual TLS: PEM files in a test's temporary
// directory, valid for an hour.
package certs

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// Files are one side's certificate and key and the CA it trusts for the
// other side (the fields of remote.TLSFiles, which converts from it).
type Files struct {
	Cert, Key, CA string
}

// CA is a test certificate authority.
type CA struct {
	File string // its certificate, PEM

	t    testing.TB
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

var serial atomic.Int64

func nextSerial() *big.Int { return big.NewInt(serial.Add(1)) }

// NewCA makes a CA called name.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: nextSerial(), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	c := &CA{t: t, dir: t.TempDir(), cert: cert, key: key}
	c.File = c.write(name+"-ca.crt", "CERTIFICATE", der)
	return c
}

func (c *CA) write(name, typ string, der []byte) string {
	p := filepath.Join(c.dir, name)
	if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		c.t.Fatal(err)
	}
	return p
}

// Issue signs a certificate for name (a DNS name, or an IP address) with
// the given extended key use, and pairs it with peerCA, the CA file this
// side trusts for the other.
func (c *CA) Issue(name string, use x509.ExtKeyUsage, peerCA string) Files {
	c.t.Helper()
	return c.issue(name, []x509.ExtKeyUsage{use}, peerCA)
}

// Peer is a certificate for name both for serving and for client
// authentication, trusting this CA for the other side: what controllers
// present to each other.
func (c *CA) Peer(name string) Files {
	c.t.Helper()
	return c.issue(name, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, c.File)
}

func (c *CA) issue(name string, uses []x509.ExtKeyUsage, peerCA string) Files {
	c.t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		c.t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: nextSerial(), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: uses,
	}
	if ip := net.ParseIP(name); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else {
		tmpl.DNSNames = []string{name}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	if err != nil {
		c.t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		c.t.Fatal(err)
	}
	n := nextSerial().String()
	return Files{
		Cert: c.write(name+"-"+n+".crt", "CERTIFICATE", der),
		Key:  c.write(name+"-"+n+".key", "PRIVATE KEY", keyDER),
		CA:   peerCA,
	}
}

// Server is a certificate for name for serving, trusting this CA for
// clients.
func (c *CA) Server(name string) Files { return c.Issue(name, x509.ExtKeyUsageServerAuth, c.File) }

// Client is a certificate for name for client authentication, trusting
// this CA for servers.
func (c *CA) Client(name string) Files { return c.Issue(name, x509.ExtKeyUsageClientAuth, c.File) }

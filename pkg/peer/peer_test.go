package peer

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/backend/remote"
)

// TestAddress: what a controller advertises of --controller-peer-listen
// must be an address the others can dial: a host and a port, not every
// address of the host.
func TestAddress(t *testing.T) {
	for _, tc := range []struct {
		listen, want, refusal string
	}{
		{listen: "tcp://10.0.0.7:9871", want: "10.0.0.7:9871"},
		{listen: "tcp://[2001:db8::7]:9871", want: "[2001:db8::7]:9871"},
		{listen: "tcp://controller-0.example:9871", want: "controller-0.example:9871"},
		{listen: "10.0.0.7:9871", refusal: "give tcp://HOST:PORT"},
		{listen: "unix:///run/peer.sock", refusal: "give tcp://HOST:PORT"},
		{listen: "tcp://10.0.0.7", refusal: "with a port"},
		{listen: "tcp://10.0.0.7:0", refusal: "with a port"},
		{listen: "tcp://0.0.0.0:9871", refusal: "not every address"},
		{listen: "tcp://[::]:9871", refusal: "not every address"},
		{listen: "tcp://:9871", refusal: "not every address"},
	} {
		got, err := Address(tc.listen)
		switch {
		case tc.refusal == "" && (err != nil || got != tc.want):
			t.Errorf("Address(%q) = %q, %v; want %q", tc.listen, got, err, tc.want)
		case tc.refusal != "" && (err == nil || !strings.Contains(err.Error(), tc.refusal)):
			t.Errorf("Address(%q) = %q, %v; want a refusal saying %q", tc.listen, got, err, tc.refusal)
		}
	}
}

func TestListedPeers(t *testing.T) {
	names := map[string][]string{
		"modeguard-controller-peers.modeguard.svc": {"10.0.0.5", "10.0.0.6", "10.0.0.7"},
		"other.example": {"10.0.0.6"},
	}
	lookup := func(_ context.Context, host string) ([]string, error) {
		if addrs, ok := names[host]; ok {
			return addrs, nil
		}
		return nil, fmt.Errorf("no such host %s", host)
	}
	for _, c := range []struct {
		name  string
		peers []string
		want  []string
		err   string
	}{
		{"a headless Service: every replica but this one", []string{"modeguard-controller-peers.modeguard.svc:9871"},
			[]string{"10.0.0.5:9871", "10.0.0.7:9871"}, ""},
		{"addresses as they are, each once", []string{"10.0.0.9:9871", "other.example:9871", "10.0.0.9:9871"},
			[]string{"10.0.0.9:9871"}, ""},
		{"a name that does not resolve is left out", []string{"gone.example:9871", "10.0.0.9:9871"}, []string{"10.0.0.9:9871"}, ""},
		{"nothing but this controller", []string{"10.0.0.6:9871"}, nil, "no other controller is listed"},
		{"nothing resolves", []string{"gone.example:9871"}, nil, "no such host gone.example"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := NewDialer(remote.TLSFiles{}, DialerConfig{Peers: c.peers, Self: "10.0.0.6:9871", LookupHost: lookup})
			got, err := d.listed(context.Background())
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("listed = %v, %v; want an error saying %q", got, err, c.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, c.want) {
				t.Fatalf("listed = %v, %v; want %v", got, err, c.want)
			}
		})
	}
}

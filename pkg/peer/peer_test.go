package peer

import (
	"strings"
	"testing"
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

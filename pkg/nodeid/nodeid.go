// Package nodeid renders and parses the node id a node plugin reports in
// NodeGetInfo and a CO hands back in ControllerPublishVolume.
//
// The id carries what the controller must know about a node without asking
// any CO for it: the node's name, its topology zone and, for NFS, the address
// it mounts from. The format is
//
//	<name>@<zone>            e.g. worker-1@zone-a
//	<name>@<zone>@<address>  e.g. worker-1@zone-a@10.99.0.11
//
// name and zone are Kubernetes label values; address is an IPv4 or IPv6
// address. The controller trusts a node's zone because only the node plugin
// on that node produces its id.
package nodeid

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Node is a parsed node id.
type Node struct {
	Name    string
	Zone    string
	Address string // empty when the node has no NFS client address
}

// ValidName reports whether n may name a node.
func ValidName(n string) bool { return volumeid.ValidZone(n) }

// String renders the node id.
func (n Node) String() string {
	s := n.Name + "@" + n.Zone
	if n.Address != "" {
		s += "@" + n.Address
	}
	return s
}

// Validate checks every field.
func (n Node) Validate() error {
	if !ValidName(n.Name) {
		return fmt.Errorf("node name %q is not valid (letters, digits, '-', '_', '.', at most 63, starting and ending with a letter or digit)", n.Name)
	}
	if !volumeid.ValidZone(n.Zone) {
		return fmt.Errorf("zone %q is not valid (letters, digits, '-', '_', '.', at most 63, starting and ending with a letter or digit)", n.Zone)
	}
	if n.Address != "" {
		a, err := netip.ParseAddr(n.Address)
		if err != nil || a.Zone() != "" || a.String() != n.Address {
			return fmt.Errorf("node address %q is not a plain IPv4 or IPv6 address", n.Address)
		}
	}
	return nil
}

// Parse reads a node id.
func Parse(s string) (Node, error) {
	parts := strings.Split(s, "@")
	if len(parts) < 2 || len(parts) > 3 {
		return Node{}, fmt.Errorf("node id %q is not of the form <name>@<zone>[@<address>]", s)
	}
	n := Node{Name: parts[0], Zone: parts[1]}
	if len(parts) == 3 {
		if parts[2] == "" {
			return Node{}, fmt.Errorf("node id %q has an empty address after the second '@'", s)
		}
		n.Address = parts[2]
	}
	if err := n.Validate(); err != nil {
		return Node{}, fmt.Errorf("node id %q: %w", s, err)
	}
	return n, nil
}

// Package nodeid renders and parses the node id a node plugin reports in
// NodeGetInfo and a CO hands back in ControllerPublishVolume. The driver
// parses an id where it arrives and carries the Node from there: in
// attachments, whose records hold it as the id string (Node is a
// text marshaler), and in calls to backends, which read its fields.
//
// The id carries what the controller must know about a node without asking
// any CO for it: the node's key (its name, or a stable short form of a long
// name), its topology zone, the address it mounts NFS exports from, the
// number of volumes it can hold, and the name its iSCSI initiator logs in
// under. The format is
//
//	<key>@<zone>                                e.g. worker-1@zone-a
//	<key>@<zone>@<address>                      e.g. worker-1@zone-a@10.99.0.11
//	<key>@<zone>@<address>@<limit>              e.g. worker-1@zone-a@10.99.0.11@64
//	<key>@<zone>@@<limit>                       e.g. worker-1@zone-a@@64 (no address)
//	<key>@<zone>@<address>@<limit>@<initiator>  e.g. worker-1@zone-a@10.99.0.11@64@iqn.1993-08.org.debian:01:56e0e55b7367
//	<key>@<zone>@@@<initiator>                  (no address, no limit)
//
// key and zone are Kubernetes label values; address is an IPv4 or IPv6
// address; limit is a positive decimal number (no limit field, or an empty
// one before an initiator: no limit); initiator is an iSCSI qualified name,
// which holds no '@'. The whole id is at most MaxLength bytes.
//
// The key is the node's identity: the controller matches attachments by it,
// while zone, address, limit and initiator are attributes that may change
// when the node plugin restarts (a new DHCP lease, NFS enabled later, an
// initiator name regenerated); an attachment keeps the id it was made with.
// The controller trusts a node's zone because only the node plugin on that
// node produces its id.
package nodeid

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"regexp"
	"strconv"
	"strings"

	"github.com/modeguard/modeguard/pkg/iqn"
	"github.com/modeguard/modeguard/pkg/label"
)

// Format is the form of a node id, for messages.
const Format = "<key>@<zone>[@<address>[@<limit>[@<initiator>]]]"

// MaxLength is the longest node id: what the CSI spec allows and what
// Kubernetes' CSINode takes (since 1.28; 192 before).
const MaxLength = 256

// MaxNameLength is the longest node name accepted: a Kubernetes node name
// is a DNS subdomain, at most 253 characters.
const MaxNameLength = 253

// subdomainPattern is a DNS subdomain as Kubernetes checks it (RFC 1123):
// lowercase alphanumeric labels with inner '-' joined by dots; only the
// whole name's length is bounded.
var subdomainPattern = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$`)

// Node is a parsed node id.
type Node struct {
	// Name is the node's key: its name when that is a label value of at
	// most 63 characters, else Key(name).
	Name    string
	Zone    string
	Address string // empty when the node has no NFS client address
	// MaxVolumes is how many volumes the node can hold; 0 is no limit.
	MaxVolumes int64
	// Initiator is the IQN the node's iSCSI initiator logs in under;
	// empty when the node does not reach volumes over iSCSI.
	Initiator string
}

// ValidKey reports whether k may stand for a node in an id (and in the
// node's topology segment): a Kubernetes label value.
func ValidKey(k string) bool { return label.ValidValue(k) }

// ValidName reports whether n may name a node: a label value (as every id
// this driver ever issued carries), or a DNS subdomain of up to 253
// characters, as Kubernetes names nodes.
func ValidName(n string) bool {
	return ValidKey(n) || (len(n) <= MaxNameLength && subdomainPattern.MatchString(n))
}

// keyPrefixLength leaves room in a 63-character label value for '-' and
// 16 hex digits of the name's hash.
const keyPrefixLength = 63 - 1 - 16

// Key is the stable stand-in for a node name in ids and topology: the name
// itself when it is a label value, else a prefix of it and a hash of the
// whole name, so that two long names sharing a prefix still differ. The
// CSI node id (256 bytes at most, 192 in older Kubernetes) and a topology
// label value (63) both have less room than a node name (253).
func Key(name string) string {
	if ValidKey(name) {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	prefix := name
	if len(prefix) > keyPrefixLength {
		prefix = prefix[:keyPrefixLength]
	}
	// A label value ends in a letter or digit, and so must the prefix
	// before the '-'.
	prefix = strings.TrimRight(prefix, "-._")
	return prefix + "-" + hex.EncodeToString(sum[:])[:16]
}

// KeyOf returns the key part of a node id without parsing the rest, for
// matching ids that may come from older or newer node plugins: everything
// before the first '@' (a key holds none). Nodes are told apart by their
// key alone: zone, address, limit and initiator are attributes a node may
// report differently after a restart.
func KeyOf(id string) string {
	k, _, _ := strings.Cut(id, "@")
	return k
}

// String renders the node id.
func (n Node) String() string {
	s := n.Name + "@" + n.Zone
	if n.Address != "" || n.MaxVolumes > 0 || n.Initiator != "" {
		s += "@" + n.Address
	}
	if n.MaxVolumes > 0 || n.Initiator != "" {
		s += "@"
		if n.MaxVolumes > 0 {
			s += strconv.FormatInt(n.MaxVolumes, 10)
		}
	}
	if n.Initiator != "" {
		s += "@" + n.Initiator
	}
	return s
}

// Validate checks every field.
func (n Node) Validate() error {
	if !ValidKey(n.Name) {
		return fmt.Errorf("node key %q is not valid (letters, digits, '-', '_', '.', at most 63, starting and ending with a letter or digit)", n.Name)
	}
	if !label.ValidValue(n.Zone) {
		return fmt.Errorf("zone %q is not valid (letters, digits, '-', '_', '.', at most 63, starting and ending with a letter or digit)", n.Zone)
	}
	if n.Address != "" {
		a, err := netip.ParseAddr(n.Address)
		if err != nil || a.Zone() != "" || a.String() != n.Address {
			return fmt.Errorf("node address %q is not a plain IPv4 or IPv6 address", n.Address)
		}
	}
	if n.MaxVolumes < 0 {
		return fmt.Errorf("node volume limit %d is negative (0 is no limit)", n.MaxVolumes)
	}
	if n.Initiator != "" && !iqn.Valid(n.Initiator) {
		return fmt.Errorf("iSCSI initiator name %q is not an IQN (%s)", n.Initiator, iqn.Form)
	}
	if l := len(n.String()); l > MaxLength {
		return fmt.Errorf("node id %q has %d bytes, more than the %d a CO takes: shorten the zone or the iSCSI initiator name", n.String(), l, MaxLength)
	}
	return nil
}

// Parse reads a node id.
func Parse(s string) (Node, error) {
	if len(s) > MaxLength {
		return Node{}, fmt.Errorf("node id of %d bytes: at most %d", len(s), MaxLength)
	}
	parts := strings.Split(s, "@")
	if len(parts) < 2 || len(parts) > 5 {
		return Node{}, fmt.Errorf("node id %q is not of the form %s", s, Format)
	}
	n := Node{Name: parts[0], Zone: parts[1]}
	if len(parts) >= 3 {
		if parts[2] == "" && len(parts) == 3 {
			return Node{}, fmt.Errorf("node id %q has an empty address after the second '@'", s)
		}
		n.Address = parts[2]
	}
	if len(parts) == 5 {
		if parts[4] == "" {
			return Node{}, fmt.Errorf("node id %q has an empty initiator name after the fourth '@'", s)
		}
		n.Initiator = parts[4]
	}
	// The limit may be empty only before an initiator name.
	if len(parts) == 4 || (len(parts) == 5 && parts[3] != "") {
		// Digits only: no sign, no spaces, no leading zeros, so that the
		// id renders back to exactly what was parsed.
		l := parts[3]
		v, err := strconv.ParseInt(l, 10, 64)
		if err != nil || v <= 0 || l[0] < '1' || l[0] > '9' {
			return Node{}, fmt.Errorf("node id %q: volume limit %q is not a positive decimal number", s, l)
		}
		n.MaxVolumes = v
	}
	if err := n.Validate(); err != nil {
		return Node{}, fmt.Errorf("node id %q: %w", s, err)
	}
	return n, nil
}

// MustParse is Parse for ids written in the source; it panics on an id
// that does not parse.
func MustParse(s string) Node {
	n, err := Parse(s)
	if err != nil {
		panic(err)
	}
	return n
}

// MarshalText renders the id, so that a record holds a Node as the id
// string a node plugin reported. A Node that does not validate is refused:
// written, it could not be read back.
func (n Node) MarshalText() ([]byte, error) {
	if err := n.Validate(); err != nil {
		return nil, err
	}
	return []byte(n.String()), nil
}

// UnmarshalText parses an id (see Parse); a record holding one that does
// not parse does not load.
func (n *Node) UnmarshalText(text []byte) error {
	parsed, err := Parse(string(text))
	if err != nil {
		return err
	}
	*n = parsed
	return nil
}

// Package volumeid renders and parses the ids the driver hands to a CO.
//
// An id carries everything needed to find its data without a database:
// the backend, the topology zone whose pool holds it, and a key derived from
// the CO's name for it. The format is
//
//	<backend>:<zone>:vol-<key>    a volume, e.g. block:zone-a:vol-3f2a...
//	<backend>:<zone>:snap-<key>   a snapshot
//	<backend>:<zone>:grp-<key>    a group snapshot (its members are snapshots)
//
// where backend is block or nfs, zone is a Kubernetes label value (empty for
// volumes reachable from every zone) and key is 32 lower-case hex digits.
// Parse accepts nothing else, so an id can never smuggle a path separator,
// "..", or a ganesha config character into a file name built from it.
package volumeid

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/label"
)

// Kind tells volumes, snapshots and group snapshots apart.
type Kind string

const (
	Volume        Kind = "vol"
	Snapshot      Kind = "snap"
	GroupSnapshot Kind = "grp"
)

// KeyLength is the number of hex digits in a key.
const KeyLength = 32

// ID is a parsed volume or snapshot id.
type ID struct {
	Backend accessmode.Backend
	Zone    string
	Kind    Kind
	Key     string
}

var keyPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// ValidZone reports whether z may name a zone: a Kubernetes label value.
func ValidZone(z string) bool { return label.ValidValue(z) }

// KeyFor derives the key of the object a CO calls name. Deriving it (rather
// than drawing it at random) makes CreateVolume idempotent across a restart
// of the controller: the same name always leads to the same files.
func KeyFor(driverName string, kind Kind, name string) string {
	sum := sha256.Sum256([]byte(driverName + "\x00" + string(kind) + "\x00" + name))
	return hex.EncodeToString(sum[:])[:KeyLength]
}

// New builds an id and checks it.
func New(backend accessmode.Backend, zone string, kind Kind, key string) (ID, error) {
	id := ID{Backend: backend, Zone: zone, Kind: kind, Key: key}
	return id, id.validate()
}

func (id ID) validate() error {
	switch id.Backend {
	case accessmode.BackendBlock:
		if !ValidZone(id.Zone) {
			return fmt.Errorf("zone %q is not a valid zone name (letters, digits, '-', '_', '.', at most 63, starting and ending with a letter or digit)", id.Zone)
		}
	case accessmode.BackendNFS:
		if id.Zone != "" && !ValidZone(id.Zone) {
			return fmt.Errorf("zone %q is not a valid zone name", id.Zone)
		}
	default:
		return fmt.Errorf("backend %q is not one of block, nfs", id.Backend)
	}
	if id.Kind != Volume && id.Kind != Snapshot && id.Kind != GroupSnapshot {
		return fmt.Errorf("kind %q is not one of vol, snap, grp", id.Kind)
	}
	if !keyPattern.MatchString(id.Key) {
		return fmt.Errorf("key %q is not %d lower-case hex digits", id.Key, KeyLength)
	}
	return nil
}

// String renders the id as the CO sees it.
func (id ID) String() string {
	return string(id.Backend) + ":" + id.Zone + ":" + string(id.Kind) + "-" + id.Key
}

// FileName is a name for files about this id: unique per id and safe as a
// single path element.
func (id ID) FileName() string {
	return string(id.Backend) + "_" + id.Zone + "_" + string(id.Kind) + "-" + id.Key
}

// Parse reads an id of either kind.
func Parse(s string) (ID, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return ID{}, fmt.Errorf("id %q is not of the form <backend>:<zone>:<vol|snap|grp>-<key>", s)
	}
	kind, key, ok := strings.Cut(parts[2], "-")
	if !ok {
		return ID{}, fmt.Errorf("id %q is not of the form <backend>:<zone>:<vol|snap|grp>-<key>", s)
	}
	id := ID{Backend: accessmode.Backend(parts[0]), Zone: parts[1], Kind: Kind(kind), Key: key}
	if err := id.validate(); err != nil {
		return ID{}, fmt.Errorf("id %q: %w", s, err)
	}
	return id, nil
}

// ParseKind reads an id and insists on its kind.
func ParseKind(s string, want Kind) (ID, error) {
	id, err := Parse(s)
	if err != nil {
		return ID{}, err
	}
	if id.Kind != want {
		return ID{}, fmt.Errorf("id %q names a %s, not a %s", s, id.Kind, want)
	}
	return id, nil
}

// Package netfence keeps the controller's network fences: the CIDR blocks
// an operator's automation (csi-addons NetworkFence) has cut off from the
// storage. A node is fenced while its address lies in a fenced block, and
// stays fenced under a new address once a fence has caught it: a node that
// comes back from a partition with another DHCP lease must not slip out of
// a fence its operator has not lifted.
//
// The list is stored on every change, before the change is acted on, so
// that a controller that restarts half way refuses the same attachments as
// before: in a file written atomically (FileStore), or, where the pools are
// behind storage targets, on every target, so that whichever controller
// acts next reads it (each stored list has a version, and the highest
// wins).
package netfence

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// MaxFences bounds the list: a fence is a block of addresses, and even a
// large cluster fences a few at a time.
const MaxFences = 1024

// Fence is one fenced block of addresses.
type Fence struct {
	CIDR netip.Prefix `json:"cidr"`
	// Nodes are the keys of the nodes whose address lay in CIDR when the
	// controller saw them while the fence was in force, sorted.
	Nodes []string  `json:"nodes,omitempty"`
	Since time.Time `json:"since"`
}

// ParseCIDRs reads CIDR blocks as a NetworkFence names them
// ("10.90.89.66/32", "2001:db8::/64"): each a plain IPv4 or IPv6 prefix
// with no bits set past its length, so that what an operator wrote is
// exactly what is fenced. The result is sorted, without repeats.
func ParseCIDRs(cidrs []string) ([]netip.Prefix, error) {
	if len(cidrs) == 0 {
		return nil, errors.New("no CIDR block given; name at least one, e.g. 10.90.89.66/32")
	}
	if len(cidrs) > MaxFences {
		return nil, fmt.Errorf("%d CIDR blocks given; at most %d", len(cidrs), MaxFences)
	}
	var out []netip.Prefix
	for _, s := range cidrs {
		p, err := ParseCIDR(s)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	slices.SortFunc(out, comparePrefix)
	return slices.Compact(out), nil
}

// ParseCIDR reads one CIDR block (see ParseCIDRs).
func ParseCIDR(s string) (netip.Prefix, error) {
	if s == "" {
		return netip.Prefix{}, errors.New("empty CIDR block; accepted: an IPv4 or IPv6 prefix such as 10.90.89.66/32 or 2001:db8::/64")
	}
	if !strings.Contains(s, "/") {
		if a, err := netip.ParseAddr(s); err == nil && a.Zone() == "" {
			return netip.Prefix{}, fmt.Errorf("%q is an address, not a CIDR block; for that address alone write %s", s, Single(a))
		}
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is not a CIDR block (accepted: an IPv4 or IPv6 prefix such as 10.90.89.66/32 or 2001:db8::/64): %v", s, err)
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, fmt.Errorf("%q is an IPv4-mapped IPv6 block; nodes report IPv4 addresses as such: write the IPv4 block", s)
	}
	if p.Masked() != p {
		return netip.Prefix{}, fmt.Errorf("%q has bits set past its /%d prefix; write the block as %s (or the address alone as %s)",
			s, p.Bits(), p.Masked(), Single(p.Addr()))
	}
	return p, nil
}

// Single is the block of one address alone (/32, /128): how a fence names
// one node.
func Single(a netip.Addr) netip.Prefix { return netip.PrefixFrom(a, a.BitLen()) }

func comparePrefix(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}

// Stored is the list as a Store keeps it.
type Stored struct {
	// Version grows by one with every change.
	Version uint64  `json:"version"`
	Fences  []Fence `json:"fences"`
	// Found is false when no list was ever stored there.
	Found bool `json:"-"`
}

// Check refuses a stored list that holds something that is not a CIDR
// block; where says where it was read.
func (s Stored) Check(where string) error {
	for _, f := range s.Fences {
		if !f.CIDR.IsValid() || f.CIDR.Masked() != f.CIDR {
			return fmt.Errorf("the network fences in %s hold %q, which is not a CIDR block", where, f.CIDR)
		}
	}
	return nil
}

// Store keeps the list.
type Store interface {
	// Load reads the stored list; one never stored is not Found. An
	// error wrapping ErrPartlyStored comes with the list: some places
	// could not be read or brought up to date.
	Load(ctx context.Context) (Stored, error)
	// Save stores s. An error wrapping ErrPartlyStored says s was stored
	// in some places and not all: it may be in force after a restart, so
	// the caller acts on it, and reports the error.
	Save(ctx context.Context, s Stored) error
	// Where names the store in messages.
	Where() string
}

// ErrPartlyStored is a list stored in some of a Store's places only.
var ErrPartlyStored = errors.New("the network fence list was stored in some places and not all")

// FileStore keeps the list in one file, written atomically.
type FileStore string

func (f FileStore) Where() string { return string(f) }

func (f FileStore) Load(context.Context) (Stored, error) {
	var s Stored
	err := fsutil.ReadJSON(string(f), &s)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return Stored{}, nil
	case err != nil:
		return Stored{}, fmt.Errorf("reading the network fences in %s: %w", f, err)
	}
	s.Found = true
	return s, s.Check(string(f))
}

func (f FileStore) Save(_ context.Context, s Stored) error {
	if s.Fences == nil {
		s.Fences = []Fence{}
	}
	if err := fsutil.WriteJSONAtomic(string(f), s); err != nil {
		return fmt.Errorf("recording the network fences in %s: %w", f, err)
	}
	return nil
}

// List is the controller's fences, kept in a Store.
type List struct {
	store Store

	mu      sync.Mutex
	fences  []Fence // sorted by CIDR
	version uint64
	// missing: no list was stored at Open, and nothing has been stored
	// since. An empty list that was written is not missing.
	missing bool
}

// Open reads the list kept at path; a missing file is an empty list.
func Open(path string) (*List, error) {
	return OpenStore(context.Background(), FileStore(path))
}

// OpenStore reads the list kept in store; none stored is an empty list.
// A list read with an error wrapping ErrPartlyStored is opened, and the
// error returned with it.
func OpenStore(ctx context.Context, store Store) (*List, error) {
	l := &List{store: store}
	err := l.Reload(ctx)
	if err != nil && !errors.Is(err, ErrPartlyStored) {
		return nil, err
	}
	return l, err
}

// Reload reads the list again from its store (which may repair places
// that were behind). A list read with an error wrapping ErrPartlyStored
// becomes the list, and the error is returned.
func (l *List) Reload(ctx context.Context) error {
	stored, err := l.store.Load(ctx)
	if err != nil && !errors.Is(err, ErrPartlyStored) {
		return err
	}
	slices.SortFunc(stored.Fences, func(a, b Fence) int { return comparePrefix(a.CIDR, b.CIDR) })
	l.mu.Lock()
	defer l.mu.Unlock()
	l.fences, l.version, l.missing = stored.Fences, stored.Version, !stored.Found
	return err
}

// Where names the list's store.
func (l *List) Where() string { return l.store.Where() }

// Missing reports whether no list was stored at Open and nothing has been
// written since: a controller that finds fenced attachments then knows the
// list was lost, not emptied.
func (l *List) Missing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.missing
}

// Fences returns a copy of the list, sorted by block.
func (l *List) Fences() []Fence {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]Fence, len(l.fences))
	for i, f := range l.fences {
		out[i] = f
		out[i].Nodes = slices.Clone(f.Nodes)
	}
	return out
}

// Add fences the blocks (a block fenced already stays as it is) and
// persists the list before it returns.
func (l *List) Add(ctx context.Context, blocks []netip.Prefix, now time.Time) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	next := slices.Clone(l.fences)
	for _, b := range blocks {
		if !slices.ContainsFunc(next, func(f Fence) bool { return f.CIDR == b }) {
			next = append(next, Fence{CIDR: b, Since: now.UTC()})
		}
	}
	if len(next) > MaxFences {
		return fmt.Errorf("%d blocks would be fenced; at most %d: lift some fences first", len(next), MaxFences)
	}
	slices.SortFunc(next, func(a, b Fence) int { return comparePrefix(a.CIDR, b.CIDR) })
	return l.save(ctx, next)
}

// Remove lifts the fences on exactly these blocks (a block not fenced is
// fine) and persists the list before it returns.
func (l *List) Remove(ctx context.Context, blocks []netip.Prefix) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	next := slices.DeleteFunc(slices.Clone(l.fences), func(f Fence) bool { return slices.Contains(blocks, f.CIDR) })
	if len(next) == len(l.fences) {
		return nil
	}
	return l.save(ctx, next)
}

// Catch decides whether node is fenced, and when it is by its address,
// records its key in every fence whose block holds that address, so that
// the node stays fenced under any other address until those fences are
// lifted. It returns the blocks that fence it, or nil.
func (l *List) Catch(ctx context.Context, node nodeid.Node) ([]netip.Prefix, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	by, next := fencedBy(l.fences, node)
	if next == nil {
		return by, nil
	}
	if err := l.save(ctx, next); err != nil {
		return nil, err
	}
	return by, nil
}

// fencedBy is the blocks that fence node among fences: those that hold its
// address or have caught it before. When a block holds the address but
// has not recorded the node yet, next is the list with it recorded (else
// nil: nothing to write).
func fencedBy(fences []Fence, node nodeid.Node) (by []netip.Prefix, next []Fence) {
	addr, _ := netip.ParseAddr(node.Address)
	for i, f := range fences {
		caught := slices.Contains(f.Nodes, node.Name)
		holds := addr.IsValid() && f.CIDR.Contains(addr)
		if !caught && !holds {
			continue
		}
		by = append(by, f.CIDR)
		if holds && !caught {
			if next == nil {
				next = slices.Clone(fences)
			}
			nodes := append(slices.Clone(f.Nodes), node.Name)
			slices.Sort(nodes)
			next[i].Nodes = nodes
		}
	}
	return by, next
}

// save stores next as the next version and makes it the list; one stored
// in some places only is the list too (it may be in force after a
// restart), and its error is returned.
func (l *List) save(ctx context.Context, next []Fence) error {
	if next == nil {
		next = []Fence{}
	}
	err := l.store.Save(ctx, Stored{Version: l.version + 1, Fences: next})
	if err == nil || errors.Is(err, ErrPartlyStored) {
		l.fences, l.version, l.missing = next, l.version+1, false
	}
	return err
}

// Blocks lists the fenced blocks as strings, sorted.
func Blocks(fences []Fence) []string {
	out := make([]string, len(fences))
	for i, f := range fences {
		out[i] = f.CIDR.String()
	}
	return out
}

// Importing is to, started from the list in from when to has none: how a
// controller that kept its fences in a file moves them onto its storage
// targets. Once to holds a list, from is no longer read or written.
func Importing(from, to Store) Store { return importing{from: from, to: to} }

type importing struct{ from, to Store }

func (i importing) Where() string { return i.to.Where() }

func (i importing) Save(ctx context.Context, s Stored) error { return i.to.Save(ctx, s) }

func (i importing) Load(ctx context.Context) (Stored, error) {
	s, err := i.to.Load(ctx)
	if s.Found || (err != nil && !errors.Is(err, ErrPartlyStored)) {
		return s, err
	}
	// No list where to could be read: start from the file's, even with
	// some of to's places unread, or the file's blocks would be lost for
	// good once anything is stored on to.
	unread := err
	old, err := i.from.Load(ctx)
	if err != nil {
		return Stored{}, err
	}
	if !old.Found {
		return s, unread
	}
	old.Version = max(old.Version, 1)
	saved := i.to.Save(ctx, old)
	if saved != nil && !errors.Is(saved, ErrPartlyStored) {
		return Stored{}, fmt.Errorf("moving the network fences from %s to %s: %w", i.from.Where(), i.to.Where(), saved)
	}
	// Places unread or not stored to are for the caller to try again.
	return old, errors.Join(unread, saved)
}

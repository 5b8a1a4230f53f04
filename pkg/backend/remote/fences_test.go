package remote

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/netfence"
)

// fenceList is a stored list at version holding one fence on each of
// cidrs.
func fenceList(t *testing.T, version uint64, cidrs ...string) netfence.Stored {
	t.Helper()
	s := netfence.Stored{Version: version, Fences: []netfence.Fence{}}
	for _, c := range cidrs {
		p, err := netfence.ParseCIDR(c)
		if err != nil {
			t.Fatal(err)
		}
		s.Fences = append(s.Fences, netfence.Fence{CIDR: p, Since: time.Date(2026, 11, 27, 8, 0, 0, 0, time.UTC)})
	}
	return s
}

// wantFences fails unless got is the list want, found.
func wantFences(t *testing.T, what string, got netfence.Stored, want netfence.Stored) {
	t.Helper()
	if !got.Found || got.Version != want.Version || !slices.Equal(netfence.Blocks(got.Fences), netfence.Blocks(want.Fences)) {
		t.Fatalf("%s = version %d found %v %v; want version %d found %v", what,
			got.Version, got.Found, netfence.Blocks(got.Fences), want.Version, netfence.Blocks(want.Fences))
	}
}

func newFenceRecordForTest(t *testing.T, stateDir string) *fenceRecord {
	t.Helper()
	r, err := newFenceRecord(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A target keeps the list of the highest version it was given: a
// controller that is behind cannot take the list back; the same version
// again (a Save retried, or repeated by Load's repair) is fine.
func TestFenceRecordKeepsTheHighestVersion(t *testing.T) {
	steps := []struct {
		name     string
		store    netfence.Stored
		wantCode codes.Code
		held     netfence.Stored // what the record holds after the step
	}{
		{"the first list, at version 0", fenceList(t, 0, "10.0.0.0/8"), codes.OK, fenceList(t, 0, "10.0.0.0/8")},
		{"a later version", fenceList(t, 2, "10.0.0.0/8", "192.0.2.0/24"), codes.OK, fenceList(t, 2, "10.0.0.0/8", "192.0.2.0/24")},
		{"the same version again", fenceList(t, 2, "192.0.2.0/24"), codes.OK, fenceList(t, 2, "192.0.2.0/24")},
		{"an earlier version", fenceList(t, 1), codes.Aborted, fenceList(t, 2, "192.0.2.0/24")},
		{"version 0 once a list is held", fenceList(t, 0), codes.Aborted, fenceList(t, 2, "192.0.2.0/24")},
		{"a much later version", fenceList(t, 9), codes.OK, fenceList(t, 9)},
	}
	for _, inMemory := range []bool{true, false} {
		dir := ""
		if !inMemory {
			dir = t.TempDir()
		}
		r := newFenceRecordForTest(t, dir)
		if got := r.load(); got.Found {
			t.Fatalf("a new record holds %+v", got)
		}
		for _, step := range steps {
			err := r.store(step.store)
			if status.Code(err) != step.wantCode {
				t.Fatalf("state dir %q: %s: store = %v, want %v", dir, step.name, err, step.wantCode)
			}
			wantFences(t, "the record after "+step.name, r.load(), step.held)
		}
	}
}

// With a state directory the list outlives the target's process: a
// restarted target still refuses a controller that is behind.
func TestFenceRecordSurvivesARestart(t *testing.T) {
	dir := t.TempDir()
	if err := newFenceRecordForTest(t, dir).store(fenceList(t, 5, "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}
	restarted := newFenceRecordForTest(t, dir)
	wantFences(t, "the record after a restart", restarted.load(), fenceList(t, 5, "10.0.0.0/8"))
	wantCode(t, "an earlier version after a restart", restarted.store(fenceList(t, 4)), codes.Aborted)
}

// A record that cannot be read stops the target: taking it for no list
// would let a controller read an older list as the newest, and lift
// fences its operator has not.
func TestUnreadableFenceRecordIsAnError(t *testing.T) {
	for name, content := range map[string]string{
		"garbage":   "{not json",
		"host bits": `{"version":3,"fences":[{"cidr":"10.0.0.5/24","since":"2026-11-27T08:00:00Z"}]}`,
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, fenceRecordFile), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := newFenceRecord(dir); err == nil {
			t.Errorf("%s: newFenceRecord accepted %s", name, content)
		}
	}
}

// A list is on the target's disk before the target says it has it: one
// that cannot be written is refused, and the record keeps the list before.
func TestFenceRecordNotWrittenIsNotHeld(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	r := newFenceRecordForTest(t, dir)
	if err := r.store(fenceList(t, 1, "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "a store that cannot be written", r.store(fenceList(t, 2)), codes.Unavailable)
	wantFences(t, "the record after a failed write", r.load(), fenceList(t, 1, "10.0.0.0/8"))
}

// A request holding something that is not a CIDR block is refused as the
// caller's mistake, and changes nothing.
func TestFenceRecordRefusesWhatIsNotACIDRBlock(t *testing.T) {
	bad := map[string]netip.Prefix{
		"host bits": netip.PrefixFrom(netip.MustParseAddr("10.0.0.5"), 24),
		"no block":  {},
	}
	for name, p := range bad {
		r := newFenceRecordForTest(t, t.TempDir())
		if err := r.store(fenceList(t, 1, "10.0.0.0/8")); err != nil {
			t.Fatal(err)
		}
		s := netfence.Stored{Version: 2, Fences: []netfence.Fence{{CIDR: p}}}
		wantCode(t, name, r.store(s), codes.InvalidArgument)
		wantFences(t, name+": the record after", r.load(), fenceList(t, 1, "10.0.0.0/8"))
	}
}

// fenceTarget is a storage target served on a unix socket, its lease and
// fence list recorded in a state directory, and a client holding its
// lease.
type fenceTarget struct {
	client   *Client
	stateDir string
	stop     func() // the target goes away: its socket is closed and removed
}

func serveFenceTarget(t *testing.T, holder string) *fenceTarget {
	t.Helper()
	dir := t.TempDir()
	h := handler(blockController(t), leaseOn(t, dir, &clock{t: time.Now()}, nil), newFenceRecordForTest(t, dir))
	sock := filepath.Join(t.TempDir(), "target.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	c := dial(t, "unix://"+sock)
	hold(t, c, holder)
	return &fenceTarget{client: c, stateDir: dir, stop: func() { srv.Close() }}
}

// twoFenceTargets are two targets whose leases controller-1 holds, and
// the fence store over them.
func twoFenceTargets(t *testing.T) (a, b *fenceTarget, store netfence.Store) {
	t.Helper()
	a, b = serveFenceTarget(t, "controller-1"), serveFenceTarget(t, "controller-1")
	return a, b, FenceStore([]*Client{a.client, b.client})
}

func fencesOn(t *testing.T, c *Client) netfence.Stored {
	t.Helper()
	s, err := c.Fences(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Targets that never held a list give none: the controller starts from
// an empty list it knows was never written.
func TestFenceStoreOnNewTargetsFindsNothing(t *testing.T) {
	_, _, store := twoFenceTargets(t)
	got, err := store.Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if got.Found || len(got.Fences) != 0 {
		t.Fatalf("Load on new targets = %+v, want nothing found", got)
	}
}

// A change is acknowledged once every target has it, and each then
// answers it.
func TestFenceStoreSavesOnEveryTarget(t *testing.T) {
	a, b, store := twoFenceTargets(t)
	ctx := context.Background()
	want := fenceList(t, 1, "10.0.0.0/8", "2001:db8::/64")
	if err := store.Save(ctx, want); err != nil {
		t.Fatal(err)
	}
	wantFences(t, "target A's list", fencesOn(t, a.client), want)
	wantFences(t, "target B's list", fencesOn(t, b.client), want)
	got, err := store.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantFences(t, "Load", got, want)
}

// A change stored on some targets before the controller stopped wins
// over the older list on the others, whichever target has it, and the
// targets behind are brought up to date.
func TestFenceStoreLoadTakesTheHighestVersionAndRepairs(t *testing.T) {
	tests := []struct {
		name     string
		onA, onB *netfence.Stored // nil: none stored there
		want     netfence.Stored
	}{
		{
			name: "A ahead",
			onA:  ptr(fenceList(t, 3, "10.0.0.0/8", "192.0.2.0/24")),
			onB:  ptr(fenceList(t, 2, "10.0.0.0/8")),
			want: fenceList(t, 3, "10.0.0.0/8", "192.0.2.0/24"),
		},
		{
			name: "B ahead",
			onA:  ptr(fenceList(t, 2, "10.0.0.0/8")),
			onB:  ptr(fenceList(t, 3, "192.0.2.0/24")),
			want: fenceList(t, 3, "192.0.2.0/24"),
		},
		{
			name: "B never had one",
			onA:  ptr(fenceList(t, 1, "10.0.0.0/8")),
			want: fenceList(t, 1, "10.0.0.0/8"),
		},
		{
			// A list at version 0 (taken from a file written before lists
			// had versions) is a list too: it wins over none.
			name: "B holds version 0, A none",
			onB:  ptr(fenceList(t, 0, "10.0.0.0/8")),
			want: fenceList(t, 0, "10.0.0.0/8"),
		},
		{
			// An emptied list is a list: it wins over none, and is
			// written where there is none.
			name: "A holds an emptied list",
			onA:  ptr(fenceList(t, 4)),
			want: fenceList(t, 4),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b, store := twoFenceTargets(t)
			ctx := context.Background()
			for _, on := range []struct {
				c *Client
				s *netfence.Stored
			}{{a.client, tt.onA}, {b.client, tt.onB}} {
				if on.s != nil {
					if err := on.c.StoreFences(ctx, *on.s); err != nil {
						t.Fatal(err)
					}
				}
			}
			got, err := store.Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			wantFences(t, "Load", got, tt.want)
			wantFences(t, "target A's list after Load", fencesOn(t, a.client), tt.want)
			wantFences(t, "target B's list after Load", fencesOn(t, b.client), tt.want)
		})
	}
}

func ptr[T any](v T) *T { return &v }

// A target that answers but cannot take the newest list (its disk went
// away) is behind after Load: the list comes back, with word that it is
// not everywhere, so that the caller reads it again later.
func TestFenceStoreLoadReportsATargetLeftBehind(t *testing.T) {
	a, b, store := twoFenceTargets(t)
	ctx := context.Background()
	if err := store.Save(ctx, fenceList(t, 1, "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}
	newest := fenceList(t, 2, "10.0.0.0/8", "192.0.2.0/24")
	if err := a.client.StoreFences(ctx, newest); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(b.stateDir); err != nil {
		t.Fatal(err)
	}
	got, err := store.Load(ctx)
	if !errors.Is(err, netfence.ErrPartlyStored) || !strings.Contains(err.Error(), b.client.name) {
		t.Fatalf("Load with target B unable to store = %v, want an error wrapping netfence.ErrPartlyStored naming B", err)
	}
	wantFences(t, "Load with target B unable to store", got, newest)
	wantFences(t, "target B's list", fencesOn(t, b.client), fenceList(t, 1, "10.0.0.0/8"))
}

// A target down does not stop the controller reading the list (every
// acknowledged change is on the others), but a read or a change that
// reaches only some targets is reported as such: a change may be in force
// after a restart, so the caller acts on it, and must say it is not
// everywhere.
func TestFenceStoreWithOneTargetDown(t *testing.T) {
	a, b, store := twoFenceTargets(t)
	ctx := context.Background()
	if err := store.Save(ctx, fenceList(t, 1, "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}
	b.stop()

	// The list comes back, with word that B was not read (so the caller
	// reads again later), rather than failing the controller's start.
	got, err := store.Load(ctx)
	if !errors.Is(err, netfence.ErrPartlyStored) || !strings.Contains(err.Error(), b.client.name) {
		t.Fatalf("Load with target B down = %v, want an error wrapping netfence.ErrPartlyStored naming B", err)
	}
	wantFences(t, "Load with target B down", got, fenceList(t, 1, "10.0.0.0/8"))

	next := fenceList(t, 2, "10.0.0.0/8", "192.0.2.0/24")
	err = store.Save(ctx, next)
	if !errors.Is(err, netfence.ErrPartlyStored) {
		t.Fatalf("Save with target B down = %v, want it to wrap netfence.ErrPartlyStored", err)
	}
	if !strings.Contains(err.Error(), b.client.name) {
		t.Fatalf("Save with target B down does not name it: %v", err)
	}
	wantFences(t, "target A's list", fencesOn(t, a.client), next)
}

// With no target answering, the list is not known: Load must not pass
// for "no fences", and Save stored nothing.
func TestFenceStoreWithEveryTargetDown(t *testing.T) {
	a, b, store := twoFenceTargets(t)
	ctx := context.Background()
	if err := store.Save(ctx, fenceList(t, 1, "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}
	a.stop()
	b.stop()
	got, err := store.Load(ctx)
	wantCode(t, "Load with every target down", err, codes.Unavailable)
	if got.Found || len(got.Fences) != 0 {
		t.Fatalf("Load with every target down also answered %+v", got)
	}
	err = store.Save(ctx, fenceList(t, 2))
	wantCode(t, "Save with every target down", err, codes.Unavailable)
	if errors.Is(err, netfence.ErrPartlyStored) {
		t.Fatalf("Save with every target down says it was stored in some places: %v", err)
	}
}

// The list is the lease holder's: a controller that does not hold the
// target's lease can neither read nor change it, and one whose term
// ended (another took the lease) cannot change it back.
func TestFenceCallsAreLeased(t *testing.T) {
	clk := &clock{t: time.Now()}
	dir := t.TempDir()
	addr := serveUnix(t, handler(blockController(t), leaseOn(t, dir, clk, nil), newFenceRecordForTest(t, dir)))
	ctx := context.Background()
	first := dial(t, addr)
	hold(t, first, "controller-1")
	stored := fenceList(t, 1, "10.0.0.0/8")
	if err := first.StoreFences(ctx, stored); err != nil {
		t.Fatal(err)
	}

	stranger := dial(t, addr)
	err := stranger.StoreFences(ctx, fenceList(t, 2))
	wantNotTheHolder(t, "StoreFences without the lease", err)
	_, err = stranger.Fences(ctx)
	wantNotTheHolder(t, "Fences without the lease", err)
	_, err = FenceStore([]*Client{stranger}).Load(ctx)
	wantCode(t, "Load without the lease", err, codes.Unavailable)
	wantFences(t, "the list after the calls without the lease", fencesOn(t, first), stored)

	clk.add(LeaseTerm + time.Second)
	second := dial(t, addr)
	hold(t, second, "controller-2")
	err = first.StoreFences(ctx, fenceList(t, 2))
	wantNotTheHolder(t, "StoreFences of the former holder", err)
	wantFences(t, "the list after the former holder's call", fencesOn(t, second), stored)
}

func wantNotTheHolder(t *testing.T, what string, err error) {
	t.Helper()
	wantCode(t, what, err, codes.Unavailable)
	if !strings.Contains(status.Convert(err).Message(), notTheHolder) {
		t.Fatalf("%s was refused, but not for want of the lease: %v", what, err)
	}
}

// A request holding something that is not a CIDR block reaches the
// target as such (the wire does not mask it) and is refused there.
func TestStoreFencesRefusesWhatIsNotACIDRBlock(t *testing.T) {
	target := serveFenceTarget(t, "controller-1")
	ctx := context.Background()
	if err := target.client.StoreFences(ctx, fenceList(t, 1, "10.0.0.0/8")); err != nil {
		t.Fatal(err)
	}
	bad := netfence.Stored{Version: 2, Fences: []netfence.Fence{{CIDR: netip.PrefixFrom(netip.MustParseAddr("10.0.0.5"), 24)}}}
	wantCode(t, "StoreFences of a block with host bits", target.client.StoreFences(ctx, bad), codes.InvalidArgument)
	wantFences(t, "the list after", fencesOn(t, target.client), fenceList(t, 1, "10.0.0.0/8"))
}

package netfence

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/nodeid"
)

// scriptedStore is a Store in memory whose next Save can be made to fail,
// in part or outright, and which counts the calls made on it.
type scriptedStore struct {
	where string

	mu      sync.Mutex
	held    Stored
	loadErr error
	// loadPartly: Load answers what is held, with partlyStored (some
	// places could not be read or brought up to date).
	loadPartly bool
	// failNext is what the next Save returns: an error wrapping
	// ErrPartlyStored stores the list all the same (some places have it),
	// any other error stores nothing.
	failNext      error
	loads, saves  int
	savedVersions []uint64
}

func newScriptedStore(where string) *scriptedStore { return &scriptedStore{where: where} }

// holding is a store that already holds s.
func holding(where string, s Stored) *scriptedStore {
	st := newScriptedStore(where)
	s.Found = true
	st.held = cloneStored(s)
	return st
}

func cloneStored(s Stored) Stored {
	s.Fences = slices.Clone(s.Fences)
	for i := range s.Fences {
		s.Fences[i].Nodes = slices.Clone(s.Fences[i].Nodes)
	}
	return s
}

func (s *scriptedStore) Where() string { return s.where }

func (s *scriptedStore) Load(context.Context) (Stored, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loads++
	if s.loadErr != nil {
		return Stored{}, s.loadErr
	}
	if s.loadPartly {
		return cloneStored(s.held), partlyStored
	}
	return cloneStored(s.held), nil
}

func (s *scriptedStore) Save(_ context.Context, st Stored) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.saves++
	err := s.failNext
	s.failNext = nil
	if err != nil && !errors.Is(err, ErrPartlyStored) {
		return err
	}
	s.savedVersions = append(s.savedVersions, st.Version)
	st.Found = true
	s.held = cloneStored(st)
	return err
}

func (s *scriptedStore) failNextSave(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failNext = err
}

func (s *scriptedStore) now() (held Stored, loads, saves int, versions []uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return cloneStored(s.held), s.loads, s.saves, slices.Clone(s.savedVersions)
}

// partlyStored is a Save that reached some of a store's places.
var partlyStored = fmt.Errorf("%w: not on target-b: connection refused", ErrPartlyStored)

// storedNowhere is a Save that reached none of them.
var storedNowhere = errors.New("target-a: connection refused")

func prefix(t *testing.T, s string) netip.Prefix {
	t.Helper()
	p, err := ParseCIDR(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func fenceOn(t *testing.T, cidr string) Fence {
	t.Helper()
	return Fence{CIDR: prefix(t, cidr), Since: time.Date(2026, 11, 27, 8, 0, 0, 0, time.UTC)}
}

func TestFileStoreLoad(t *testing.T) {
	tests := []struct {
		name    string
		content string // "" leaves the file missing
		want    Stored
		wantErr bool
	}{
		{name: "missing file", want: Stored{}},
		{
			// Written before lists had versions: the list is there, at
			// version 0, and must not read as missing.
			name:    "no version",
			content: `{"fences":[{"cidr":"10.0.0.0/8","since":"2026-11-27T08:00:00Z"}]}`,
			want:    Stored{Version: 0, Found: true, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}},
		},
		{
			name:    "empty list written",
			content: `{"version":4,"fences":[]}`,
			want:    Stored{Version: 4, Found: true, Fences: []Fence{}},
		},
		{name: "host bits set", content: `{"version":2,"fences":[{"cidr":"10.0.0.5/24","since":"2026-11-27T08:00:00Z"}]}`, wantErr: true},
		{name: "no block", content: `{"version":2,"fences":[{"cidr":"","since":"2026-11-27T08:00:00Z"}]}`, wantErr: true},
		{name: "garbage", content: `{not json`, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "fences.json")
			if tt.content != "" {
				if err := os.WriteFile(path, []byte(tt.content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			got, err := FileStore(path).Load(context.Background())
			if tt.wantErr {
				if err == nil {
					t.Fatalf("Load of %s = %+v, want an error", tt.content, got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			assertStored(t, "Load", got, tt.want)
		})
	}
}

func assertStored(t *testing.T, what string, got, want Stored) {
	t.Helper()
	if got.Version != want.Version || got.Found != want.Found || len(got.Fences) != len(want.Fences) {
		t.Fatalf("%s = %+v, want %+v", what, got, want)
	}
	for i := range want.Fences {
		g, w := got.Fences[i], want.Fences[i]
		if g.CIDR != w.CIDR || !g.Since.Equal(w.Since) || !slices.Equal(g.Nodes, w.Nodes) {
			t.Fatalf("%s: fence %d = %+v, want %+v", what, i, g, w)
		}
	}
}

func TestFileStoreRoundTrips(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fences.json")
	ctx := context.Background()
	caught := fenceOn(t, "10.1.0.0/16")
	caught.Nodes = []string{"node-a", "node-b"}
	saved := Stored{Version: 7, Fences: []Fence{fenceOn(t, "10.0.0.0/8"), caught, fenceOn(t, "2001:db8::/64")}}
	if err := FileStore(path).Save(ctx, saved); err != nil {
		t.Fatal(err)
	}
	got, err := FileStore(path).Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	saved.Found = true
	assertStored(t, "Load after Save", got, saved)

	// An emptied list is written as one, and reads as found: the fences
	// were lifted, not lost.
	if err := FileStore(path).Save(ctx, Stored{Version: 8}); err != nil {
		t.Fatal(err)
	}
	got, err = FileStore(path).Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	assertStored(t, "Load after saving an empty list", got, Stored{Version: 8, Found: true})
}

// openScripted opens a list over a store holding version 3 with one fence.
func openScripted(t *testing.T) (*List, *scriptedStore) {
	t.Helper()
	store := holding("scripted", Stored{Version: 3, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}})
	l, err := OpenStore(context.Background(), store)
	if err != nil {
		t.Fatal(err)
	}
	return l, store
}

// Every change is stored one version on from the last, whichever call
// makes it, so that the highest version is always the newest list.
func TestListStoresEachChangeAtTheNextVersion(t *testing.T) {
	ctx := context.Background()
	l, store := openScripted(t)
	if err := l.Add(ctx, []netip.Prefix{prefix(t, "192.0.2.0/24")}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Catch(ctx, nodeid.Node{Name: "node-a", Zone: "zone-a", Address: "192.0.2.9"}); err != nil {
		t.Fatal(err)
	}
	if err := l.Remove(ctx, []netip.Prefix{prefix(t, "10.0.0.0/8")}); err != nil {
		t.Fatal(err)
	}
	held, _, _, versions := store.now()
	if want := []uint64{4, 5, 6}; !slices.Equal(versions, want) {
		t.Fatalf("versions stored = %v, want %v", versions, want)
	}
	if got := Blocks(held.Fences); !slices.Equal(got, []string{"192.0.2.0/24"}) || !slices.Equal(held.Fences[0].Nodes, []string{"node-a"}) {
		t.Fatalf("the store holds %+v", held.Fences)
	}
}

// A Save that fails outright changes nothing: the change is not in force
// anywhere, so the list, and the version its next change is stored at,
// stay as they were. One that reached some places only may be in force
// after a restart, so the list takes it, and still reports the error.
func TestListOnAFailedSave(t *testing.T) {
	tests := []struct {
		name        string
		fail        error
		wantChanged bool
	}{
		{"stored nowhere", storedNowhere, false},
		{"stored in some places", partlyStored, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			l, store := openScripted(t)
			store.failNextSave(tt.fail)
			err := l.Add(ctx, []netip.Prefix{prefix(t, "192.0.2.0/24")}, time.Now())
			if !errors.Is(err, tt.fail) {
				t.Fatalf("Add = %v, want %v", err, tt.fail)
			}
			want, nextVersion := []string{"10.0.0.0/8"}, uint64(4)
			if tt.wantChanged {
				want, nextVersion = []string{"10.0.0.0/8", "192.0.2.0/24"}, 5
			}
			if got := Blocks(l.Fences()); !slices.Equal(got, want) {
				t.Fatalf("fences after the failed Add = %v, want %v", got, want)
			}
			if err := l.Add(ctx, []netip.Prefix{prefix(t, "198.51.100.0/24")}, time.Now()); err != nil {
				t.Fatal(err)
			}
			if _, _, _, versions := store.now(); versions[len(versions)-1] != nextVersion {
				t.Fatalf("the next change was stored at version %d, want %d (all stored: %v)", versions[len(versions)-1], nextVersion, versions)
			}
		})
	}
}

// Missing tells a list that was never stored from one that was emptied:
// it holds from opening a store with nothing found until a change is
// stored (in some places at least).
func TestListMissing(t *testing.T) {
	ctx := context.Background()
	block := []netip.Prefix{prefix(t, "10.0.0.0/8")}
	tests := []struct {
		name        string
		store       *scriptedStore
		change      func(*List) error
		fail        error
		wantMissing bool
	}{
		{name: "nothing stored, nothing changed", store: newScriptedStore("new"), wantMissing: true},
		{name: "an empty list stored", store: holding("emptied", Stored{Version: 2}), wantMissing: false},
		{
			name:  "a fence added",
			store: newScriptedStore("new"),
			change: func(l *List) error {
				return l.Add(ctx, block, time.Now())
			},
			wantMissing: false,
		},
		{
			// Nothing to lift, so nothing is written.
			name:        "a fence lifted that was not there",
			store:       newScriptedStore("new"),
			change:      func(l *List) error { return l.Remove(ctx, block) },
			wantMissing: true,
		},
		{
			name:  "a fence added but stored nowhere",
			store: newScriptedStore("new"),
			change: func(l *List) error {
				return l.Add(ctx, block, time.Now())
			},
			fail:        storedNowhere,
			wantMissing: true,
		},
		{
			name:  "a fence added and stored in some places",
			store: newScriptedStore("new"),
			change: func(l *List) error {
				return l.Add(ctx, block, time.Now())
			},
			fail:        partlyStored,
			wantMissing: false,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := OpenStore(ctx, tt.store)
			if err != nil {
				t.Fatal(err)
			}
			if tt.change != nil {
				tt.store.failNextSave(tt.fail)
				if err := tt.change(l); !errors.Is(err, tt.fail) {
					t.Fatalf("the change = %v, want %v", err, tt.fail)
				}
			}
			if got := l.Missing(); got != tt.wantMissing {
				t.Fatalf("Missing = %v, want %v", got, tt.wantMissing)
			}
		})
	}
}

// Reload takes what the store holds now (another controller's change),
// sorted, and stores the next change one version past it; a store that
// cannot be read leaves the list as it was.
func TestListReload(t *testing.T) {
	ctx := context.Background()
	l, store := openScripted(t)
	store.mu.Lock()
	store.held = Stored{Version: 9, Found: true, Fences: []Fence{fenceOn(t, "198.51.100.0/24"), fenceOn(t, "192.0.2.0/24")}}
	store.mu.Unlock()
	if err := l.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{"192.0.2.0/24", "198.51.100.0/24"}
	if got := Blocks(l.Fences()); !slices.Equal(got, want) {
		t.Fatalf("fences after Reload = %v, want %v", got, want)
	}

	store.mu.Lock()
	store.loadErr = storedNowhere
	store.mu.Unlock()
	if err := l.Reload(ctx); !errors.Is(err, storedNowhere) {
		t.Fatalf("Reload from a store that cannot be read = %v", err)
	}
	if got := Blocks(l.Fences()); !slices.Equal(got, want) {
		t.Fatalf("fences after a failed Reload = %v, want %v", got, want)
	}

	store.mu.Lock()
	store.loadErr = nil
	store.mu.Unlock()
	if err := l.Remove(ctx, []netip.Prefix{prefix(t, "192.0.2.0/24")}); err != nil {
		t.Fatal(err)
	}
	if _, _, _, versions := store.now(); !slices.Equal(versions, []uint64{10}) {
		t.Fatalf("the change after Reload was stored at versions %v, want [10]", versions)
	}
}

// A list read from some of a store's places only is the best known: it is
// opened (or becomes the list on Reload), and the error comes with it so
// that the caller reads again later.
func TestListTakesAPartlyReadList(t *testing.T) {
	ctx := context.Background()
	store := holding("partly readable", Stored{Version: 3, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}})
	store.loadPartly = true
	l, err := OpenStore(ctx, store)
	if !errors.Is(err, ErrPartlyStored) || l == nil {
		t.Fatalf("OpenStore of a partly read list = %v, %v; want the list and the error", l, err)
	}
	if l.Missing() || !slices.Equal(Blocks(l.Fences()), []string{"10.0.0.0/8"}) {
		t.Fatalf("the list opened: missing %v, fences %v", l.Missing(), Blocks(l.Fences()))
	}

	store.mu.Lock()
	store.held = Stored{Version: 6, Found: true, Fences: []Fence{fenceOn(t, "192.0.2.0/24")}}
	store.mu.Unlock()
	if err := l.Reload(ctx); !errors.Is(err, ErrPartlyStored) {
		t.Fatalf("Reload of a partly read list = %v", err)
	}
	if got := Blocks(l.Fences()); !slices.Equal(got, []string{"192.0.2.0/24"}) {
		t.Fatalf("fences after Reload = %v", got)
	}
	if err := l.Add(ctx, []netip.Prefix{prefix(t, "198.51.100.0/24")}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, _, _, versions := store.now(); !slices.Equal(versions, []uint64{7}) {
		t.Fatalf("the change after Reload was stored at versions %v, want [7]", versions)
	}
}

// A controller moving from a file to its targets: while the targets hold
// no list, the file's is taken and stored on them, at version 1 at least
// (so it is found, and wins over none); once they hold one, the file is
// no longer read.
func TestImportingMovesTheOldListOnce(t *testing.T) {
	tests := []struct {
		name        string
		fromVersion uint64
		wantVersion uint64
	}{
		{"a file without versions", 0, 1},
		{"a file with a version", 7, 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			from := holding("the file", Stored{Version: tt.fromVersion, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}})
			to := newScriptedStore("the targets")
			s := Importing(from, to)
			want := Stored{Version: tt.wantVersion, Found: true, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}}

			got, err := s.Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			assertStored(t, "the first Load", got, want)
			held, _, _, _ := to.now()
			assertStored(t, "the list moved to the targets", held, want)

			got, err = s.Load(ctx)
			if err != nil {
				t.Fatal(err)
			}
			assertStored(t, "the second Load", got, want)
			if _, loads, saves, _ := from.now(); loads != 1 || saves != 0 {
				t.Fatalf("the file was loaded %d times and saved %d times; want once and never", loads, saves)
			}
			if _, _, saves, _ := to.now(); saves != 1 {
				t.Fatalf("the targets were saved to %d times, want once", saves)
			}
		})
	}
}

func TestImportingLoad(t *testing.T) {
	list := Stored{Version: 5, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}}
	tests := []struct {
		name      string
		from, to  func() *scriptedStore
		failSave  error // of the targets
		want      Stored
		wantErr   error // what the error is or wraps
		fromLoads int
	}{
		{
			// An emptied list on the targets is the list: the file's older
			// one must not come back.
			name:      "the targets hold a list",
			from:      func() *scriptedStore { return holding("the file", list) },
			to:        func() *scriptedStore { return holding("the targets", Stored{Version: 2}) },
			want:      Stored{Version: 2, Found: true},
			fromLoads: 0,
		},
		{
			// Read from some targets only, the list there is still the
			// newest known: the file's is older.
			name: "the targets hold a list, some unread",
			from: func() *scriptedStore { return holding("the file", list) },
			to: func() *scriptedStore {
				s := holding("the targets", Stored{Version: 2})
				s.loadPartly = true
				return s
			},
			want:      Stored{Version: 2, Found: true},
			wantErr:   partlyStored,
			fromLoads: 0,
		},
		{
			name:      "neither holds a list",
			from:      func() *scriptedStore { return newScriptedStore("the file") },
			to:        func() *scriptedStore { return newScriptedStore("the targets") },
			want:      Stored{},
			fromLoads: 1,
		},
		{
			// Some targets have it: it may be in force, and the targets
			// that do not are brought up to date by a later Load, which
			// the error asks for.
			name:      "stored on some targets only",
			from:      func() *scriptedStore { return holding("the file", list) },
			to:        func() *scriptedStore { return newScriptedStore("the targets") },
			failSave:  partlyStored,
			want:      Stored{Version: 5, Found: true, Fences: list.Fences},
			wantErr:   ErrPartlyStored,
			fromLoads: 1,
		},
		{
			name:      "stored on no target",
			from:      func() *scriptedStore { return holding("the file", list) },
			to:        func() *scriptedStore { return newScriptedStore("the targets") },
			failSave:  storedNowhere,
			wantErr:   storedNowhere,
			fromLoads: 1,
		},
		{
			name: "the targets cannot be read",
			from: func() *scriptedStore { return holding("the file", list) },
			to: func() *scriptedStore {
				s := newScriptedStore("the targets")
				s.loadErr = storedNowhere
				return s
			},
			wantErr:   storedNowhere,
			fromLoads: 0,
		},
		{
			// A target down while the others hold nothing yet (the
			// move under way): the file's list is taken, not lost.
			name: "some targets unread, the others holding nothing",
			from: func() *scriptedStore { return holding("the file", list) },
			to: func() *scriptedStore {
				s := newScriptedStore("the targets")
				s.loadPartly = true
				return s
			},
			want:      Stored{Version: 5, Found: true, Fences: list.Fences},
			wantErr:   ErrPartlyStored,
			fromLoads: 1,
		},
		{
			name: "the file cannot be read",
			from: func() *scriptedStore {
				s := newScriptedStore("the file")
				s.loadErr = storedNowhere
				return s
			},
			to:        func() *scriptedStore { return newScriptedStore("the targets") },
			wantErr:   storedNowhere,
			fromLoads: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			from, to := tt.from(), tt.to()
			to.failNextSave(tt.failSave)
			got, err := Importing(from, to).Load(context.Background())
			if _, loads, _, _ := from.now(); loads != tt.fromLoads {
				t.Fatalf("the file was loaded %d times, want %d", loads, tt.fromLoads)
			}
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Load = %+v, %v; want the error %v", got, err, tt.wantErr)
			}
			if tt.wantErr == nil || errors.Is(tt.wantErr, ErrPartlyStored) {
				assertStored(t, "Load", got, tt.want)
			}
		})
	}
}

// Once importing, changes go to the targets alone: the file is left as
// it was, and messages name the targets.
func TestImportingSavesToTheTargetsOnly(t *testing.T) {
	ctx := context.Background()
	from := holding("the file", Stored{Version: 1, Fences: []Fence{fenceOn(t, "10.0.0.0/8")}})
	to := newScriptedStore("the targets")
	l, err := OpenStore(ctx, Importing(from, to))
	if err != nil {
		t.Fatal(err)
	}
	if l.Missing() || !slices.Equal(Blocks(l.Fences()), []string{"10.0.0.0/8"}) {
		t.Fatalf("the list opened while importing: missing %v, fences %v", l.Missing(), Blocks(l.Fences()))
	}
	if err := l.Add(ctx, []netip.Prefix{prefix(t, "192.0.2.0/24")}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, _, saves, _ := from.now(); saves != 0 {
		t.Fatalf("the file was saved to %d times", saves)
	}
	held, _, _, versions := to.now()
	if !slices.Equal(versions, []uint64{1, 2}) || !slices.Equal(Blocks(held.Fences), []string{"10.0.0.0/8", "192.0.2.0/24"}) {
		t.Fatalf("the targets hold %v at versions %v", Blocks(held.Fences), versions)
	}
	if got := l.Where(); got != "the targets" {
		t.Fatalf("Where = %q, want the targets'", got)
	}
}

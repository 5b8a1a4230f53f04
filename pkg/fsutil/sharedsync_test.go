package fsutil

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// countSyncfs replaces syncfs with one that counts its calls, takes a
// while (so that callers pile up behind it) and fails when fail says so.
func countSyncfs(t *testing.T, fail func(n int64) error) *atomic.Int64 {
	var n atomic.Int64
	real := syncfs
	syncfs = func(fd int) error {
		i := n.Add(1)
		time.Sleep(20 * time.Millisecond)
		if fail != nil {
			return fail(i)
		}
		return real(fd)
	}
	t.Cleanup(func() { syncfs = real })
	return &n
}

func shareForTest(t *testing.T, dir string) {
	t.Helper()
	if err := ShareSyncsUnder(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := UnshareSyncsUnder(dir); err != nil {
			t.Errorf("UnshareSyncsUnder: %v", err)
		}
	})
}

// busyFor makes a shared root look as if another caller were syncing
// below it until the test ends (or the returned func is called).
func busyFor(t *testing.T, root string) func() {
	r := sharedRootOf(root)
	if r == nil {
		t.Fatalf("%s is not shared", root)
	}
	r.inFlight.Add(1)
	var once sync.Once
	done := func() { once.Do(func() { r.inFlight.Add(-1) }) }
	t.Cleanup(done)
	return done
}

// TestSharedSyncsAreGrouped: below a shared root where syncs are under
// way, many files made durable at once cost a few syncfs calls, not one
// sync each; outside it and after the root is let go, files are synced one
// by one as before.
func TestSharedSyncsAreGrouped(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	shareForTest(t, root)
	calls := countSyncfs(t, nil)
	busyFor(t, root)

	const writers = 16
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for i := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = WriteFileAtomic(filepath.Join(root, "f"+strconv.Itoa(i)), []byte("x"), 0o600)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", i, err)
		}
	}
	// Each WriteFileAtomic syncs twice (the file, then its directory).
	if got := calls.Load(); got < 2 || got >= 2*writers {
		t.Errorf("%d atomic writes at once made %d syncfs calls, want at least 2 and fewer than %d", writers, got, 2*writers)
	}

	before := calls.Load()
	if err := WriteFileAtomic(filepath.Join(outside, "g"), []byte("y"), 0o600); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != before {
		t.Errorf("a file outside the shared root was synced with syncfs")
	}
	if err := UnshareSyncsUnder(root); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(filepath.Join(root, "h"), []byte("z"), 0o600); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != before {
		t.Errorf("a file below a root let go of was synced with syncfs")
	}
}

// TestSharedSyncFailureReachesItsCallers: a syncfs that fails fails every
// call it answered, and a later one that succeeds answers later calls.
func TestSharedSyncFailureReachesItsCallers(t *testing.T) {
	root := t.TempDir()
	shareForTest(t, root)
	busyFor(t, root)
	broken := errors.New("writeback failed")
	countSyncfs(t, func(n int64) error {
		if n == 1 {
			return broken
		}
		return nil
	})
	f, err := os.Create(filepath.Join(root, "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := SyncFile(f); !errors.Is(err, broken) {
		t.Fatalf("SyncFile with a failing syncfs: %v, want %v", err, broken)
	}
	if err := SyncFile(f); err != nil {
		t.Fatalf("SyncFile after it: %v", err)
	}
}

// TestAloneBelowASharedRootSyncsItsOwn: a caller that finds no other sync
// under way below a shared root syncs its own file and directory, with no
// syncfs (cheaper alone, on btrfs by far); once another is under way, it
// waits for a shared syncfs instead.
func TestAloneBelowASharedRootSyncsItsOwn(t *testing.T) {
	root := t.TempDir()
	shareForTest(t, root)
	calls := countSyncfs(t, nil)
	for i := range 3 {
		if err := WriteFileAtomic(filepath.Join(root, "alone"+strconv.Itoa(i)), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if got := calls.Load(); got != 0 {
		t.Errorf("writes one at a time made %d syncfs calls, want none (their own fsyncs)", got)
	}
	done := busyFor(t, root)
	if err := WriteFileAtomic(filepath.Join(root, "busy"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := calls.Load(); got != 2 {
		t.Errorf("a write while another sync is under way made %d syncfs calls, want 2 (file, directory)", got)
	}
	done()
	if err := WriteFileAtomic(filepath.Join(root, "after"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := calls.Load(); got != 2 {
		t.Errorf("a write alone again made %d more syncfs calls", got-2)
	}
}

func TestIsFilesystemRoot(t *testing.T) {
	for _, c := range []struct {
		dir  string
		want bool
	}{
		{"/", true},
		{"/proc", true},
		{"/proc/self", false},
		{filepath.Join(t.TempDir(), "."), false},
	} {
		got, err := IsFilesystemRoot(c.dir)
		if err != nil || got != c.want {
			t.Errorf("IsFilesystemRoot(%s) = %v, %v; want %v", c.dir, got, err, c.want)
		}
	}
}

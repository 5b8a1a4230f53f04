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

// TestSharedSyncsAreGrouped: below a shared root, many files made durable
// at once cost a few syncfs calls, not one sync each; outside it and after
// the root is let go, files are synced one by one as before.
func TestSharedSyncsAreGrouped(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	shareForTest(t, root)
	calls := countSyncfs(t, nil)

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

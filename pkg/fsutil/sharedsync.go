package fsutil

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// A directory that is the root of a filesystem of its own (a pool the
// driver keeps, a disk mounted for it) can have the syncs of everything
// below it shared: one syncfs(2) writes back every file and directory of
// that filesystem and flushes the disk once, so calls that each had a
// file and a directory to make durable wait together for one syncfs
// started after their changes (a group commit, as SyncDir's) instead of
// queueing a flush each. A caller that finds no other sync under way
// there syncs its own file or directory instead: alone, that is the
// cheaper of the two (on btrfs a syncfs commits a whole transaction,
// where an fsync writes its file's log), and there is no one to share
// with. Where the directory shares its filesystem with the rest of a
// host, a syncfs would write back the host's data too, and per-file
// fsyncs are kept.

// sharedRoot is a directory registered with ShareSyncsUnder.
type sharedRoot struct {
	dir string
	// fd stays open from registration on: syncfs reports a writeback error
	// of the filesystem once per open file, for errors since it was
	// opened, so a file opened later would miss an earlier error.
	fd    *os.File
	group *syncGroup
	// inFlight counts the callers syncing below the root right now.
	inFlight atomic.Int64
}

var sharedRoots struct {
	mu    sync.Mutex
	roots []*sharedRoot
}

// ShareSyncsUnder makes SyncFile, SyncDir and WriteFileAtomic share their
// syncs for every path below dir, which must be the root of a filesystem
// of its own (IsFilesystemRoot). Registering a directory again does
// nothing.
func ShareSyncsUnder(dir string) error {
	sharedRoots.mu.Lock()
	defer sharedRoots.mu.Unlock()
	for _, r := range sharedRoots.roots {
		if r.dir == dir {
			return nil
		}
	}
	fd, err := os.Open(dir)
	if err != nil {
		return err
	}
	g := &syncGroup{}
	g.cond = sync.NewCond(&g.mu)
	sharedRoots.roots = append(sharedRoots.roots, &sharedRoot{dir: dir, fd: fd, group: g})
	return nil
}

// sharedRootOf is the registered root path lies below, or nil.
func sharedRootOf(path string) *sharedRoot {
	sharedRoots.mu.Lock()
	defer sharedRoots.mu.Unlock()
	for _, r := range sharedRoots.roots {
		if path == r.dir || strings.HasPrefix(path, r.dir+string(filepath.Separator)) {
			return r
		}
	}
	return nil
}

// sync makes a change below r durable: by own, the change's own sync,
// when no other caller is syncing below r, else by waiting for a syncfs
// of r's filesystem that starts after the call.
func (r *sharedRoot) sync(own func() error) error {
	others := r.inFlight.Add(1) - 1
	defer r.inFlight.Add(-1)
	if others == 0 {
		return own()
	}
	return r.group.sync(func() error { return syncfs(int(r.fd.Fd())) })
}

// syncfs is the sync itself; a test replaces it to count syncs.
var syncfs = unix.Syncfs

// SyncFile makes f's data and metadata durable: fsync, or a shared syncfs
// below a root registered with ShareSyncsUnder while other syncs are
// under way there.
func SyncFile(f *os.File) error {
	if r := sharedRootOf(f.Name()); r != nil {
		return r.sync(f.Sync)
	}
	return f.Sync()
}

// IsFilesystemRoot says whether dir is the root of a mounted filesystem:
// its parent lies on another device, or it is its own parent.
func IsFilesystemRoot(dir string) (bool, error) {
	var st, parent unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return false, err
	}
	if err := unix.Stat(filepath.Join(dir, ".."), &parent); err != nil {
		return false, err
	}
	return st.Dev != parent.Dev || st.Ino == parent.Ino, nil
}

// UnshareSyncsUnder undoes ShareSyncsUnder, letting go of the directory
// (its filesystem can then be unmounted). Syncs below it are per file
// again.
func UnshareSyncsUnder(dir string) error {
	sharedRoots.mu.Lock()
	defer sharedRoots.mu.Unlock()
	for i, r := range sharedRoots.roots {
		if r.dir == dir {
			sharedRoots.roots = append(sharedRoots.roots[:i], sharedRoots.roots[i+1:]...)
			return r.fd.Close()
		}
	}
	return nil
}

// SyncsShared says whether syncs of path are shared (ShareSyncsUnder).
func SyncsShared(path string) bool { return sharedRootOf(path) != nil }

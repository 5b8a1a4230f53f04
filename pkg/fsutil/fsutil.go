// Package fsutil writes state that must survive a crash, and keeps paths
// built from outside input inside the directories they belong to.
package fsutil

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// WriteFileAtomic replaces path with data so that a crash at any moment
// leaves either the old content or the new, never a mix: write a temporary
// file in the same directory, fsync it, rename it over path, fsync the
// directory so the rename itself is durable.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	pending, err := WritePending(path, data, perm)
	if err != nil {
		return err
	}
	defer pending.Discard() // a no-op once committed
	return pending.Commit()
}

// PendingFile is the first half of WriteFileAtomic: data durable under a
// temporary name next to its path, waiting to replace it. It lets a caller
// make the file durable while something else is made durable too (both
// then wait for one shared sync), and replace the path only after that.
type PendingFile struct {
	tmp, path string
	committed bool
}

// WritePending writes data to a temporary file next to path (a name
// holding ".tmp-", after a dot) and makes it durable.
func WritePending(path string, data []byte, perm os.FileMode) (*PendingFile, error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*PendingFile, error) {
		tmp.Close()
		os.Remove(tmp.Name())
		return nil, err
	}
	if err := tmp.Chmod(perm); err != nil {
		return fail(err)
	}
	if _, err := tmp.Write(data); err != nil {
		return fail(err)
	}
	if err := SyncFile(tmp); err != nil {
		return fail(err)
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return nil, err
	}
	return &PendingFile{tmp: tmp.Name(), path: path}, nil
}

// Commit renames the file over its path and makes the rename durable.
func (p *PendingFile) Commit() error {
	if err := os.Rename(p.tmp, p.path); err != nil {
		return err
	}
	p.committed = true
	return SyncDir(filepath.Dir(p.path))
}

// Discard removes the temporary file unless it was committed.
func (p *PendingFile) Discard() {
	if !p.committed {
		os.Remove(p.tmp)
	}
}

// SyncDir makes the directory's entries (a rename, a removal) durable.
//
// Concurrent callers share syncs (a group commit): a caller waits for a
// sync of dir that starts after it called, and one such sync answers every
// caller that was waiting when it started. A sync already under way when a
// caller arrives does not answer it, since it may have read the directory
// before the caller's change. Where many volumes are created or deleted at
// once, this turns one directory fsync per call, each a flush of the
// disk's cache, into a few.
//
// Below a root registered with ShareSyncsUnder the sync is that root's
// shared syncfs while other syncs are under way there.
func SyncDir(dir string) error {
	if r := sharedRootOf(dir); r != nil {
		return r.sync(func() error { return syncDirGrouped(dir) })
	}
	return syncDirGrouped(dir)
}

func syncDirGrouped(dir string) error {
	g := dirSyncs.enter(dir)
	defer dirSyncs.leave(dir, g)
	return g.sync(func() error { return fsyncDir(dir) })
}

// fsyncDir is the sync itself; a test replaces it to count and order syncs.
var fsyncDir = func(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// syncGroups holds a syncGroup for each directory being synced, and only
// while someone is syncing it.
type syncGroups struct {
	mu     sync.Mutex
	groups map[string]*syncGroup
}

var dirSyncs = &syncGroups{groups: map[string]*syncGroup{}}

func (s *syncGroups) enter(dir string) *syncGroup {
	s.mu.Lock()
	defer s.mu.Unlock()
	g := s.groups[dir]
	if g == nil {
		g = &syncGroup{}
		g.cond = sync.NewCond(&g.mu)
		s.groups[dir] = g
	}
	g.users++
	return g
}

func (s *syncGroups) leave(dir string, g *syncGroup) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if g.users--; g.users == 0 {
		delete(s.groups, dir)
	}
}

// syncGroup orders the syncs of one directory: one at a time, numbered.
type syncGroup struct {
	users int // guarded by syncGroups.mu

	mu      sync.Mutex
	cond    *sync.Cond
	running bool
	waiting int    // callers waiting for the running sync to end
	started uint64 // number of the last sync started
	done    uint64 // number of the last sync finished
	// failed is the number of the last sync that failed, and failure its
	// error: a caller whose sync, or any later one it saw finish, failed
	// gets the error (it cannot tell whether its change is durable).
	failed  uint64
	failure error
}

func (g *syncGroup) sync(do func() error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	// The first sync to start from now on covers this caller's change.
	need := g.started + 1
	for g.done < need {
		if g.running {
			g.waiting++
			g.cond.Wait()
			g.waiting--
			continue
		}
		g.running = true
		g.started++
		n := g.started
		g.mu.Unlock()
		err := do()
		g.mu.Lock()
		g.running = false
		g.done = n
		if err != nil {
			g.failed, g.failure = n, err
		}
		g.cond.Broadcast()
	}
	if g.failed >= need {
		return g.failure
	}
	return nil
}

// RemoveDurably removes path (absent is fine) and makes the removal durable.
func RemoveDurably(path string) error {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return err
	}
	return SyncDir(filepath.Dir(path))
}

// WriteJSONAtomic stores v as indented JSON, atomically, mode 0600.
func WriteJSONAtomic(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, append(data, '\n'), 0o600)
}

// ReadJSON loads path into v. A missing file is reported with os.ErrNotExist.
func ReadJSON(path string, v any) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// JoinWithin joins a single name to base and refuses anything that would
// leave base: separators, "..", ".", empty names, NUL bytes.
func JoinWithin(base, name string) (string, error) {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return "", fmt.Errorf("%q is not a plain file name", name)
	}
	return filepath.Join(base, name), nil
}

// CheckCOPath validates a target or staging path handed over by a CO: it
// must be absolute, already clean, and free of NUL bytes. The driver never
// creates or removes anything along such a path except its last element.
func CheckCOPath(field, p string) error {
	switch {
	case p == "":
		return fmt.Errorf("%s is required", field)
	case strings.ContainsRune(p, 0):
		return fmt.Errorf("%s contains a NUL byte", field)
	case !filepath.IsAbs(p):
		return fmt.Errorf("%s %q must be an absolute path", field, p)
	case filepath.Clean(p) != p:
		return fmt.Errorf("%s %q must be a clean path (no '..', '.', repeated or trailing '/')", field, p)
	case p == "/":
		return fmt.Errorf("%s must not be /", field)
	}
	return nil
}

// CheckNotSymlink refuses a CO path whose last element is a symbolic link:
// mount(2) follows it, so a link put there (by a workload that can write the
// directory above, say) would have the driver mount a volume over whatever
// it points to. A missing path is fine; the driver creates it. Symlinks
// higher up are left alone: hosts legitimately link the kubelet's directory
// elsewhere.
func CheckNotSymlink(field, p string) error {
	st, err := os.Lstat(p)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("%s %q: %w", field, p, err)
	}
	if st.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("%s %q is a symbolic link; the driver neither mounts over one nor follows it", field, p)
	}
	return nil
}

// ErrNoAnswer is returned by StatfsWithin when statfs did not return in time.
var ErrNoAnswer = errors.New("statfs did not return in time (an unreachable network filesystem?)")

// A statfsProbe is one statfs call in flight and its result.
type statfsProbe struct {
	started time.Time
	// deadline is when the caller that started the probe gave up; a probe
	// past it is taken as unanswered by every later caller.
	deadline time.Time
	done     chan struct{} // closed once st and err are set
	st       unix.Statfs_t
	err      error
}

var (
	probesMu sync.Mutex
	probes   = map[string]*statfsProbe{}
)

// StatfsWithin runs statfs on path but gives up after d: on a hard NFS
// mount whose server is gone statfs blocks in the kernel until the server
// answers, and no RPC of the driver may. A blocked statfs holds its OS
// thread for as long, so at most one call per path is ever in flight: a
// caller that finds one running waits for that one (up to d) instead of
// starting another. However often a dead mount is polled, it costs one
// blocked thread, and the thread count stays flat.
func StatfsWithin(path string, d time.Duration) (*unix.Statfs_t, error) {
	probesMu.Lock()
	p, running := probes[path]
	if !running {
		p = &statfsProbe{started: time.Now(), deadline: time.Now().Add(d), done: make(chan struct{})}
		probes[path] = p
		go p.run(path)
	}
	probesMu.Unlock()
	// A probe already past its deadline answers at once: a poller must not
	// wait d again for every call while the server stays dead.
	wait := min(time.Until(p.deadline), d)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-p.done:
		if p.err != nil {
			return nil, p.err
		}
		st := p.st
		return &st, nil
	case <-timer.C:
		return nil, fmt.Errorf("%w: statfs of %s has been waiting for %v", ErrNoAnswer, path, time.Since(p.started).Round(time.Second))
	}
}

// statfs is unix.Statfs; tests that cannot make a filesystem hang replace it.
var statfs = unix.Statfs

func (p *statfsProbe) run(path string) {
	p.err = statfs(path, &p.st)
	probesMu.Lock()
	delete(probes, path)
	probesMu.Unlock()
	close(p.done)
}

// StatfsInFlight is the number of statfs calls StatfsWithin has waiting
// in the kernel, for tests and metrics.
func StatfsInFlight() int {
	probesMu.Lock()
	defer probesMu.Unlock()
	return len(probes)
}

// Package controllerlock makes one controller at a time act on a set of
// directories (block pools, the NFS export root, ganesha's directory).
//
// A controller keeps its state in those directories plus memory, and grants
// attachments from that state: two controllers on the same directories (a
// replacement pod starting while the old one still runs on a partitioned
// node, or one started by hand next to a running one) could each grant a
// single-node volume to a different node. Each directory gets a lock file
// locked with flock(2) for the controller's whole life. The kernel releases
// the lock when the process dies, however it dies, so a controller killed
// with SIGKILL never leaves a stale lock behind.
package controllerlock

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// FileName is the lock file in each directory.
const FileName = ".modeguard-controller.lock"

// Lock holds every directory's lock until Release.
type Lock struct {
	files []*os.File
}

// Busy says which directory another process holds, and what that process
// wrote into the lock file about itself.
type Busy struct {
	Dir    string
	Holder string
}

func (b Busy) Error() string {
	h := b.Holder
	if h == "" {
		h = "a process that did not say who it is"
	}
	return fmt.Sprintf("%s is locked by another controller (%s)", b.Dir, h)
}

// Acquire locks every directory, creating directories and lock files as
// needed. When one is held by another process it calls waiting (once per
// holder and then every reportEvery) and tries again every poll, until ctx
// ends. Directories are locked in sorted order, so two controllers on
// overlapping sets cannot each hold what the other waits for.
func Acquire(ctx context.Context, dirs []string, poll, reportEvery time.Duration, waiting func(Busy)) (*Lock, error) {
	sorted := slices.Clone(dirs)
	for i, d := range sorted {
		sorted[i] = filepath.Clean(d)
	}
	slices.Sort(sorted)
	sorted = slices.Compact(sorted)
	l := &Lock{}
	for _, dir := range sorted {
		f, err := open(dir)
		if err != nil {
			l.Release()
			return nil, err
		}
		var reported Busy
		var reportedAt time.Time
		for {
			err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
			if err == nil {
				break
			}
			if !errors.Is(err, unix.EWOULDBLOCK) {
				f.Close()
				l.Release()
				return nil, fmt.Errorf("locking %s: %w", f.Name(), err)
			}
			b := Busy{Dir: dir, Holder: holder(f.Name())}
			if waiting != nil && (b != reported || time.Since(reportedAt) >= reportEvery) {
				waiting(b)
				reported, reportedAt = b, time.Now()
			}
			select {
			case <-ctx.Done():
				f.Close()
				l.Release()
				return nil, fmt.Errorf("%w; stopped waiting: %v", b, ctx.Err())
			case <-time.After(poll):
			}
		}
		if err := describeSelf(f); err != nil {
			f.Close()
			l.Release()
			return nil, err
		}
		l.files = append(l.files, f)
	}
	return l, nil
}

// Release gives every lock up (closing the files releases them).
func (l *Lock) Release() {
	if l == nil {
		return
	}
	for _, f := range l.files {
		f.Close()
	}
	l.files = nil
}

func open(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("controller lock: %w", err)
	}
	// O_NOFOLLOW: the lock file is the driver's own; a symlink planted
	// in its place must not make it open (and later write) another file.
	f, err := os.OpenFile(filepath.Join(dir, FileName), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("controller lock: %w", err)
	}
	return f, nil
}

// describeSelf writes who holds the lock, for the log of a controller that
// waits for it. Only the holder writes, so the content is never torn by a
// second writer.
func describeSelf(f *os.File) error {
	host, _ := os.Hostname()
	s := fmt.Sprintf("pid %d on host %s since %s\n", os.Getpid(), host, time.Now().UTC().Format(time.RFC3339))
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("controller lock %s: %w", f.Name(), err)
	}
	if _, err := f.WriteAt([]byte(s), 0); err != nil {
		return fmt.Errorf("controller lock %s: %w", f.Name(), err)
	}
	return nil
}

// holder reads what the holder wrote about itself (at most a line).
func holder(path string) string {
	b := make([]byte, 256)
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	n, _ := f.Read(b)
	s, _, _ := strings.Cut(string(b[:n]), "\n")
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return '?'
		}
		return r
	}, s)
}

package mounts

import (
	"fmt"
	"os"
	"slices"
	"sync"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Memory is a mount table kept in memory, with a Mounter that writes to it:
// what the node plugin's tests run on when they are about its rules rather
// than the kernel. It behaves as the kernel does where the plugin can tell:
// a target must exist, a bind mount of a mount point carries that mount's
// filesystem, a bind of anything else carries the path it was made from as
// its root, mounts stack and the last one is what a path shows, and
// unmounting a path with nothing mounted is EINVAL.
type Memory struct {
	mu     sync.Mutex
	mounts []*Mount
	nextID int
}

var _ Mounter = (*Memory)(nil)

// NewMemory returns an empty table.
func NewMemory() *Memory { return &Memory{nextID: 1} }

// Table reads this table as the kernel's is read.
func (m *Memory) Table() Table {
	return Table{Read: func(filter mountinfo.FilterFunc) ([]*Mount, error) {
		m.mu.Lock()
		defer m.mu.Unlock()
		var out []*Mount
		for _, mnt := range m.mounts {
			c := *mnt
			skip, stop := false, false
			if filter != nil {
				skip, stop = filter(&c)
			}
			if !skip {
				out = append(out, &c)
			}
			if stop {
				break
			}
		}
		return out, nil
	}}
}

// Mount adds a mount of a filesystem (what a backend's stage does), with
// source as the table's source and options its per-mount options ("ro" or
// "rw" first).
func (m *Memory) Mount(source, target, fsType string, readOnly bool) error {
	canon, err := m.existingTarget(target)
	if err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.add(&Mount{Mountpoint: canon, Source: source, FSType: fsType, Root: "/", Options: rwOption(readOnly)})
	return nil
}

// Bind implements Mounter.
func (m *Memory) Bind(source, target string, readOnly bool) error {
	canon, err := m.existingTarget(target)
	if err != nil {
		return fmt.Errorf("bind-mounting %s at %s: %w", source, target, err)
	}
	if _, err := os.Lstat(source); err != nil {
		return fmt.Errorf("bind-mounting %s at %s: %w", source, target, err)
	}
	src, err := canonical(source)
	if err != nil {
		return fmt.Errorf("bind-mounting %s at %s: %w", source, target, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	mnt := &Mount{Mountpoint: canon, Source: src, FSType: "none", Root: src, Options: rwOption(readOnly)}
	if under := TopAt(m.mounts, src); under != nil {
		// A bind of a mount point shows that mount's filesystem.
		mnt.Source, mnt.FSType, mnt.Root = under.Source, under.FSType, under.Root
		mnt.Major, mnt.Minor, mnt.VFSOptions = under.Major, under.Minor, under.VFSOptions
	}
	m.add(mnt)
	return nil
}

// Unmount implements Mounter.
func (m *Memory) Unmount(target string) error {
	canon, err := canonical(target)
	if err != nil {
		return fmt.Errorf("umount %s: %w", target, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	top := TopAt(m.mounts, canon)
	if top == nil {
		return fmt.Errorf("umount %s: %w", target, unix.EINVAL)
	}
	m.mounts = slices.DeleteFunc(m.mounts, func(x *Mount) bool { return x == top })
	return nil
}

// MountPoints lists every mount point in the table, in the order the
// mounts were made, for tests that check nothing is left behind.
func (m *Memory) MountPoints() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.mounts))
	for _, mnt := range m.mounts {
		out = append(out, mnt.Mountpoint)
	}
	return out
}

func (m *Memory) existingTarget(target string) (string, error) {
	canon, err := canonical(target)
	if err != nil {
		return "", err
	}
	if _, err := os.Lstat(canon); err != nil {
		return "", err
	}
	return canon, nil
}

// add stacks mnt on whatever is mounted at its mount point. Called with
// m.mu held.
func (m *Memory) add(mnt *Mount) {
	mnt.ID = m.nextID
	m.nextID++
	if under := TopAt(m.mounts, mnt.Mountpoint); under != nil {
		mnt.Parent = under.ID
	}
	m.mounts = append(m.mounts, mnt)
}

func rwOption(readOnly bool) string {
	if readOnly {
		return "ro,relatime"
	}
	return "rw,relatime"
}

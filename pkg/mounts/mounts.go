// Package mounts answers what the kernel has mounted at a path, from the
// mount table alone.
//
// The node plugin decides from these answers whether a workload still holds
// a volume, so they must never guess: a path is "not mounted" only when the
// mount table was read and names no mount there; anything that stops the
// table from being read is an error the caller must refuse on. Nothing here
// calls stat(2) or statfs(2) on the path itself, so a mount whose NFS server
// is gone (where stat blocks forever or fails with ESTALE) is reported as
// mounted, which it is, instead of hanging the caller or reading as absent.
package mounts

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Mount is one line of the mount table.
type Mount = mountinfo.Info

// Table reads mount tables; the zero value reads the calling process's.
// Tests that cannot produce a failing kernel (a mount table that cannot be
// read) replace Read.
type Table struct {
	Read func(filter mountinfo.FilterFunc) ([]*Mount, error)
}

func (t Table) read(filter mountinfo.FilterFunc) ([]*Mount, error) {
	if t.Read != nil {
		return t.Read(filter)
	}
	return mountinfo.GetMounts(filter)
}

// At returns the mount visible at path (the last one stacked there), or
// nil when nothing is mounted there. path must be absolute; symbolic links
// in its directories are resolved first, as the kernel records mount
// points with them resolved, but path's last element is never touched.
func (t Table) At(path string) (*Mount, error) {
	canon, err := canonical(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil // a path whose directory is gone has nothing mounted
	}
	if err != nil {
		return nil, err
	}
	all, err := t.read(func(m *Mount) (skip, stop bool) { return m.Mountpoint != canon, false })
	if err != nil {
		return nil, fmt.Errorf("reading the mount table for %s: %w", path, err)
	}
	if len(all) == 0 {
		return nil, nil
	}
	return top(all), nil
}

// All reads the calling process's whole mount table.
func All() ([]*Mount, error) { return mountinfo.GetMounts(nil) }

// TopAt returns, of the mounts in all, the one visible at path (absolute,
// free of symbolic links): of those stacked there, the one no other is
// mounted on. nil if nothing is mounted at path.
func TopAt(all []*Mount, path string) *Mount {
	var at []*Mount
	for _, m := range all {
		if m.Mountpoint == path {
			at = append(at, m)
		}
	}
	if len(at) == 0 {
		return nil
	}
	return top(at)
}

// SuperOptions lists the options of the mount's filesystem (nouuid,
// prjquota, ...), as opposed to the per-mount ones (nodev, ro, ...).
func SuperOptions(m *Mount) []string { return strings.Split(m.VFSOptions, ",") }

// top picks, of the mounts at one mount point, the one no other is mounted
// on: the one a lookup of the path reaches.
func top(at []*Mount) *Mount {
	covered := map[int]bool{}
	for _, m := range at {
		covered[m.Parent] = true
	}
	for i := len(at) - 1; i >= 0; i-- {
		if !covered[at[i].ID] {
			return at[i]
		}
	}
	return at[len(at)-1]
}

// IsMounted reports whether anything is mounted at path.
func (t Table) IsMounted(path string) (bool, error) {
	m, err := t.At(path)
	return m != nil, err
}

// UsersOf lists the mount points of every mount of the block device
// major:minor (its filesystem mounted) and of every bind mount of its
// device node (devName, e.g. "loop3": how a raw block volume reaches a
// workload).
func (t Table) UsersOf(major, minor int, devName string) ([]string, error) {
	all, err := t.read(func(m *Mount) (skip, stop bool) {
		return !((m.Major == major && m.Minor == minor) || (devName != "" && m.Root == "/"+devName && isDevFS(m.FSType))), false
	})
	if err != nil {
		return nil, fmt.Errorf("reading the mount table: %w", err)
	}
	out := make([]string, 0, len(all))
	for _, m := range all {
		out = append(out, m.Mountpoint)
	}
	return out, nil
}

// isDevFS tells the filesystems /dev is made of, where a bind mount of a
// device node comes from.
func isDevFS(fsType string) bool { return fsType == "devtmpfs" || fsType == "tmpfs" }

// IsDeviceNodeBind reports whether m is a bind mount of the device node
// /dev/<devName>.
func IsDeviceNodeBind(m *Mount, devName string) bool {
	return m != nil && m.Root == "/"+devName && isDevFS(m.FSType)
}

// canonical resolves symbolic links in path's directory (not in its last
// element, which may be a dead mount point).
func canonical(path string) (string, error) {
	if !filepath.IsAbs(path) {
		return "", fmt.Errorf("%q is not an absolute path", path)
	}
	clean := filepath.Clean(path)
	if clean == "/" {
		return clean, nil
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(clean))
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, filepath.Base(clean)), nil
}

// DeviceNumbers returns the major and minor numbers of the block device
// node dev.
func DeviceNumbers(dev string) (major, minor int, err error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return 0, 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, 0, fmt.Errorf("%s is not a block device", dev)
	}
	return int(unix.Major(st.Rdev)), int(unix.Minor(st.Rdev)), nil
}

// BlockDeviceName names the block device major:minor as the kernel does
// (e.g. "loop3"), from /sys/dev/block; "" when there is no such device.
func BlockDeviceName(major, minor int) (string, error) {
	link, err := os.Readlink("/sys/dev/block/" + strconv.Itoa(major) + ":" + strconv.Itoa(minor))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	name := filepath.Base(link)
	if strings.ContainsAny(name, "/\x00") {
		return "", fmt.Errorf("unexpected sysfs link %q", link)
	}
	return name, nil
}

package imagestore

import (
	"fmt"
	"strings"

	"github.com/moby/sys/mountinfo"
)

// mountEntry is the part of one /proc/self/mountinfo line the store uses.
type mountEntry struct {
	ID         int
	ParentID   int
	MountPoint string
	FsType     string
	Source     string
	// Options are the per-mount options (nodev, nosuid, ...), SuperOptions
	// the filesystem's (nouuid, ...).
	Options      []string
	SuperOptions []string
}

const mountInfoPath = "/proc/self/mountinfo"

// readMounts lists this process's mounts (parsed by moby/sys/mountinfo).
func readMounts() ([]mountEntry, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("imagestore: reading %s: %w", mountInfoPath, err)
	}
	return entries(infos), nil
}

func entries(infos []*mountinfo.Info) []mountEntry {
	out := make([]mountEntry, 0, len(infos))
	for _, m := range infos {
		out = append(out, mountEntry{
			ID: m.ID, ParentID: m.Parent, MountPoint: m.Mountpoint, FsType: m.FSType, Source: m.Source,
			Options: strings.Split(m.Options, ","), SuperOptions: strings.Split(m.VFSOptions, ","),
		})
	}
	return out
}

// topMountAt returns the mount that is visible at path (absolute, free of
// symlinks): of the mounts stacked there, the one no other mount at path
// sits on. nil if nothing is mounted at path.
func topMountAt(mounts []mountEntry, path string) *mountEntry {
	var at []*mountEntry
	for i := range mounts {
		if mounts[i].MountPoint == path {
			at = append(at, &mounts[i])
		}
	}
	for _, m := range at {
		covered := false
		for _, o := range at {
			if o.ParentID == m.ID {
				covered = true
				break
			}
		}
		if !covered {
			return m
		}
	}
	if len(at) > 0 {
		return at[len(at)-1]
	}
	return nil
}

// mountPointsOf returns where dev is mounted.
func mountPointsOf(mounts []mountEntry, dev string) []string {
	var out []string
	for _, m := range mounts {
		if m.Source == dev {
			out = append(out, m.MountPoint)
		}
	}
	return out
}

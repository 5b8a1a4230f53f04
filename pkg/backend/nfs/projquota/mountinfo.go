package projquota

import (
	"strings"

	"github.com/moby/sys/mountinfo"
)

// mountEntry is the part of one /proc/self/mountinfo line this package uses.
type mountEntry struct {
	ID           int
	MountPoint   string
	FsType       string
	Source       string
	SuperOptions []string
}

const mountInfoPath = "/proc/self/mountinfo"

// readMounts lists this process's mounts (parsed by moby/sys/mountinfo).
func readMounts() ([]mountEntry, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, err
	}
	out := make([]mountEntry, 0, len(infos))
	for _, m := range infos {
		out = append(out, mountEntry{ID: m.ID, MountPoint: m.Mountpoint, FsType: m.FSType, Source: m.Source,
			SuperOptions: strings.Split(m.VFSOptions, ",")})
	}
	return out, nil
}

// mountAt returns the topmost mount whose mount point is path (already
// absolute and free of symlinks), or nil.
func mountAt(path string) (*mountEntry, error) {
	mounts, err := readMounts()
	if err != nil {
		return nil, err
	}
	var found *mountEntry
	for i := range mounts {
		if mounts[i].MountPoint == path {
			found = &mounts[i]
		}
	}
	return found, nil
}

// hasProjectQuota reports whether xfs super options include project quota
// accounting with enforcement. The kernel shows "prjquota" for that (and
// "pqnoenforce" for accounting alone); "pquota" is accepted as the
// synonym some tools print.
func hasProjectQuota(superOptions []string) bool {
	for _, o := range superOptions {
		switch o {
		case "prjquota", "pquota":
			return true
		}
	}
	return false
}

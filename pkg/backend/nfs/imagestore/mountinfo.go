package imagestore

import mtab "github.com/modeguard/modeguard/pkg/mounts"

// mountPointsOf returns where dev is mounted.
func mountPointsOf(mounts []*mtab.Mount, dev string) []string {
	var out []string
	for _, m := range mounts {
		if m.Source == dev {
			out = append(out, m.Mountpoint)
		}
	}
	return out
}

package projquota

import mtab "github.com/modeguard/modeguard/pkg/mounts"

const mountInfoPath = "/proc/self/mountinfo"

// mountAt returns the mount visible at path (absolute, free of symlinks), or nil.
func mountAt(path string) (*mtab.Mount, error) {
	all, err := mtab.All()
	if err != nil {
		return nil, err
	}
	return mtab.TopAt(all, path), nil
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

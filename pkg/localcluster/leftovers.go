package localcluster

import (
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/moby/sys/mountinfo"
)

// MountsUnder lists the mount points strictly below dir, newest first, so
// they can be unmounted in that order: a mount stacked later (on a parent,
// say) must go before the ones it hides.
func MountsUnder(dir string) []string {
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil
	}
	var out []string
	for i := len(infos) - 1; i >= 0; i-- { // mountinfo lists mounts oldest first
		if infos[i].Mountpoint != dir {
			out = append(out, infos[i].Mountpoint)
		}
	}
	return out
}

// LoopsUnder lists the loop devices whose backing file lies below dir.
func LoopsUnder(dir string) []string {
	matches, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, m := range matches {
		data, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		backing := strings.TrimSuffix(strings.TrimSpace(string(data)), " (deleted)")
		if strings.HasPrefix(backing, dir+"/") {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(m))))
		}
	}
	sort.Strings(out)
	return out
}

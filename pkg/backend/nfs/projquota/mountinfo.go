package projquota

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
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

// readMounts parses /proc/self/mountinfo (see proc(5)).
func readMounts() ([]mountEntry, error) {
	data, err := os.ReadFile(mountInfoPath)
	if err != nil {
		return nil, err
	}
	return parseMountInfo(data)
}

func parseMountInfo(data []byte) ([]mountEntry, error) {
	var out []mountEntry
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			return nil, fmt.Errorf("mountinfo line without separator: %q", line)
		}
		f := strings.Fields(pre)
		g := strings.Fields(post)
		if len(f) < 6 || len(g) < 3 {
			return nil, fmt.Errorf("short mountinfo line: %q", line)
		}
		id, err := strconv.Atoi(f[0])
		if err != nil {
			return nil, fmt.Errorf("mountinfo line %q: %w", line, err)
		}
		out = append(out, mountEntry{
			ID:           id,
			MountPoint:   unescapeMount(f[4]),
			FsType:       g[0],
			Source:       unescapeMount(g[1]),
			SuperOptions: strings.Split(g[2], ","),
		})
	}
	return out, sc.Err()
}

// unescapeMount undoes the kernel's octal escapes (\040 for a space, \011,
// \012, \134) in mountinfo paths.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			n, _ := strconv.ParseUint(s[i+1:i+4], 8, 8)
			b.WriteByte(byte(n))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

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

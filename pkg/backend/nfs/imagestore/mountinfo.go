package imagestore

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
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

// readMounts parses /proc/self/mountinfo (see proc(5)).
func readMounts() ([]mountEntry, error) {
	data, err := os.ReadFile(mountInfoPath)
	if err != nil {
		return nil, fmt.Errorf("imagestore: %w", err)
	}
	ms, err := parseMountInfo(data)
	if err != nil {
		return nil, fmt.Errorf("imagestore: %s: %w", mountInfoPath, err)
	}
	return ms, nil
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
			return nil, fmt.Errorf("line without separator: %q", line)
		}
		f := strings.Fields(pre)
		g := strings.Fields(post)
		if len(f) < 6 || len(g) < 2 {
			return nil, fmt.Errorf("short line: %q", line)
		}
		id, err1 := strconv.Atoi(f[0])
		parent, err2 := strconv.Atoi(f[1])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("bad mount ids in line %q", line)
		}
		e := mountEntry{
			ID:         id,
			ParentID:   parent,
			MountPoint: unescapeOctal(f[4]),
			FsType:     g[0],
			Source:     unescapeOctal(g[1]),
			Options:    strings.Split(f[5], ","),
		}
		if len(g) > 2 {
			e.SuperOptions = strings.Split(g[2], ",")
		}
		out = append(out, e)
	}
	return out, sc.Err()
}

// unescapeOctal undoes the kernel's \NNN escapes (space, tab, newline,
// backslash) in mountinfo fields.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
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

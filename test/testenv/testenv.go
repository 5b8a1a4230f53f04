// Package testenv sets up what the driver's integration and conformance
// tests run on: root, a size-capped tmpfs for pools and state, and cleanup
// that leaves no mount or loop device behind even when a test fails.
package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// RequireRoot skips tests that need loop devices and mounts when not root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: real loop devices, mkfs and mounts")
	}
	if testing.Short() {
		t.Skip("integration test skipped in -short mode")
	}
}

// Tmpfs mounts a tmpfs of the given size in a fresh temp dir and registers
// cleanup: every mount below it is unmounted (deepest first) and every loop
// device backed by a file below it is detached, then the tmpfs goes.
func Tmpfs(t testing.TB, size string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "modeguard-test-")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size+",mode=0700", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mounting tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		CleanupUnder(t, dir)
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmounting tmpfs %s: %v", dir, err)
		}
		os.RemoveAll(dir)
	})
	return dir
}

// CleanupUnder unmounts everything mounted below dir and detaches every loop
// device whose backing file lies below dir. It reports what it had to clean,
// because a test that leaves these behind has a bug worth seeing.
func CleanupUnder(t testing.TB, dir string) {
	t.Helper()
	for _, m := range MountsUnder(dir) {
		t.Logf("cleanup: unmounting leftover %s", m)
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", m, err)
		}
	}
	for _, dev := range LoopsUnder(dir) {
		t.Logf("cleanup: detaching leftover %s", dev)
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("detaching %s: %v: %s", dev, err, out)
		}
	}
}

// MountsUnder lists the mount points strictly below dir, deepest first.
func MountsUnder(dir string) []string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescape(f[4])
		if strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// LoopsUnder lists loop devices whose backing file lies below dir.
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
	return out
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Package testfiles has file helpers for storage tests: filling a
// filesystem up to its limit and reading its size. It imports nothing of
// the project, so any package's tests can use it.
package testfiles

import (
	"crypto/rand"
	"os"
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"
)

// WriteFile appends up to n bytes of random data to path, 1 MiB at a time,
// and returns how many landed with the error that stopped it (ENOSPC when a
// size limit is reached). The file is synced and closed before it returns.
func WriteFile(t testing.TB, path string, n int64) (int64, error) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	var written int64
	var werr error
	for written < n {
		chunk := buf[:min(int64(len(buf)), n-written)]
		if _, err := rand.Read(chunk); err != nil {
			t.Fatal(err)
		}
		k, err := f.Write(chunk)
		written += int64(k)
		if err != nil {
			werr = err
			break
		}
	}
	if err := f.Sync(); err != nil && werr == nil {
		werr = err
	}
	if err := f.Close(); err != nil && werr == nil {
		werr = err
	}
	return written, werr
}

// Statfs is what statfs reports for path as total and used bytes.
func Statfs(t testing.TB, path string) (total, used int64) {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Blocks-st.Bfree) * st.Bsize
}

// RequireLoopDevices skips the test unless it runs as root with loop devices
// and the named tools at hand; why says what the test does with them.
func RequireLoopDevices(t testing.TB, why string, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: " + why)
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (xfsprogs, util-linux, coreutils): %v", tool, err)
		}
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		t.Skipf("needs loop devices: %v", err)
	}
}

// MountSplit splits a mount option string as mount(8) (libmount), mount.nfs
// and the kernel do: at commas outside double quotes. ok is false when a
// quote is left open, which makes them drop or swallow the rest of the
// string. Fuzz targets use it to see options the way mount(8) will.
func MountSplit(optstr string) (opts []string, ok bool) {
	quoted, start := false, 0
	for i := 0; i < len(optstr); i++ {
		switch optstr[i] {
		case '"':
			quoted = !quoted
		case ',':
			if !quoted {
				opts = append(opts, optstr[start:i])
				start = i + 1
			}
		}
	}
	return append(opts, optstr[start:]), !quoted
}

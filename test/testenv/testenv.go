// Package testenv sets up what the driver's integration and conformance
// tests run on: root, a size-capped tmpfs for pools and state, and cleanup
// that leaves no mount or loop device behind even when a test fails.
package testenv

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/localcluster"
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

// SuiteEnv selects the tests that run only in make test-all: "all" runs
// them. make test, CI's gate, leaves it unset and runs, of the slow suites
// (VMs under emulation), the tests each promise of the driver rests on.
const SuiteEnv = "MODEGUARD_TESTS"

// OnlyInTestAll skips a test make test does not run, saying what covers
// its promise there instead.
func OnlyInTestAll(t testing.TB, coveredBy string) {
	t.Helper()
	if os.Getenv(SuiteEnv) != "all" {
		t.Skipf("runs in make test-all (%s=all); make test covers it with %s", SuiteEnv, coveredBy)
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
	for _, m := range localcluster.MountsUnder(dir) {
		t.Logf("cleanup: unmounting leftover %s", m)
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", m, err)
		}
	}
	for _, dev := range localcluster.LoopsUnder(dir) {
		t.Logf("cleanup: detaching leftover %s", dev)
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("detaching %s: %v: %s", dev, err, out)
		}
	}
}

// ReflinkXFS mounts a fresh xfs made with reflink=1 on a new temp dir and
// returns the dir: a pool filesystem where a copy is a clone sharing
// extents (FICLONE), as on a production pool that can snapshot volumes in
// use. Of the given size in bytes (xfs wants at least 300 MiB); see
// LoopFilesystem.
func ReflinkXFS(t testing.TB, size int64) string {
	t.Helper()
	return LoopFilesystem(t, size, "xfs", "-q", "-m", "reflink=1")
}

// LoopFilesystem mounts a fresh filesystem of type fsType, made by
// mkfs.<fsType> with mkfsArgs, on a new temp dir and returns the dir: a
// pool of a size of its own (in bytes) on the machine's disk, where a copy
// moves real bytes and fills only that pool. The filesystem lives in a
// sparse image next to the dir. Cleanup as Tmpfs; the loop device
// mount(8) made goes with the unmount.
func LoopFilesystem(t testing.TB, size int64, fsType string, mkfsArgs ...string) string {
	t.Helper()
	RequireRoot(t) // a loop device and a mount
	dir, err := os.MkdirTemp("", "modeguard-"+fsType+"-")
	if err != nil {
		t.Fatal(err)
	}
	image := dir + ".img"
	if err := os.WriteFile(image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cleanupImage := func() { os.Remove(image); os.Remove(dir) }
	if err := os.Truncate(image, size); err != nil {
		cleanupImage()
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs."+fsType, append(mkfsArgs, image)...).CombinedOutput(); err != nil {
		cleanupImage()
		t.Fatalf("mkfs.%s %s: %v: %s", fsType, strings.Join(mkfsArgs, " "), err, out)
	}
	if out, err := exec.Command("mount", "-t", fsType, "-o", "loop", image, dir).CombinedOutput(); err != nil {
		cleanupImage()
		t.Fatalf("mounting the %s image: %v: %s", fsType, err, out)
	}
	t.Cleanup(func() {
		CleanupUnder(t, dir)
		// A loop device detached while something (a probe, a scan of
		// every device) holds it open lets go of its file a moment later;
		// until then the filesystem is busy.
		var err error
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if err = unix.Unmount(dir, 0); err == nil || !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
				break
			}
		}
		if err != nil {
			t.Errorf("unmounting the %s at %s: %v", fsType, dir, err)
		}
		cleanupImage()
	})
	return dir
}

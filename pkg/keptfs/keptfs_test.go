package keptfs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/test/testfiles"
)

const imageSize = int64(512) << 20

func spec(t *testing.T, shared bool) Spec {
	t.Helper()
	testfiles.RequireLoopDevices(t, "mounts an xfs image on a loop device", "mkfs.xfs")
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := Spec{Dir: dir, Image: "fs.img", MountDir: "fs", Lock: ".fs.lock", Size: imageSize,
		Mount:  func(dev, mnt string) error { return unix.Mount(dev, mnt, "xfs", 0, "") },
		Shared: shared, What: "test filesystem"}
	t.Cleanup(func() { checkNothingLeft(t, s) })
	return s
}

// checkNothingLeft fails if the image is still mounted or bound (given a
// moment: a device marked autoclear goes at its last close).
func checkNothingLeft(t *testing.T, s Spec) {
	t.Helper()
	if m, err := mountAt(s.mnt()); err != nil || m != nil {
		t.Errorf("%s still mounted (%v)", s.mnt(), err)
		_ = unix.Unmount(s.mnt(), unix.MNT_DETACH)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		devs, err := loop.DevicesOf(s.image())
		if err != nil || len(devs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("image still bound to %v", devs)
			for _, d := range devs {
				_, _ = loop.DetachIfBackedBy(context.Background(), d, s.image())
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Ino
}

// An owned filesystem (the NFS pool's way): kept again while mounted it is
// reused, and any release unmounts and detaches it; kept after that, it
// is the same image with the same files, never formatted again.
func TestOwnedFilesystemIsReusedAndReleased(t *testing.T) {
	s := spec(t, false)
	ctx := context.Background()
	first, err := Keep(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = first.Release() })
	if !first.Formatted || first.Reused {
		t.Errorf("first keep: formatted %v reused %v", first.Formatted, first.Reused)
	}
	ino := inode(t, s.image())
	if err := os.WriteFile(filepath.Join(first.Root, "marker"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	second, err := Keep(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if !second.Reused || second.Device != first.Device {
		t.Errorf("second keep: reused %v device %s, first %s", second.Reused, second.Device, first.Device)
	}
	if err := second.Release(); err != nil {
		t.Fatal(err)
	}
	if err := first.Release(); err != nil {
		t.Errorf("release after the other: %v", err)
	}
	checkNothingLeft(t, s)

	third, err := Keep(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = third.Release() })
	if third.Formatted || inode(t, s.image()) != ino {
		t.Error("the image was made again")
	}
	if b, err := os.ReadFile(filepath.Join(third.Root, "marker")); err != nil || string(b) != "x" {
		t.Errorf("marker: %q %v", b, err)
	}
}

// A shared filesystem stays mounted while another keeper uses it; the
// last release unmounts it and its device detaches itself.
func TestSharedFilesystemStaysForItsLastKeeper(t *testing.T) {
	s := spec(t, true)
	ctx := context.Background()
	a, err := Keep(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Release() })
	b, err := Keep(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Release() })
	if b.Device != a.Device || !b.Reused {
		t.Errorf("second keeper: device %s reused %v, first %s", b.Device, b.Reused, a.Device)
	}
	if err := a.Release(); err != nil {
		t.Fatal(err)
	}
	if m, _ := mountAt(s.mnt()); m == nil {
		t.Fatal("released by one keeper of two, the filesystem is gone")
	}
	if err := b.Release(); err != nil {
		t.Fatal(err)
	}
	checkNothingLeft(t, s)
	// The users file of this namespace went with its last keeper.
	users, _ := usersFile(s, s.mnt())
	if _, err := os.Stat(users); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("users file left: %v", err)
	}
}

// Without an image and without a size to make one, nothing is made.
func TestNoImageWithoutSize(t *testing.T) {
	s := spec(t, true)
	s.Size = 0
	if _, err := Keep(context.Background(), s); err == nil {
		t.Fatal("Keep made or mounted something without an image or a size")
	}
	if _, err := os.Stat(s.image()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("image: %v", err)
	}
}

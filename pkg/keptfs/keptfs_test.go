package keptfs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
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
	return specOf(t, shared, XFS)
}

// specOf is a Spec of filesystem fs in a directory of the test's.
func specOf(t *testing.T, shared bool, fs string) Spec {
	t.Helper()
	testfiles.RequireLoopDevices(t, "mounts an image on a loop device", "mkfs."+fs)
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := Spec{Dir: dir, Image: "fs.img", MountDir: "fs", Lock: ".fs.lock", Size: imageSize, Filesystem: fs,
		Mount:  func(dev, mnt string) error { return unix.Mount(dev, mnt, fs, 0, "") },
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

	keptAgainHolds(t, s, ino, "x")
}

// keptAgainHolds keeps s again and fails unless it is the image of inode
// ino, not formatted again, whose file "marker" still reads want; it is
// released before it returns.
func keptAgainHolds(t *testing.T, s Spec, ino uint64, want string) {
	t.Helper()
	again, err := Keep(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = again.Release() })
	if again.Formatted || inode(t, s.image()) != ino {
		t.Error("the image was made again")
	}
	if b, err := os.ReadFile(filepath.Join(again.Root, "marker")); err != nil || string(b) != want {
		t.Errorf("marker: %q %v, want %q", b, err, want)
	}
	if err := again.Release(); err != nil {
		t.Fatal(err)
	}
}

// A shared filesystem, xfs or btrfs, stays mounted while another keeper
// uses it; the last release unmounts it and its device detaches itself.
func TestSharedFilesystemStaysForItsLastKeeper(t *testing.T) {
	for _, fs := range []string{XFS, Btrfs} {
		t.Run(fs, func(t *testing.T) { sharedFilesystemStaysForItsLastKeeper(t, fs) })
	}
}

func sharedFilesystemStaysForItsLastKeeper(t *testing.T, fs string) {
	s := specOf(t, true, fs)
	ctx := context.Background()
	a, err := Keep(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Release() })
	if m, err := mountAt(s.mnt()); err != nil || m == nil || m.FSType != fs {
		t.Fatalf("mounted at %s: %+v %v, want a %s", s.mnt(), m, err, fs)
	}
	if found, err := FilesystemOf(s.image()); err != nil || found != fs {
		t.Errorf("the image's superblock says %q (%v), want %s", found, err, fs)
	}
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

// An image is only ever mounted as the filesystem it holds: kept as the
// other one it is refused, saying what it holds, and stays as it was,
// neither formatted again nor bound to a loop device.
func TestImageOfTheOtherFilesystemIsRefused(t *testing.T) {
	for _, c := range []struct{ made, asked string }{{XFS, Btrfs}, {Btrfs, XFS}} {
		t.Run(c.made+" kept as "+c.asked, func(t *testing.T) {
			testfiles.RequireLoopDevices(t, "mounts an image on a loop device", "mkfs."+c.asked)
			s := specOf(t, true, c.made)
			ctx := context.Background()
			made, err := Keep(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(made.Root, "marker"), []byte("kept"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := made.Release(); err != nil {
				t.Fatal(err)
			}
			checkNothingLeft(t, s)
			ino := inode(t, s.image())

			other := s
			other.Filesystem = c.asked
			other.Mount = func(dev, mnt string) error { return unix.Mount(dev, mnt, c.asked, 0, "") }
			fs, err := Keep(ctx, other)
			if err == nil {
				_ = fs.Release()
				t.Fatalf("a %s image was kept as a %s", c.made, c.asked)
			}
			var refused *OtherFilesystemError
			if !errors.As(err, &refused) || refused.Found != c.made || refused.Want != c.asked {
				t.Fatalf("refusal %v, want an OtherFilesystemError finding %s", err, c.made)
			}
			if !strings.Contains(err.Error(), "holds "+c.made) {
				t.Errorf("refusal %q does not say the image holds %s", err, c.made)
			}
			checkNothingLeft(t, s)

			keptAgainHolds(t, s, ino, "kept")
		})
	}
}

// Without the mkfs of its filesystem, no image is made and nothing is
// bound or mounted; the error names the program and its package.
func TestMissingMkfsFailsClosed(t *testing.T) {
	s := specOf(t, true, Btrfs)
	t.Setenv("PATH", t.TempDir())
	_, err := Keep(context.Background(), s)
	if err == nil {
		t.Fatal("Keep made a btrfs image without mkfs.btrfs")
	}
	for _, want := range []string{"mkfs.btrfs", "btrfs-progs"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := os.Stat(s.image()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("image: %v", err)
	}
}

// A filesystem the kernel does not know is refused by name; one it has,
// loaded or not yet, is not.
func TestKernelWithoutTheFilesystem(t *testing.T) {
	testfiles.RequireLoopDevices(t, "tries a mount")
	probe := t.TempDir()
	err := kernelHas("modeguardnofs", probe)
	if err == nil || !strings.Contains(err.Error(), "the kernel has no modeguardnofs") {
		t.Errorf("a filesystem no kernel has: %v", err)
	}
	if err := kernelHas(Btrfs, probe); err != nil {
		t.Errorf("btrfs: %v", err)
	}
	if m, err := mountAt(probe); err != nil || m != nil {
		t.Errorf("the probe left a mount at %s: %+v %v", probe, m, err)
	}
}

package mounts

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMemoryBehavesAsTheKernelWhereThePluginCanTell holds the in-memory
// table to what the node plugin relies on in the kernel's.
func TestMemoryBehavesAsTheKernelWhereThePluginCanTell(t *testing.T) {
	dir := t.TempDir()
	staging, target, link := filepath.Join(dir, "staging"), filepath.Join(dir, "target"), filepath.Join(dir, "link")
	for _, d := range []string{staging, target} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	m := NewMemory()
	table := m.Table()

	if err := m.Bind(staging, filepath.Join(dir, "absent"), false); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a bind at a target that does not exist: %v, want ENOENT", err)
	}
	if err := m.Mount("server:/export", staging, "nfs4", false); err != nil {
		t.Fatal(err)
	}
	if err := m.Bind(staging, target, true); err != nil {
		t.Fatal(err)
	}
	got, err := table.At(filepath.Join(link, "target")) // through a link in the directory, as the kernel resolves it
	if err != nil || got == nil {
		t.Fatalf("At(target) = %v, %v; want the bind mount", got, err)
	}
	if got.Source != "server:/export" || got.FSType != "nfs4" || got.Options != "ro,relatime" {
		t.Errorf("a read-only bind of a mount point shows %+v; want the staged filesystem, read-only", got)
	}
	// A second mount stacked on the target is what the path shows, and
	// unmounting it uncovers the first.
	if err := m.Bind(staging, target, false); err != nil {
		t.Fatal(err)
	}
	if got, _ := table.At(target); got == nil || got.Options != "rw,relatime" {
		t.Errorf("after stacking a read/write bind, At shows %+v", got)
	}
	if err := m.Unmount(target); err != nil {
		t.Fatal(err)
	}
	if got, _ := table.At(target); got == nil || got.Options != "ro,relatime" {
		t.Errorf("after unmounting the top mount, At shows %+v; want the read-only one under it", got)
	}
	if err := m.Unmount(target); err != nil {
		t.Fatal(err)
	}
	if mounted, err := table.IsMounted(target); mounted || err != nil {
		t.Errorf("IsMounted after both unmounts = %v, %v", mounted, err)
	}
	if err := m.Unmount(target); !errors.Is(err, unix.EINVAL) {
		t.Errorf("unmounting what is not mounted: %v, want EINVAL", err)
	}
	if got := m.MountPoints(); !slices.Equal(got, []string{staging}) {
		t.Errorf("MountPoints = %v, want only the staging mount", got)
	}

	// A bind of something that is not a mount point (a device node) has
	// that path as its root, as UsersOf and Owns read it.
	dev := filepath.Join(dir, "dev")
	if err := os.WriteFile(dev, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := m.Bind(dev, file, false); err != nil {
		t.Fatal(err)
	}
	if got, _ := table.At(file); got == nil || got.Root != dev {
		t.Errorf("a bind of a plain path shows %+v; want its root to be %s", got, dev)
	}
}

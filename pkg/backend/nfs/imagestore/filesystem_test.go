package imagestore

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/test/testfiles"
)

func TestFilesystemIn(t *testing.T) {
	ext4 := make([]byte, 2048)
	binary.LittleEndian.PutUint16(ext4[ext4MagicOffset:], ext4Magic)
	swapped := make([]byte, 2048)
	binary.BigEndian.PutUint16(swapped[ext4MagicOffset:], ext4Magic)
	for _, tc := range []struct {
		name string
		head []byte
		want Filesystem // "" for a refusal
	}{
		{"xfs", append([]byte("XFSB"), make([]byte, 2044)...), XFS},
		{"xfs, short file", []byte("XFSB"), XFS},
		{"ext4", ext4, Ext4},
		{"ext4 magic in the wrong byte order", swapped, ""},
		{"ext4 magic cut short", ext4[:ext4MagicOffset+1], ""},
		{"zeros", make([]byte, 2048), ""},
		{"empty", nil, ""},
		{"lower-case xfs magic", append([]byte("xfsb"), make([]byte, 2044)...), ""},
	} {
		got, err := filesystemIn(tc.head, "img")
		if got != tc.want || (err == nil) != (tc.want != "") {
			t.Errorf("%s: %q, %v; want %q", tc.name, got, err, tc.want)
		}
		if err != nil && !strings.Contains(err.Error(), "neither an xfs nor an ext4") {
			t.Errorf("%s: the refusal does not say what is accepted: %v", tc.name, err)
		}
	}
}

func TestParseFilesystem(t *testing.T) {
	for in, want := range map[string]Filesystem{"xfs": XFS, "ext4": Ext4, "": "", "XFS": "", "ext3": "", "btrfs": ""} {
		got, err := ParseFilesystem(in)
		if got != want || (err == nil) != (want != "") {
			t.Errorf("ParseFilesystem(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := Open(context.Background(), t.TempDir(), "btrfs"); err == nil {
		t.Error("Open accepted a filesystem it cannot make")
	}
}

// ext4 images: small (16 MiB minimum, almost nothing written), size
// enforced, mounted as ext4, copied, restored, and growing as far as the
// process may (a mounted ext4 grows only with CAP_SYS_RESOURCE). A store
// switched from xfs to ext4 keeps serving its xfs images.
func TestExt4Images(t *testing.T) {
	xfsStore := newStore(t)
	ctx := context.Background()
	if err := xfsStore.Create(ctx, "volumes/old-xfs", 300*MiB); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(xfsStore.mountPath("volumes/old-xfs"), "f"), []byte("xfs data"), 0o644); err != nil {
		t.Fatal(err)
	}
	s, err := Open(ctx, xfsStore.Root(), Ext4) // the same root, switched
	if err != nil {
		t.Fatal(err)
	}
	testfiles.RequireLoopDevices(t, "formats ext4 images", "mkfs.ext4", "resize2fs")
	if s.MinSize() != 16*MiB {
		t.Errorf("MinSize %d, want 16 MiB", s.MinSize())
	}
	if err := s.Create(ctx, "volumes/tiny", 16*MiB-4096); err == nil {
		t.Error("Create below the ext4 minimum succeeded")
	}
	const rel = "volumes/small"
	if err := s.Create(ctx, rel, 32*MiB); err != nil {
		t.Fatal(err)
	}
	image, mnt := s.imagePath(rel), s.mountPath(rel)
	size, alloc := allocated(t, image)
	t.Logf("new 32 MiB ext4 image: %d KiB allocated", alloc>>10)
	if size != 32*MiB || alloc > 4*MiB {
		t.Errorf("image: %d bytes, %d allocated; want 32 MiB with at most 4 MiB written", size, alloc)
	}
	if m := checkMounted(t, s, rel); m.FSType != "ext4" {
		t.Errorf("mounted as %s, want ext4", m.FSType)
	}
	if st, err := os.Stat(mnt); err != nil || st.Mode().Perm() != RootDirMode {
		t.Errorf("filesystem root mode %v %v, want %v", st.Mode(), err, RootDirMode)
	}
	n, err := testfiles.WriteFile(t, filepath.Join(mnt, "big"), 40*MiB)
	if !errors.Is(err, syscall.ENOSPC) || n > 32*MiB {
		t.Fatalf("wrote %d bytes into a 32 MiB volume: %v", n, err)
	}
	if used, total, err := s.Usage(ctx, rel); err != nil || used < n-MiB || total > 32*MiB {
		t.Errorf("Usage: %d of %d, %v (wrote %d)", used, total, err, n)
	}
	if err := os.Remove(filepath.Join(mnt, "big")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "f"), []byte("ext4 data"), 0o644); err != nil {
		t.Fatal(err)
	}

	// Copies of both kinds of source are new ext4 filesystems.
	for src, want := range map[string]string{rel: "ext4 data", "volumes/old-xfs": "xfs data"} {
		dst := "snapshots/of-" + filepath.Base(src)
		if err := s.Copy(ctx, src, dst, 0); err != nil {
			t.Fatalf("Copy %s: %v", src, err)
		}
		if fs, err := filesystemOf(s.imagePath(dst)); err != nil || fs != Ext4 {
			t.Errorf("copy of %s holds %q (%v), want ext4", src, fs, err)
		}
		if b, err := os.ReadFile(filepath.Join(s.mountPath(dst), "f")); err != nil || string(b) != want {
			t.Errorf("copy of %s: %q %v", src, b, err)
		}
	}

	// A restart brings both kinds back.
	if err := s.Release(); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(ctx, s.Root(), Ext4)
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.RestoreAll(ctx, []string{rel, "volumes/old-xfs"}); err != nil {
		t.Fatal(err)
	}
	if m := checkMounted(t, s, "volumes/old-xfs"); m.FSType != "xfs" {
		t.Errorf("the xfs image came back as %s", m.FSType)
	}

	// Growing a mounted ext4: only with CAP_SYS_RESOURCE, and a refusal
	// says so.
	err = s2.Grow(ctx, rel, 64*MiB)
	if hasSysResource(t) {
		if err != nil {
			t.Fatalf("Grow: %v", err)
		}
		if total, _ := testfiles.Statfs(t, mnt); total <= 32*MiB {
			t.Errorf("after Grow to 64 MiB the filesystem has %d bytes", total)
		}
	} else {
		t.Logf("this process lacks CAP_SYS_RESOURCE: Grow must refuse and say why")
		if err == nil || !strings.Contains(err.Error(), "CAP_SYS_RESOURCE") {
			t.Errorf("Grow without CAP_SYS_RESOURCE: %v; want a refusal naming it", err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "f")); err != nil || string(b) != "ext4 data" {
		t.Errorf("data after Grow: %q %v", b, err)
	}
}

// hasSysResource reports whether the process may resize a mounted ext4.
func hasSysResource(t *testing.T) bool {
	t.Helper()
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		t.Fatal(err)
	}
	return data[unix.CAP_SYS_RESOURCE/32].Effective&(1<<(unix.CAP_SYS_RESOURCE%32)) != 0
}

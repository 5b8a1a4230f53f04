package imagestore

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/command"
)

// Filesystem is what an image holds. The store formats new images with the
// one it was opened with and reads the filesystem of an existing image from
// the image itself, so a store can switch for new volumes and keep serving
// the old ones.
//
// xfs grows without CAP_SYS_RESOURCE and copies by reflink on an xfs root,
// but mkfs.xfs refuses filesystems under 300 MiB and writes its whole
// 64 MiB log into each image. ext4 takes 16 MiB and writes a few hundred
// KiB (its journal and inode tables stay holes: mke2fs knows a file's holes
// read as zeros), so a thousand small volumes fit on a small disk; growing
// a mounted ext4 needs CAP_SYS_RESOURCE (the kernel refuses the resize
// ioctl without it, to root too).
type Filesystem string

const (
	XFS  Filesystem = "xfs"
	Ext4 Filesystem = "ext4"
)

// ParseFilesystem reads a flag's value.
func ParseFilesystem(s string) (Filesystem, error) {
	switch f := Filesystem(s); f {
	case XFS, Ext4:
		return f, nil
	}
	return "", fmt.Errorf("imagestore: filesystem %q is not one of xfs, ext4", s)
}

// MinSize is the smallest image of the filesystem.
func (f Filesystem) MinSize() int64 {
	if f == Ext4 {
		return 16 << 20
	}
	return 300 << 20 // mkfs.xfs refuses smaller filesystems
}

// tools are the programs the store runs for images of f.
func (f Filesystem) tools() []string {
	if f == Ext4 {
		return []string{"mkfs.ext4", "resize2fs"}
	}
	return []string{"mkfs.xfs", "xfs_growfs"}
}

// mkfs formats the image file path.
func (f Filesystem) mkfs(ctx context.Context, path string) error {
	var err error
	if f == Ext4 {
		// 4 KiB blocks whatever the size (mke2fs would take 1 KiB for
		// small ones, which grow badly); no blocks reserved for root, whom
		// the server squashes anyway; lazy inits, which on a file's holes
		// write nothing.
		_, err = command.Run(ctx, "mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0",
			"-E", "lazy_itable_init=1,lazy_journal_init=1", path)
	} else {
		_, err = command.Run(ctx, "mkfs.xfs", "-q", path)
	}
	return err
}

// mountOptions are the filesystem-specific options of every mount.
func (f Filesystem) mountOptions() string {
	if f == Ext4 {
		// A copy is a fresh filesystem with its own UUID (see Copy), so
		// ext4 needs nothing like xfs's nouuid; an error makes the
		// volume read-only rather than go on writing a damaged tree.
		return "errors=remount-ro"
	}
	// A copy made by an older store, or by hand, may share its source's
	// UUID, and xfs refuses a second filesystem with the same one.
	return "nouuid"
}

// grow grows the filesystem mounted at mnt from dev to dev's size.
func (f Filesystem) grow(ctx context.Context, dev, mnt string) error {
	if f == Ext4 {
		if _, err := command.Run(ctx, "resize2fs", dev); err != nil {
			return fmt.Errorf("%w (growing a mounted ext4 needs CAP_SYS_RESOURCE)", err)
		}
		return nil
	}
	_, err := command.Run(ctx, "xfs_growfs", "-d", mnt)
	return err
}

// Where each filesystem keeps its magic number.
const (
	xfsMagic        = "XFSB" // at byte 0
	ext4MagicOffset = 1024 + 0x38
	ext4Magic       = 0xEF53 // little-endian
)

// filesystemOf reads which filesystem the image at path holds from its
// superblock, refusing anything the store does not make.
func filesystemOf(path string) (Filesystem, error) {
	file, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("imagestore: %w", err)
	}
	defer file.Close()
	head := make([]byte, ext4MagicOffset+2)
	n, err := io.ReadFull(file, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("imagestore: reading the superblock of %s: %w", path, err)
	}
	return filesystemIn(head[:n], path)
}

// filesystemIn tells the filesystem from the first bytes of an image.
func filesystemIn(head []byte, path string) (Filesystem, error) {
	switch {
	case len(head) >= len(xfsMagic) && string(head[:len(xfsMagic)]) == xfsMagic:
		return XFS, nil
	case len(head) >= ext4MagicOffset+2 && binary.LittleEndian.Uint16(head[ext4MagicOffset:]) == ext4Magic:
		return Ext4, nil
	}
	return "", fmt.Errorf("imagestore: %s holds neither an xfs nor an ext4 filesystem; refusing to mount it", path)
}

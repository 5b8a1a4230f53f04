package testenv

// Real backends set up as tests of more than one package use them: block
// pools on a tmpfs of their own, and an NFS controller with its own
// ganesha on loopback.

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
)

// Pools makes one block pool directory per zone on a fresh tmpfs of the
// given size (mount's notation, "512m"), with Tmpfs's cleanup, and returns
// them as block.NewController takes them. The tmpfs is theirs alone, so
// their free space moves only with what the test does.
func Pools(t testing.TB, size string, zones ...string) map[string]string {
	t.Helper()
	root := Tmpfs(t, size)
	pools := make(map[string]string, len(zones))
	for _, zone := range zones {
		dir := filepath.Join(root, "pool-"+zone)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		pools[zone] = dir
	}
	return pools
}

// NFSController runs the NFS backend's controller as the driver does
// (nfs.Setup: storage chosen and prepared, its own ganesha) on loopback at
// a free port, with its export root in dir/nfs and ganesha's files in
// dir/ganesha, and registers its stop. The pool image is poolImageSize
// bytes. It skips the test where ganesha, its bus or mkfs.xfs is missing.
func NFSController(t testing.TB, dir string, poolImageSize int64) *nfs.Controller {
	t.Helper()
	for _, cmd := range []string{"ganesha.nfsd", "dbus-daemon", "mkfs.xfs"} {
		if _, err := exec.LookPath(cmd); err != nil {
			t.Skipf("needs %s (Debian packages nfs-ganesha nfs-ganesha-vfs dbus xfsprogs)", cmd)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ctrl, stop, err := nfs.Setup(ctx, nfs.Options{
		ExportRoot: filepath.Join(dir, "nfs"), PoolImageSize: poolImageSize, Storage: "auto",
		Server: "127.0.0.1", Port: FreePort(t), ListenAddress: "127.0.0.1", GaneshaDir: filepath.Join(dir, "ganesha"),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("ganesha.log:\n%s", ReadFile(filepath.Join(dir, "ganesha", "ganesha.log")))
		}
		stop()
		CleanupUnder(t, dir)
	})
	return ctrl
}

// FreePort is a TCP port of loopback that nothing listened on a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// WriteRanges writes fill over each range of the image at path and syncs
// it: known blocks for tests of which blocks hold data or changed. A fill
// other than zero keeps them from being taken for holes.
func WriteRanges(t testing.TB, path string, fill byte, ranges ...backend.BlockRange) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, r := range ranges {
		if _, err := f.WriteAt(bytes.Repeat([]byte{fill}, int(r.Length)), r.Offset); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

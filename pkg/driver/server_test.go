package driver_test

import (
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/modeguard/modeguard/pkg/driver"
)

// TestListenSocketMode checks that the CSI socket is 0660 and its new
// directory 0750 even under umask 0, where a socket left to the umask would
// be open to every user; that a stale socket is replaced the same way; and
// that the process's umask is left as it was.
func TestListenSocketMode(t *testing.T) {
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) })

	dir := filepath.Join(t.TempDir(), "run", "modeguard")
	sock := filepath.Join(dir, "csi.sock")
	check := func(what string) {
		t.Helper()
		fi, err := os.Lstat(sock)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o660 {
			t.Errorf("%s: socket mode %v, want srw-rw----", what, fi.Mode())
		}
		di, err := os.Stat(dir)
		if err != nil {
			t.Fatal(err)
		}
		if di.Mode().Perm() != 0o750 {
			t.Errorf("%s: socket directory mode %v, want 0750", what, di.Mode().Perm())
		}
		if now := syscall.Umask(0); now != 0 {
			t.Errorf("%s: Listen left the umask at %#o, want it restored to 0", what, now)
		}
	}

	l, err := driver.Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	check("first listen")
	if c, err := net.Dial("unix", sock); err != nil {
		t.Errorf("root cannot connect to the socket: %v", err)
	} else {
		c.Close()
	}
	// A killed driver leaves its socket behind; the next start replaces it.
	if ul, ok := l.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	l.Close()
	if _, err := os.Lstat(sock); err != nil {
		t.Fatalf("no stale socket to replace: %v", err)
	}
	l, err = driver.Listen("unix://" + sock)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	defer l.Close()
	check("listen over a stale socket")
}

// A storage target's socket is root's alone.
func TestListenModeForTheTarget(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "target.sock")
	l, err := driver.ListenMode("unix://"+sock, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if fi, err := os.Lstat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("target socket: %v, %v; want srw-------", fi.Mode(), err)
	}
}

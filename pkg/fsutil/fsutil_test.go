package fsutil

import (
	"bytes"
	"errors"
	"golang.org/x/sys/unix"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// entries lists dir's names, to catch temporary files left behind.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

func onlyEntry(t *testing.T, dir, want string) {
	t.Helper()
	if names := entries(t, dir); len(names) != 1 || names[0] != want {
		t.Errorf("directory holds %q, want only %q (temporary files left behind?)", names, want)
	}
}

func TestWriteFileAtomic(t *testing.T) {
	old := syscall.Umask(0o077) // the mode must not depend on the umask
	defer syscall.Umask(old)

	dir := t.TempDir()
	path := filepath.Join(dir, "state")
	if err := WriteFileAtomic(path, []byte("first"), 0o644); err != nil {
		t.Fatal(err)
	}
	checkFile(t, path, "first", 0o644)
	onlyEntry(t, dir, "state")

	// Replace it: new content, new mode, still one file.
	if err := WriteFileAtomic(path, []byte("second, longer than the first"), 0o600); err != nil {
		t.Fatal(err)
	}
	checkFile(t, path, "second, longer than the first", 0o600)
	onlyEntry(t, dir, "state")

	// Shorter content leaves no tail of the old one.
	if err := WriteFileAtomic(path, []byte("3"), 0o600); err != nil {
		t.Fatal(err)
	}
	checkFile(t, path, "3", 0o600)

	// Empty content is content.
	if err := WriteFileAtomic(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	checkFile(t, path, "", 0o600)
	onlyEntry(t, dir, "state")
}

func TestWriteFileAtomicReplacesASymlinkNotItsTarget(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("untouched"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(link, []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	checkFile(t, target, "untouched", 0o600)
	fi, err := os.Lstat(link)
	if err != nil {
		t.Fatal(err)
	}
	if !fi.Mode().IsRegular() {
		t.Errorf("link is still %v, want a regular file", fi.Mode())
	}
	checkFile(t, link, "new", 0o600)
}

func TestWriteFileAtomicFailureLeavesOldContentAndNoTemp(t *testing.T) {
	dir := t.TempDir()
	// path is a non-empty directory: the rename must fail.
	path := filepath.Join(dir, "busy")
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(path, "inside"), []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(path, []byte("x"), 0o600); err == nil {
		t.Fatal("WriteFileAtomic over a non-empty directory succeeded")
	}
	onlyEntry(t, dir, "busy")
	checkFile(t, filepath.Join(path, "inside"), "keep", 0o600)

	// A missing directory is an error, not a panic or a stray file.
	if err := WriteFileAtomic(filepath.Join(dir, "missing", "f"), []byte("x"), 0o600); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("WriteFileAtomic into a missing directory: %v, want os.ErrNotExist", err)
	}
}

func checkFile(t *testing.T, path, content string, perm os.FileMode) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != content {
		t.Errorf("%s holds %q, want %q", path, got, content)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != perm {
		t.Errorf("%s has mode %v, want %v", path, fi.Mode().Perm(), perm)
	}
}

type record struct {
	Name  string            `json:"name"`
	Count int               `json:"count"`
	Tags  map[string]string `json:"tags,omitempty"`
}

func TestWriteJSONAtomicAndReadJSON(t *testing.T) {
	old := syscall.Umask(0) // 0600 even when the umask would allow more
	defer syscall.Umask(old)

	dir := t.TempDir()
	path := filepath.Join(dir, "rec.json")
	in := record{Name: "pvc-1", Count: 3, Tags: map[string]string{"zone": "a"}}
	if err := WriteJSONAtomic(path, in); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasSuffix(data, []byte("}\n")) || !bytes.Contains(data, []byte("\n  \"name\": \"pvc-1\"")) {
		t.Errorf("file is not indented JSON ending in a newline:\n%s", data)
	}
	checkFile(t, path, string(data), 0o600)
	onlyEntry(t, dir, "rec.json")

	var out record
	if err := ReadJSON(path, &out); err != nil {
		t.Fatal(err)
	}
	if out.Name != in.Name || out.Count != in.Count || out.Tags["zone"] != "a" {
		t.Errorf("ReadJSON = %+v, want %+v", out, in)
	}

	// Overwrite with a different value.
	if err := WriteJSONAtomic(path, record{Name: "pvc-2"}); err != nil {
		t.Fatal(err)
	}
	out = record{}
	if err := ReadJSON(path, &out); err != nil || out.Name != "pvc-2" || out.Count != 0 || out.Tags != nil {
		t.Errorf("after overwrite ReadJSON = %+v, %v", out, err)
	}
	onlyEntry(t, dir, "rec.json")

	// A value JSON cannot encode writes nothing.
	if err := WriteJSONAtomic(filepath.Join(dir, "bad.json"), func() {}); err == nil {
		t.Error("WriteJSONAtomic of a func succeeded")
	}
	onlyEntry(t, dir, "rec.json")
}

func TestReadJSONErrors(t *testing.T) {
	dir := t.TempDir()
	var v record

	err := ReadJSON(filepath.Join(dir, "absent.json"), &v)
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ReadJSON of a missing file: %v, want errors.Is os.ErrNotExist", err)
	}

	corrupt := filepath.Join(dir, "corrupt.json")
	if err := os.WriteFile(corrupt, []byte(`{"name": "trunc`), 0o600); err != nil {
		t.Fatal(err)
	}
	err = ReadJSON(corrupt, &v)
	if err == nil {
		t.Fatal("ReadJSON of a truncated file succeeded")
	}
	if errors.Is(err, os.ErrNotExist) {
		t.Errorf("corrupt file reported as missing: %v", err)
	}
	if !strings.Contains(err.Error(), corrupt) {
		t.Errorf("error %q does not name the file", err)
	}

	empty := filepath.Join(dir, "empty.json")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ReadJSON(empty, &v); err == nil || errors.Is(err, os.ErrNotExist) {
		t.Errorf("ReadJSON of an empty file: %v, want a decode error", err)
	}
}

func TestRemoveDurably(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := RemoveDurably(path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("file still there: %v", err)
	}
	if err := RemoveDurably(path); err != nil {
		t.Errorf("removing an absent file: %v, want nil", err)
	}
	// A non-empty directory cannot be removed: that is reported.
	sub := filepath.Join(dir, "sub")
	if err := os.MkdirAll(filepath.Join(sub, "child"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := RemoveDurably(sub); err == nil {
		t.Error("RemoveDurably of a non-empty directory succeeded")
	}
}

func TestSyncDir(t *testing.T) {
	if err := SyncDir(t.TempDir()); err != nil {
		t.Errorf("SyncDir: %v", err)
	}
	if err := SyncDir(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("SyncDir of a missing directory: %v, want os.ErrNotExist", err)
	}
}

func TestJoinWithin(t *testing.T) {
	base := "/var/lib/modeguard/volumes"
	good := []struct{ name, want string }{
		{"block_zone-a_vol-0123", base + "/block_zone-a_vol-0123"},
		{"...", base + "/..."},
		{".hidden", base + "/.hidden"},
		{"a..b", base + "/a..b"},
		{`back\slash`, base + `/back\slash`},
		{"with space", base + "/with space"},
	}
	for _, g := range good {
		got, err := JoinWithin(base, g.name)
		if err != nil || got != g.want {
			t.Errorf("JoinWithin(%q, %q) = %q, %v; want %q", base, g.name, got, err, g.want)
		}
	}
	bad := []string{"", ".", "..", "a/b", "/", "/etc", "../x", "x/..", "a/", "\x00", "a\x00b", "..\x00"}
	for _, name := range bad {
		got, err := JoinWithin(base, name)
		if err == nil {
			t.Errorf("JoinWithin(%q, %q) = %q, want an error", base, name, got)
			continue
		}
		if got != "" {
			t.Errorf("JoinWithin(%q, %q) returned %q alongside the error", base, name, got)
		}
	}
}

func TestCheckCOPath(t *testing.T) {
	tests := []struct {
		p      string
		ok     bool
		reason string // a word the error must contain
	}{
		{"/var/lib/kubelet/pods/x/volumes/mount", true, ""},
		{"/var/lib/kubelet/pods/0b1e/volumes/kubernetes.io~csi/pvc-1/mount", true, ""},
		{"/var/lib/kubelet/plugins/kubernetes.io/csi/modeguard/abc/globalmount", true, ""},
		{"/tmp/csi-mount/target", true, ""},
		{"/a", true, ""},
		{"/a b/c", true, ""},
		{"/a/...", true, ""},
		{"", false, "required"},
		{"relative/path", false, "absolute"},
		{"./a", false, "absolute"},
		{"../a", false, "absolute"},
		{"/a/../b", false, "clean"},
		{"/a/./b", false, "clean"},
		{"/a//b", false, "clean"},
		{"//a", false, "clean"},
		{"/a/..", false, "clean"},
		{"/..", false, "clean"},
		{"/a/b/.", false, "clean"},
		{"/a/b/", false, "clean"}, // filepath.Dir would name the path itself
		{"/a/b//", false, "clean"},
		{"/", false, "/"},
		{"//", false, ""},
		{"///", false, ""},
		{"/a\x00b", false, "NUL"},
		{"\x00", false, "NUL"},
	}
	for _, tt := range tests {
		err := CheckCOPath("target_path", tt.p)
		if tt.ok {
			if err != nil {
				t.Errorf("CheckCOPath(%q) = %v, want nil", tt.p, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("CheckCOPath(%q) = nil, want an error", tt.p)
			continue
		}
		if !strings.Contains(err.Error(), "target_path") || !strings.Contains(err.Error(), tt.reason) {
			t.Errorf("CheckCOPath(%q) = %q, want it to name the field and say %q", tt.p, err, tt.reason)
		}
	}
}

func TestStatfsWithin(t *testing.T) {
	st, err := StatfsWithin(t.TempDir(), 5*time.Second)
	if err != nil || st.Blocks == 0 || st.Bsize == 0 {
		t.Fatalf("statfs of a directory: %+v, %v", st, err)
	}
	if _, err := StatfsWithin(filepath.Join(t.TempDir(), "missing"), 5*time.Second); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("statfs of a missing path: %v, want ENOENT", err)
	}
}

// TestStatfsOneProbePerPath_FakeStatfs: a statfs that never returns (what a
// hard NFS mount of a dead server does) is replaced by one that blocks until
// released, as no local filesystem can be made to hang. However often the
// path is polled, one call is in flight; polls after the first deadline
// answer at once; once the call returns, the next poll probes afresh.
func TestStatfsOneProbePerPath_FakeStatfs(t *testing.T) {
	release := make(chan struct{})
	var calls atomic.Int32
	statfs = func(path string, st *unix.Statfs_t) error {
		calls.Add(1)
		if path == "/dead" {
			<-release
			return unix.EIO
		}
		st.Blocks, st.Bsize = 1, 1
		return nil
	}
	t.Cleanup(func() { statfs = unix.Statfs })

	if _, err := StatfsWithin("/dead", 50*time.Millisecond); !errors.Is(err, ErrNoAnswer) {
		t.Fatalf("first poll of a dead mount: %v, want ErrNoAnswer", err)
	}
	start := time.Now()
	for i := 0; i < 10000; i++ {
		if _, err := StatfsWithin("/dead", time.Minute); !errors.Is(err, ErrNoAnswer) {
			t.Fatalf("poll %d: %v, want ErrNoAnswer", i, err)
		}
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("10,000 polls past the first deadline took %v: they must not wait again", d)
	}
	if n := calls.Load(); n != 1 || StatfsInFlight() != 1 {
		t.Errorf("statfs called %d times, %d in flight; want exactly 1 call for 10,001 polls", n, StatfsInFlight())
	}
	// Another path is not held up by the dead one.
	if _, err := StatfsWithin("/alive", time.Second); err != nil {
		t.Errorf("statfs of another path while one hangs: %v", err)
	}
	close(release)
	for StatfsInFlight() != 0 {
		time.Sleep(time.Millisecond)
	}
	// The server answers again: the next poll makes a new call and gets its answer.
	if _, err := StatfsWithin("/dead", time.Second); !errors.Is(err, unix.EIO) {
		t.Errorf("poll after the hung call returned: %v, want the new call's EIO", err)
	}
	if n := calls.Load(); n != 3 {
		t.Errorf("statfs called %d times, want 3", n)
	}
}

// fakeDirSyncs replaces the directory fsync for one test.
func fakeDirSyncs(t *testing.T, fake func(dir string) error) {
	t.Helper()
	real := fsyncDir
	fsyncDir = fake
	t.Cleanup(func() { fsyncDir = real })
}

// TestSyncDirWaitsForASyncThatStartsAfterIt_FakeFsync: a sync already under
// way when a caller arrives may have missed its change, so the caller waits
// for the next one; callers waiting together share that next one.
func TestSyncDirWaitsForASyncThatStartsAfterIt_FakeFsync(t *testing.T) {
	var started atomic.Int32
	release := make(chan struct{})
	firstRunning := make(chan struct{})
	fakeDirSyncs(t, func(string) error {
		if started.Add(1) == 1 {
			close(firstRunning)
			<-release
		}
		return nil
	})
	dir := t.TempDir()
	first := make(chan error, 1)
	go func() { first <- SyncDir(dir) }()
	<-firstRunning

	const late = 8
	lateDone := make(chan error, late)
	for range late {
		go func() { lateDone <- SyncDir(dir) }()
	}
	// Wait until every late caller waits behind the running sync.
	for waiting := 0; waiting < late; time.Sleep(time.Millisecond) {
		dirSyncs.mu.Lock()
		g := dirSyncs.groups[dir]
		dirSyncs.mu.Unlock()
		g.mu.Lock()
		waiting = g.waiting
		g.mu.Unlock()
	}
	select {
	case err := <-lateDone:
		t.Fatalf("a caller that arrived during a sync returned (%v) before any sync started after it", err)
	default:
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range late {
		if err := <-lateDone; err != nil {
			t.Fatal(err)
		}
	}
	if n := started.Load(); n != 2 {
		t.Fatalf("%d syncs for one caller and %d that arrived together; want 2 (theirs shared)", n, late)
	}
}

// TestSyncDirReportsAFailedSyncToThoseItCovered_FakeFsync: every caller a
// failed sync was meant to cover gets its error; later callers get a new
// sync.
func TestSyncDirReportsAFailedSyncToThoseItCovered_FakeFsync(t *testing.T) {
	fail := errors.New("EIO")
	var calls atomic.Int32
	fakeDirSyncs(t, func(string) error {
		if calls.Add(1) == 1 {
			return fail
		}
		return nil
	})
	dir := t.TempDir()
	if err := SyncDir(dir); !errors.Is(err, fail) {
		t.Fatalf("SyncDir = %v, want the sync's error", err)
	}
	if err := SyncDir(dir); err != nil {
		t.Fatalf("the next SyncDir = %v, want a sync of its own that succeeds", err)
	}
	if n := calls.Load(); n != 2 {
		t.Fatalf("%d syncs, want 2", n)
	}
}

// TestSyncDirKeepsNoStateForIdleDirectories: the per-directory groups go
// when their last caller leaves, so syncing many directories over a long
// life holds nothing.
func TestSyncDirKeepsNoStateForIdleDirectories(t *testing.T) {
	for i := range 20 {
		dir := filepath.Join(t.TempDir(), strconv.Itoa(i))
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := SyncDir(dir); err != nil {
			t.Fatal(err)
		}
	}
	dirSyncs.mu.Lock()
	defer dirSyncs.mu.Unlock()
	if n := len(dirSyncs.groups); n != 0 {
		t.Fatalf("%d directory groups kept after their syncs ended", n)
	}
}

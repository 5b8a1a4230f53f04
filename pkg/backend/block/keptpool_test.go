package block

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/test/testenv"

	mtab "github.com/modeguard/modeguard/pkg/mounts"
)

// outerSize is the filesystem each test makes to hold a pool directory:
// above xfs's minimum, so a kept pool fits in it.
const outerSize = 1024 * mib

// outerDir makes a pool directory on a filesystem of its own of the kind
// named: ext4, tmpfs, or xfs made without reflinks.
func outerDir(t *testing.T, kind string) string {
	t.Helper()
	var fs string
	switch kind {
	case "ext4":
		fs = testenv.LoopFilesystem(t, outerSize, "ext4", "-q")
	case "tmpfs":
		fs = testenv.Tmpfs(t, fmt.Sprint(outerSize))
	case "xfs-noreflink":
		fs = testenv.LoopFilesystem(t, outerSize, "xfs", "-q", "-m", "reflink=0")
	default:
		t.Fatalf("no outer filesystem %q", kind)
	}
	dir := filepath.Join(fs, "pool")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// keepPools is KeepPools with auto, released when the test ends (before
// the outer filesystems go), with a check that the release left no mount
// of a kept image and no loop device bound to one.
func keepPools(t *testing.T, pools map[string]string) *KeptPools {
	t.Helper()
	return keepPoolsAs(t, pools, PoolFilesystemAuto)
}

// keepPoolsAs is keepPools with the --block-pool-filesystem value given.
func keepPoolsAs(t *testing.T, pools map[string]string, filesystem string) *KeptPools {
	t.Helper()
	k, err := KeepPools(context.Background(), pools, filesystem)
	if err != nil {
		t.Fatalf("KeepPools: %v", err)
	}
	t.Cleanup(func() {
		if err := k.Release(); err != nil {
			t.Errorf("Release: %v", err)
		}
		for _, dir := range pools {
			assertKeptReleased(t, dir)
		}
	})
	return k
}

// assertKeptReleased fails if dir's kept image is still mounted here or
// still bound to a loop device (given a moment: the device detaches itself
// at its last close).
func assertKeptReleased(t *testing.T, dir string) {
	t.Helper()
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	image := filepath.Join(real, KeptImageName)
	if n := mountsAt(t, filepath.Join(real, KeptMountDir)); n != 0 {
		t.Errorf("%d mounts left at %s", n, filepath.Join(real, KeptMountDir))
	}
	if _, err := os.Stat(image); err != nil {
		return
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		devs, err := loop.DevicesOfFile(image)
		if err != nil {
			t.Fatal(err)
		}
		if len(devs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("kept image %s still bound to %v", image, devs)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func mountsAt(t *testing.T, path string) int {
	t.Helper()
	all, err := mtab.All()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range all {
		if m.Mountpoint == path {
			n++
		}
	}
	return n
}

// TestSnapshotOfAVolumeInUseOnAKeptPool: on a pool directory whose
// filesystem has no reflinks (ext4, tmpfs, xfs made with reflink=0), the
// pool the driver keeps there (an xfs, or with btrfs a btrfs) snapshots and
// clones a volume a workload is writing and fsyncing, and every record
// acknowledged before each call is in the copy, restored read-only,
// read/write and cloned; the kept filesystem's creations share their
// syncs. Without the kept pool those calls are refused
// (TestSnapshotOfAVolumeInUse's plain pool).
func TestSnapshotOfAVolumeInUseOnAKeptPool(t *testing.T) {
	requireRoot(t)
	for _, c := range []struct{ outer, choice, fs string }{
		{"ext4", PoolFilesystemXFS, "xfs"},
		{"tmpfs", PoolFilesystemAuto, "btrfs"},
		{"xfs-noreflink", PoolFilesystemXFS, "xfs"},
		{"ext4", PoolFilesystemBtrfs, "btrfs"},
	} {
		t.Run(c.outer+" "+c.choice, func(t *testing.T) {
			root := testRoot(t)
			dir := outerDir(t, c.outer)
			k := keepPoolsAs(t, map[string]string{"zone-a": dir}, c.choice)
			pool := k.Roots["zone-a"]
			real, _ := filepath.EvalSymlinks(dir)
			if pool != filepath.Join(real, KeptMountDir) {
				t.Fatalf("pool root %s, want the kept mount in %s", pool, real)
			}
			if fsType := mountedFsType(t, pool); fsType != c.fs {
				t.Fatalf("pool root is %s, want %s", fsType, c.fs)
			}
			if !fsutil.SyncsShared(filepath.Join(pool, volumesDir, "x.img")) {
				t.Errorf("the kept %s's creations do not share their syncs", c.fs)
			}
			f := openFixture(t, root, k.Roots)
			snapshotsWhileWriting(t, f, fsExt4, true)

			// The space promised is the lesser of the kept xfs's and the
			// filesystem's under it.
			var outerFS unix.Statfs_t
			if err := unix.Statfs(dir, &outerFS); err != nil {
				t.Fatal(err)
			}
			capacity, err := f.ctrl.Capacity(context.Background(), "zone-a")
			if err != nil {
				t.Fatal(err)
			}
			if outerFree := int64(outerFS.Bavail) * int64(outerFS.Bsize); capacity > outerFree {
				t.Errorf("capacity %d is more than the %d free under the kept image", capacity, outerFree)
			}
		})
	}
}

// TestKeptPoolIsSharedAndReleased: a second keeper in the same process
// (another role) and one in another mount namespace (another pod) mount
// the very loop device the first one attached, never a second one; the
// filesystem stays mounted while another keeper uses it, and the device
// goes with the last mount. Kept again, it is the same image with the same
// files. So for a kept xfs and a kept btrfs alike.
func TestKeptPoolIsSharedAndReleased(t *testing.T) {
	requireRoot(t)
	for _, choice := range []string{PoolFilesystemXFS, PoolFilesystemBtrfs} {
		t.Run(choice, func(t *testing.T) { keptPoolIsSharedAndReleased(t, choice) })
	}
}

func keptPoolIsSharedAndReleased(t *testing.T, choice string) {
	testRoot(t)
	ctx := context.Background()
	dir := outerDir(t, "ext4")
	pools := map[string]string{"zone-a": dir}
	real, _ := filepath.EvalSymlinks(dir)
	image := filepath.Join(real, KeptImageName)
	mnt := filepath.Join(real, KeptMountDir)
	t.Cleanup(func() { assertKeptReleased(t, dir) })

	first, err := KeepPools(ctx, pools, choice)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = first.Release() })
	if fsType := mountedFsType(t, mnt); fsType != choice {
		t.Fatalf("kept pool is a %s, want a %s", fsType, choice)
	}
	st, err := os.Stat(image)
	if err != nil {
		t.Fatal(err)
	}
	if allocated := st.Sys().(*syscall.Stat_t).Blocks * 512; allocated > st.Size()/4 {
		t.Errorf("kept image is not sparse: %d of %d bytes allocated", allocated, st.Size())
	}
	ino := st.Sys().(*syscall.Stat_t).Ino
	devs, err := loop.DevicesOf(image)
	if err != nil || len(devs) != 1 {
		t.Fatalf("devices of the kept image: %v %v", devs, err)
	}
	dev := devs[0]
	if err := os.WriteFile(filepath.Join(mnt, "marker"), []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}

	second, err := KeepPools(ctx, pools, choice)
	if err != nil {
		t.Fatalf("KeepPools again: %v", err)
	}
	t.Cleanup(func() { _ = second.Release() })
	if second.Roots["zone-a"] != mnt || mountsAt(t, mnt) != 1 {
		t.Errorf("second keeper: root %s, %d mounts at %s; want the one mount there", second.Roots["zone-a"], mountsAt(t, mnt), mnt)
	}

	// Another mount namespace, without this one's mount: it mounts the
	// same device, and sees and writes the same filesystem.
	other := startOtherNamespaceKeeper(t, dir, mnt, choice)
	if other.device != dev {
		t.Errorf("the other namespace mounted %s, this one %s", other.device, dev)
	}
	if devs, _ := loop.DevicesOf(image); len(devs) != 1 {
		t.Errorf("kept image bound to %v, want only %s", devs, dev)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "from-other")); err != nil || string(b) != "other" {
		t.Errorf("a file the other namespace wrote reads %q, %v", b, err)
	}

	// Releases: mounted while anyone keeps it.
	if err := first.Release(); err != nil {
		t.Fatal(err)
	}
	if mountsAt(t, mnt) != 1 {
		t.Fatalf("released by one keeper of two, %s is no longer mounted", mnt)
	}
	if err := second.Release(); err != nil {
		t.Fatal(err)
	}
	if err := second.Release(); err != nil {
		t.Errorf("second release: %v", err)
	}
	if mountsAt(t, mnt) != 0 {
		t.Errorf("released by every keeper here, %s is still mounted", mnt)
	}
	// The other namespace still has it: the device stays until it goes.
	if devs, _ := loop.DevicesOf(image); len(devs) != 1 {
		t.Errorf("kept image bound to %v while another namespace has it mounted", devs)
	}
	other.stop(t)
	assertKeptReleased(t, dir)

	third := keepPoolsAs(t, pools, choice)
	if third.Roots["zone-a"] != mnt {
		t.Errorf("root %s", third.Roots["zone-a"])
	}
	st2, err := os.Stat(image)
	if err != nil {
		t.Fatal(err)
	}
	if st2.Sys().(*syscall.Stat_t).Ino != ino {
		t.Error("the kept image was made again")
	}
	for name, want := range map[string]string{"marker": "kept", "from-other": "other"} {
		if b, err := os.ReadFile(filepath.Join(mnt, name)); err != nil || string(b) != want {
			t.Errorf("%s after keeping it again: %q %v", name, b, err)
		}
	}
}

// TestKeptPoolReachedByAnotherPath: a keeper that reaches the pool
// directory by another path (a bind mount, as another pod's hostPath may
// show it) finds the loop device the first keeper bound by inode, though
// the kernel names its backing file by the first keeper's path, and mounts
// that one rather than binding a second device to the image.
func TestKeptPoolReachedByAnotherPath(t *testing.T) {
	requireRoot(t)
	root := testRoot(t)
	dir := outerDir(t, "tmpfs")
	first := keepPools(t, map[string]string{"zone-a": dir})
	real, _ := filepath.EvalSymlinks(dir)
	image := filepath.Join(real, KeptImageName)
	devs, err := loop.DevicesOfFile(image)
	if err != nil || len(devs) != 1 {
		t.Fatalf("devices of the kept image: %v %v", devs, err)
	}

	elsewhere := filepath.Join(root, "elsewhere")
	if err := os.Mkdir(elsewhere, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(real, elsewhere, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(elsewhere, 0); err != nil {
			t.Errorf("unmounting the bind mount: %v", err)
		}
	})
	if named, _ := loop.DevicesOf(filepath.Join(elsewhere, KeptImageName)); len(named) != 0 {
		t.Fatalf("the kernel names the device by the other path too (%v): this test shows nothing", named)
	}
	second, err := KeepPools(context.Background(), map[string]string{"zone-a": elsewhere}, PoolFilesystemAuto)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = second.Release() })
	if second.Roots["zone-a"] != filepath.Join(elsewhere, KeptMountDir) {
		t.Fatalf("root %s", second.Roots["zone-a"])
	}
	all, err := mtab.All()
	if err != nil {
		t.Fatal(err)
	}
	if m := mtab.TopAt(all, second.Roots["zone-a"]); m == nil || m.Source != devs[0] {
		t.Errorf("the pool by the other path is mounted from %v, want %s", m, devs[0])
	}
	if now, _ := loop.DevicesOfFile(image); len(now) != 1 {
		t.Errorf("kept image bound to %v, want only %s", now, devs[0])
	}
	if err := os.WriteFile(filepath.Join(first.Roots["zone-a"], "seen"), []byte("one"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(second.Roots["zone-a"], "seen")); err != nil || string(b) != "one" {
		t.Errorf("a file written through one path reads %q, %v through the other", b, err)
	}
	// Its own mount point: the last keeper there takes it off, though a
	// keeper of the other path still uses the filesystem.
	if err := second.Release(); err != nil {
		t.Fatal(err)
	}
	if n := mountsAt(t, second.Roots["zone-a"]); n != 0 {
		t.Errorf("%d mounts left at %s after its only keeper let go", n, second.Roots["zone-a"])
	}
	if n := mountsAt(t, first.Roots["zone-a"]); n != 1 {
		t.Errorf("%d mounts at %s, which its keeper still uses", n, first.Roots["zone-a"])
	}
}

// otherKeeper is a process in a mount namespace of its own that keeps a
// pool until its stdin closes.
type otherKeeper struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	device string
	out    *bytes.Buffer
}

// otherKeeperEnv holds the pool directory for the keeper, and
// otherKeeperEnv+"_AS" the --block-pool-filesystem value it keeps it with.
const otherKeeperEnv = "MODEGUARD_TEST_KEEP_POOL"

// startOtherNamespaceKeeper runs this test binary's
// TestOtherNamespaceKeeper in a new mount namespace whose copy of the
// kept mount is taken off first, so it has to mount the filesystem itself.
func startOtherNamespaceKeeper(t *testing.T, dir, mnt, choice string) *otherKeeper {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "--",
		"sh", "-c", `umount "$1" && exec "$2" -test.run '^TestOtherNamespaceKeeper$' -test.v`, "sh", mnt, self)
	cmd.Env = append(os.Environ(), otherKeeperEnv+"="+dir, otherKeeperEnv+"_AS="+choice)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	k := &otherKeeper{cmd: cmd, stdin: stdin, out: &bytes.Buffer{}}
	t.Cleanup(func() { k.stop(t) })
	lines := make(chan string)
	go func() {
		buf := make([]byte, 4096)
		var acc []byte
		for {
			n, err := stdout.Read(buf)
			acc = append(acc, buf[:n]...)
			for {
				i := bytes.IndexByte(acc, '\n')
				if i < 0 {
					break
				}
				line := string(acc[:i])
				acc = acc[i+1:]
				k.out.WriteString(line + "\n")
				if dev, ok := strings.CutPrefix(line, "DEVICE "); ok {
					lines <- dev
				}
			}
			if err != nil {
				close(lines)
				return
			}
		}
	}()
	select {
	case dev, ok := <-lines:
		if !ok {
			t.Fatalf("the keeper in another namespace ended without keeping the pool: %s %s", k.out, stderr.String())
		}
		k.device = dev
	case <-time.After(time.Minute):
		t.Fatalf("the keeper in another namespace did not report in a minute: %s", stderr.String())
	}
	return k
}

func (k *otherKeeper) stop(t *testing.T) {
	if k.cmd.ProcessState != nil {
		return
	}
	k.stdin.Close()
	if err := k.cmd.Wait(); err != nil {
		t.Errorf("the keeper in another namespace: %v: %s", err, k.out)
	}
}

// TestOtherNamespaceKeeper is the process startOtherNamespaceKeeper runs;
// on its own it does nothing.
func TestOtherNamespaceKeeper(t *testing.T) {
	dir := os.Getenv(otherKeeperEnv)
	if dir == "" {
		t.Skip("run by TestKeptPoolIsSharedAndReleased")
	}
	k, err := KeepPools(context.Background(), map[string]string{"zone-a": dir}, os.Getenv(otherKeeperEnv+"_AS"))
	if err != nil {
		t.Fatal(err)
	}
	root := k.Roots["zone-a"]
	all, err := mtab.All()
	if err != nil {
		t.Fatal(err)
	}
	m := mtab.TopAt(all, root)
	if m == nil {
		t.Fatalf("%s is not mounted", root)
	}
	if err := os.WriteFile(filepath.Join(root, "from-other"), []byte("other"), 0o600); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("DEVICE %s\n", m.Source)
	_, _ = io.Copy(io.Discard, os.Stdin)
	// Its namespace ends with it: the mount goes whether or not this
	// release unmounts it.
	if err := k.Release(); err != nil {
		t.Fatal(err)
	}
}

// TestPoolsThatStayDirect: a directory whose filesystem has reflinks, one
// holding the volumes of a pool made on it before, one too small for xfs,
// and every directory under --block-pool-filesystem=direct are their own
// pool roots; on ext4 the old pool still refuses to copy a volume in use,
// saying how to get a kept pool. A directory that holds a kept image is
// never used directly.
func TestPoolsThatStayDirect(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	root := testRoot(t)

	reflink := filepath.Join(testenv.ReflinkXFS(t, xfsMinSize), "pool")
	small := filepath.Join(testenv.Tmpfs(t, "64m"), "pool")
	for _, d := range []string{reflink, small} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	old := outerDir(t, "ext4")
	// The old pool: made before, with a volume in it.
	f := openFixture(t, root, map[string]string{"zone-a": old})
	spec := mountSpec(t, "zone-a", "old", fsExt4, 64*mib)
	f.create(t, spec)

	k := keepPools(t, map[string]string{"zone-a": old, "zone-b": reflink, "zone-c": small})
	for zone, dir := range map[string]string{"zone-a": old, "zone-b": reflink, "zone-c": small} {
		real, _ := filepath.EvalSymlinks(dir)
		if k.Roots[zone] != real {
			t.Errorf("zone %s: root %s, want the directory %s itself", zone, k.Roots[zone], real)
		}
		if _, err := os.Stat(filepath.Join(real, KeptImageName)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("zone %s: a kept image was made in %s: %v", zone, real, err)
		}
	}

	// Still refused in use, now saying where a kept pool comes from.
	f = openFixture(t, root, map[string]string{"zone-a": k.Roots["zone-a"]})
	f.attach(t, spec.ID, writer("n1"))
	req := f.mountReq(spec.ID, "n1", "old", false)
	req.Mode = spec.Modes[0]
	f.stage(t, req)
	_, err := f.ctrl.CreateSnapshot(ctx, snapID(t, "zone-a", "s"), "s", spec.ID)
	wantCode(t, err, codes.FailedPrecondition)
	for _, want := range []string{"no reflink", "--block-pool-filesystem=auto"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not say %q", err, want)
		}
	}

	// direct: an empty ext4 directory too; but not one with a kept image.
	empty := outerDir(t, "ext4")
	d, err := KeepPools(ctx, map[string]string{"zone-a": empty}, PoolFilesystemDirect)
	if err != nil {
		t.Fatal(err)
	}
	if real, _ := filepath.EvalSymlinks(empty); d.Roots["zone-a"] != real {
		t.Errorf("direct: root %s", d.Roots["zone-a"])
	}
	keepPools(t, map[string]string{"zone-a": empty})
	_, err = KeepPools(ctx, map[string]string{"zone-a": empty}, PoolFilesystemDirect)
	if err == nil || !strings.Contains(err.Error(), KeptImageName) || !strings.Contains(err.Error(), "--block-pool-filesystem=auto") {
		t.Errorf("direct on a directory with a kept image: %v", err)
	}
	if _, err := KeepPools(ctx, map[string]string{"zone-a": empty}, "kept"); err == nil {
		t.Error("KeepPools accepted an unknown filesystem choice")
	} else {
		for _, want := range []string{`"kept"`, PoolFilesystemAuto, PoolFilesystemBtrfs, PoolFilesystemXFS, PoolFilesystemDirect} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("the refusal of an unknown choice %q does not say %q", err, want)
			}
		}
	}

	// btrfs: a directory on btrfs is its own root (and gets btrfs's
	// layout when its pool is opened), with no image in it.
	onBtrfs := filepath.Join(testenv.LoopFilesystem(t, 1<<30, "btrfs", "-q"), "pool")
	if err := os.Mkdir(onBtrfs, 0o700); err != nil {
		t.Fatal(err)
	}
	b := keepPoolsAs(t, map[string]string{"zone-a": onBtrfs}, PoolFilesystemBtrfs)
	if real, _ := filepath.EvalSymlinks(onBtrfs); b.Roots["zone-a"] != real {
		t.Errorf("btrfs on btrfs: root %s, want the directory %s", b.Roots["zone-a"], real)
	}
	if _, err := os.Stat(filepath.Join(onBtrfs, KeptImageName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("btrfs on btrfs: a kept image was made: %v", err)
	}
}

// TestKeptImageThatCannotBeMountedFailsClosed: a process that finds the
// kept image but cannot mount it refuses the zone, rather than serving it
// from the directory underneath where its volumes are not.
func TestKeptImageThatCannotBeMountedFailsClosed(t *testing.T) {
	requireRoot(t)
	testRoot(t)
	dir := outerDir(t, "tmpfs")
	// Not an xfs: what a damaged image looks like to mount.
	if err := os.WriteFile(filepath.Join(dir, KeptImageName), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := KeepPools(context.Background(), map[string]string{"zone-a": dir}, PoolFilesystemAuto)
	if err == nil {
		t.Fatal("KeepPools used a pool whose kept image does not mount")
	}
	for _, want := range []string{"zone-a", KeptImageName, "cannot be mounted"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	assertKeptReleased(t, dir)
}

// TestKeptPoolGivesDeletedSpaceBack: what is deleted in a kept pool goes
// back to the filesystem under its sparse image (mounted with discard), so
// deleted volumes and snapshots do not stay allocated underneath; a kept
// xfs and a kept btrfs alike.
func TestKeptPoolGivesDeletedSpaceBack(t *testing.T) {
	requireRoot(t)
	for _, choice := range []string{PoolFilesystemXFS, PoolFilesystemBtrfs} {
		t.Run(choice, func(t *testing.T) { keptPoolGivesDeletedSpaceBack(t, choice) })
	}
}

func keptPoolGivesDeletedSpaceBack(t *testing.T, choice string) {
	testRoot(t)
	dir := outerDir(t, "ext4")
	k := keepPoolsAs(t, map[string]string{"zone-a": dir}, choice)
	real, _ := filepath.EvalSymlinks(dir)
	image := filepath.Join(real, KeptImageName)
	allocated := func() int64 {
		t.Helper()
		n, err := allocatedBytes(image)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := allocated()
	data := filepath.Join(k.Roots["zone-a"], "data")
	f, err := os.Create(data)
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte{0x5a}, 1<<20)
	for range 128 {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	written := allocated()
	if written < before+100*mib {
		t.Fatalf("128 MiB written in the pool grew its image from %d to only %d bytes", before, written)
	}
	if err := os.Remove(data); err != nil {
		t.Fatal(err)
	}
	// xfs discards freed extents once their removal is in its log, btrfs
	// once the transaction that frees them is committed.
	deadline := time.Now().Add(10 * time.Second)
	for {
		root, err := os.Open(k.Roots["zone-a"])
		if err != nil {
			t.Fatal(err)
		}
		_ = unix.Syncfs(int(root.Fd()))
		root.Close()
		if now := allocated(); now < written-100*mib {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("after deleting 128 MiB the image still has %d bytes allocated (%d before writing, %d after)", now, before, written)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestSyncsSharedOnlyOnAFilesystemOfItsOwn: a pool root that is a
// filesystem of its own with a disk under it (a kept pool, an xfs mounted
// at the pool directory) has its creations' syncs shared as one syncfs; a
// directory within a larger filesystem, and a tmpfs, keep per-file syncs;
// a release lets go of the roots.
func TestSyncsSharedOnlyOnAFilesystemOfItsOwn(t *testing.T) {
	requireRoot(t)
	kept := outerDir(t, "ext4")
	ownXFS := testenv.ReflinkXFS(t, xfsMinSize)
	within := filepath.Join(testenv.ReflinkXFS(t, xfsMinSize), "pool")
	if err := os.Mkdir(within, 0o700); err != nil {
		t.Fatal(err)
	}
	tmpfs := testenv.Tmpfs(t, "64m")
	k, err := KeepPools(context.Background(), map[string]string{"zone-a": kept, "zone-b": ownXFS, "zone-c": within, "zone-d": tmpfs}, PoolFilesystemAuto)
	if err != nil {
		t.Fatal(err)
	}
	released := false
	t.Cleanup(func() {
		if !released {
			_ = k.Release()
		}
	})
	for zone, want := range map[string]bool{"zone-a": true, "zone-b": true, "zone-c": false, "zone-d": false} {
		if got := fsutil.SyncsShared(filepath.Join(k.Roots[zone], volumesDir, "x.img")); got != want {
			t.Errorf("zone %s (root %s): syncs shared %v, want %v", zone, k.Roots[zone], got, want)
		}
	}
	if err := k.Release(); err != nil {
		t.Fatal(err)
	}
	released = true
	for zone, root := range k.Roots {
		if fsutil.SyncsShared(root) {
			t.Errorf("zone %s: syncs still shared after the release", zone)
		}
	}
}

// TestKeptImageOfTheOtherFilesystemIsRefused: a pool directory whose kept
// image holds an xfs is refused at start under --block-pool-filesystem=btrfs,
// and one holding a btrfs under xfs and direct, each saying what the image
// holds and which values fit it; the image is neither formatted again nor
// left mounted, and the value that fits, and auto, still find its
// volumes' files: a pool kept before auto chose btrfs stays an xfs.
func TestKeptImageOfTheOtherFilesystemIsRefused(t *testing.T) {
	requireRoot(t)
	testRoot(t)
	ctx := context.Background()
	for _, c := range []struct {
		made  string
		asked []string
		found string
	}{
		{PoolFilesystemXFS, []string{PoolFilesystemBtrfs}, "xfs"},
		{PoolFilesystemBtrfs, []string{PoolFilesystemXFS, PoolFilesystemDirect}, "btrfs"},
	} {
		t.Run(c.made, func(t *testing.T) {
			dir := outerDir(t, "tmpfs")
			real, _ := filepath.EvalSymlinks(dir)
			image := filepath.Join(real, KeptImageName)
			k, err := KeepPools(ctx, map[string]string{"zone-a": dir}, c.made)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(k.Roots["zone-a"], "marker"), []byte("kept"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := k.Release(); err != nil {
				t.Fatal(err)
			}
			assertKeptReleased(t, dir)
			ino := inodeOf(t, image)
			for _, asked := range c.asked {
				_, err := KeepPools(ctx, map[string]string{"zone-a": dir}, asked)
				if err == nil {
					t.Fatalf("a kept %s was used with --block-pool-filesystem=%s", c.found, asked)
				}
				for _, want := range []string{"zone-a", KeptImageName, c.found, "--block-pool-filesystem=" + c.made, "--block-pool-filesystem=auto"} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("--block-pool-filesystem=%s: refusal %q does not say %q", asked, err, want)
					}
				}
				assertKeptReleased(t, dir)
			}
			for _, choice := range []string{c.made, PoolFilesystemAuto} {
				again, err := KeepPools(ctx, map[string]string{"zone-a": dir}, choice)
				if err != nil {
					t.Fatalf("--block-pool-filesystem=%s on a kept %s: %v", choice, c.found, err)
				}
				if inodeOf(t, image) != ino {
					t.Errorf("--block-pool-filesystem=%s: the kept image was made again", choice)
				}
				if fsType := mountedFsType(t, again.Roots["zone-a"]); fsType != c.found {
					t.Errorf("--block-pool-filesystem=%s: the kept %s is mounted as %s", choice, c.found, fsType)
				}
				if b, err := os.ReadFile(filepath.Join(again.Roots["zone-a"], "marker")); err != nil || string(b) != "kept" {
					t.Errorf("--block-pool-filesystem=%s: marker after the refusals: %q %v", choice, b, err)
				}
				if err := again.Release(); err != nil {
					t.Fatal(err)
				}
				assertKeptReleased(t, dir)
			}
		})
	}
}

func inodeOf(t *testing.T, path string) uint64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Ino
}

// TestKeptBtrfsWithoutMkfsFailsClosed: with --block-pool-filesystem=btrfs
// and no mkfs.btrfs, the start fails naming what is missing and the
// values that do without it, and neither makes an image nor serves the
// zone from the directory as it is.
func TestKeptBtrfsWithoutMkfsFailsClosed(t *testing.T) {
	requireRoot(t)
	testRoot(t)
	dir := outerDir(t, "tmpfs")
	t.Setenv("PATH", t.TempDir())
	k, err := KeepPools(context.Background(), map[string]string{"zone-a": dir}, PoolFilesystemBtrfs)
	if err == nil {
		_ = k.Release()
		t.Fatalf("a btrfs pool started without mkfs.btrfs, root %s", k.Roots["zone-a"])
	}
	for _, want := range []string{"zone-a", "mkfs.btrfs", "btrfs-progs", "--block-pool-filesystem=xfs", "--block-pool-filesystem=direct"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, KeptImageName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("kept image: %v", err)
	}
	assertKeptReleased(t, dir)
}

// TestAutoKeepsABtrfsWhereItCan: auto makes a new kept image a btrfs,
// which takes group snapshots of volumes being written at one instant,
// where this machine has mkfs.btrfs and btrfs in its kernel; without
// mkfs.btrfs it keeps an xfs with reflinks, and starts.
func TestAutoKeepsABtrfsWhereItCan(t *testing.T) {
	requireRoot(t)
	testRoot(t)
	withBtrfs := outerDir(t, "tmpfs")
	k := keepPools(t, map[string]string{"zone-a": withBtrfs})
	if fsType := mountedFsType(t, k.Roots["zone-a"]); fsType != "btrfs" {
		t.Errorf("auto with btrfs at hand kept a %s, want a btrfs", fsType)
	}

	withoutBtrfs := outerDir(t, "tmpfs")
	mkfsXFS, err := exec.LookPath("mkfs.xfs")
	if err != nil {
		t.Fatal(err)
	}
	onlyXFS := t.TempDir()
	if err := os.Symlink(mkfsXFS, filepath.Join(onlyXFS, "mkfs.xfs")); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", onlyXFS)
	k = keepPools(t, map[string]string{"zone-a": withoutBtrfs})
	if fsType := mountedFsType(t, k.Roots["zone-a"]); fsType != "xfs" {
		t.Errorf("auto without mkfs.btrfs kept a %s, want an xfs", fsType)
	}
}

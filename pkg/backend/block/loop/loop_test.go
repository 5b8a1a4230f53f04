package loop

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

const mib = int64(1) << 20

// scratch is a directory whose loop devices and mounts are released when
// the test ends, whatever happened.
func scratch(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: attaches loop devices")
	}
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		all, _ := List()
		for _, a := range all {
			if strings.HasPrefix(a.BackingFile, dir+"/") {
				if out, err := exec.Command("losetup", "--detach", a.Device).CombinedOutput(); err != nil {
					t.Errorf("cleanup: losetup -d %s: %v: %s", a.Device, err, out)
				}
			}
		}
	})
	return dir
}

func sparseFile(t *testing.T, path string, size int64) {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
}

func attached(t *testing.T, dir string) []Attached {
	t.Helper()
	all, err := List()
	if err != nil {
		t.Fatal(err)
	}
	var out []Attached
	for _, a := range all {
		if strings.HasPrefix(a.BackingFile, dir+"/") {
			out = append(out, a)
		}
	}
	return out
}

func TestValidDevice(t *testing.T) {
	for dev, want := range map[string]bool{
		"/dev/loop0":     true,
		"/dev/loop127":   true,
		"/dev/loop":      false,
		"/dev/sda":       false,
		"/dev/loop0p1":   false,
		"/dev/../loop0":  false,
		"loop0":          false,
		"/dev/loop1\n":   false,
		"/dev/loop-ctrl": false,
	} {
		if got := ValidDevice(dev); got != want {
			t.Errorf("ValidDevice(%q) = %v, want %v", dev, got, want)
		}
	}
}

func TestAttachSizeRefreshAndDetach(t *testing.T) {
	dir := scratch(t)
	ctx := context.Background()
	image := filepath.Join(dir, "a.img")
	sparseFile(t, image, 16*mib)

	dev, err := Attach(ctx, image, false)
	if err != nil {
		t.Fatal(err)
	}
	if !dev.DirectIO {
		t.Errorf("%s on %s uses buffered I/O; this filesystem supports O_DIRECT", dev.Path, dir)
	}
	if ours, err := NamedBy(dev.Path, image); err != nil || !ours {
		t.Fatalf("NamedBy = %v, %v", ours, err)
	}
	if size, err := Size(dev.Path); err != nil || size != 16*mib {
		t.Fatalf("Size = %d, %v; want %d", size, err, 16*mib)
	}
	if sector, err := readSys(dev.Path, "queue/logical_block_size"); err != nil || sector != "512" {
		t.Fatalf("sector size %q, %v; every device is attached with 512-byte sectors", sector, err)
	}
	if err := os.Truncate(image, 32*mib); err != nil {
		t.Fatal(err)
	}
	if err := Refresh(ctx, dev.Path); err != nil {
		t.Fatal(err)
	}
	if size, _ := Size(dev.Path); size != 32*mib {
		t.Fatalf("size after Refresh = %d, want %d", size, 32*mib)
	}
	if ro, _ := readSys(dev.Path, "ro"); ro != "0" {
		t.Fatalf("read/write attach is read-only (%q)", ro)
	}

	other := filepath.Join(dir, "b.img")
	sparseFile(t, other, 16*mib)
	if done, err := DetachIfBackedBy(ctx, dev.Path, other); err != nil || done {
		t.Fatalf("detached a device bound to another image: %v, %v", done, err)
	}
	if done, err := DetachIfBackedBy(ctx, dev.Path, image); err != nil || !done {
		t.Fatalf("DetachIfBackedBy = %v, %v", done, err)
	}
	if named, err := NamedBy(dev.Path, image); err != nil || named {
		t.Fatalf("after detach, %s is still %s's: %v, %v", dev.Path, image, named, err)
	}
	if done, err := DetachIfBackedBy(ctx, dev.Path, image); err != nil || done {
		t.Fatalf("second detach: %v, %v", done, err)
	}
	if left := attached(t, dir); len(left) != 0 {
		t.Fatalf("left attached: %v", left)
	}
}

func TestAttachReadOnly(t *testing.T) {
	dir := scratch(t)
	image := filepath.Join(dir, "ro.img")
	sparseFile(t, image, 8*mib)
	dev, err := Attach(context.Background(), image, true)
	if err != nil {
		t.Fatal(err)
	}
	if ro, _ := readSys(dev.Path, "ro"); ro != "1" || !dev.ReadOnly {
		t.Fatalf("read-only attach: sysfs ro=%q, Device.ReadOnly=%v", ro, dev.ReadOnly)
	}
	if _, err := DetachIfBackedBy(context.Background(), dev.Path, image); err != nil {
		t.Fatal(err)
	}
}

func TestNamedByRecognisesAnUnlinkedImage(t *testing.T) {
	dir := scratch(t)
	image := filepath.Join(dir, "gone.img")
	sparseFile(t, image, 8*mib)
	dev, err := Attach(context.Background(), image, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	backing, _ := BackingFile(dev.Path)
	if !strings.HasSuffix(backing, DeletedSuffix) {
		t.Fatalf("backing file %q lacks the deleted marker", backing)
	}
	if done, err := DetachIfBackedBy(context.Background(), dev.Path, image); err != nil || !done {
		t.Fatalf("DetachIfBackedBy on an unlinked image = %v, %v", done, err)
	}
}

func TestNamedByResolvesSymlinkedDirectories(t *testing.T) {
	dir := scratch(t)
	real := filepath.Join(dir, "real")
	if err := os.Mkdir(real, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	sparseFile(t, filepath.Join(real, "x.img"), 8*mib)
	dev, err := Attach(context.Background(), filepath.Join(link, "x.img"), false)
	if err != nil {
		t.Fatal(err)
	}
	if done, err := DetachIfBackedBy(context.Background(), dev.Path, filepath.Join(link, "x.img")); err != nil || !done {
		t.Fatalf("DetachIfBackedBy through a symlink = %v, %v", done, err)
	}
}

// A device bound through a mount that is gone from this process's view (a
// node plugin's container that has since restarted, with its own mount of
// the pool) is still recognised as the image's, and detached: the kernel
// then names the file relative to that mount's root.
func TestNamedByThroughAMountThatIsGone(t *testing.T) {
	dir := scratch(t)
	pool := filepath.Join(dir, "pool")
	other := filepath.Join(dir, "other-view")
	for _, d := range []string{filepath.Join(pool, "volumes"), other} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	image := filepath.Join(pool, "volumes", "x.img")
	sparseFile(t, image, 8*mib)
	if out, err := exec.Command("mount", "--bind", pool, other).CombinedOutput(); err != nil {
		t.Fatalf("mount --bind: %v: %s", err, out)
	}
	dev, err := Attach(context.Background(), filepath.Join(other, "volumes", "x.img"), false)
	if err != nil {
		exec.Command("umount", other).Run()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Only while it is still this test's: a freed device may already
		// serve a test of another package running at the same time.
		if named, _ := NamedBy(dev.Path, image); named {
			exec.Command("losetup", "--detach", dev.Path).Run()
		}
	})
	if out, err := exec.Command("umount", "--lazy", other).CombinedOutput(); err != nil {
		t.Fatalf("umount --lazy: %v: %s", err, out)
	}
	backing, _ := BackingFile(dev.Path)
	if backing != "/volumes/x.img" {
		t.Fatalf("backing file through a detached mount is %q; the test expects the kernel to name it from that mount's root", backing)
	}
	// The same tail on another filesystem is another file.
	shm, err := os.MkdirTemp("/dev/shm", "namedby-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	if err := os.MkdirAll(filepath.Join(shm, "volumes"), 0o700); err != nil {
		t.Fatal(err)
	}
	if named, err := NamedBy(dev.Path, filepath.Join(shm, "volumes", "x.img")); err != nil || named {
		t.Errorf("NamedBy(an image of that name on another filesystem) = %v, %v; want false", named, err)
	}
	if named, err := NamedBy(dev.Path, image); err != nil || !named {
		t.Fatalf("NamedBy(image) = %v, %v; want true", named, err)
	}
	if done, err := DetachIfBackedBy(context.Background(), dev.Path, image); err != nil || !done {
		t.Fatalf("DetachIfBackedBy = %v, %v; want the device detached", done, err)
	}
}

// ramfs has no O_DIRECT at all (tmpfs gained it in Linux 6.6), so it stands
// in for every filesystem that refuses direct I/O.
func TestAttachFallsBackToBufferedIOWithoutODirect(t *testing.T) {
	dir := scratch(t)
	mnt := filepath.Join(dir, "ramfs")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "ramfs", "ramfs", mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot mount ramfs: %v: %s", err, out)
	}
	image := filepath.Join(mnt, "r.img")
	// Cleanups run in reverse: this one runs before scratch's, so it
	// detaches the image itself, since ramfs cannot be unmounted under it.
	t.Cleanup(func() {
		all, _ := List()
		for _, a := range all {
			if strings.HasPrefix(a.BackingFile, mnt+"/") {
				exec.Command("losetup", "--detach", a.Device).Run()
			}
		}
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("cleanup: umount %s: %v: %s", mnt, err, out)
		}
	})
	sparseFile(t, image, 8*mib)

	dev, err := Attach(context.Background(), image, false)
	if err != nil {
		t.Fatalf("Attach on ramfs: %v", err)
	}
	if dev.DirectIO {
		t.Fatal("device claims direct I/O on ramfs")
	}
	if size, err := Size(dev.Path); err != nil || size != 8*mib {
		t.Fatalf("Size = %d, %v", size, err)
	}
	if n := len(attached(t, mnt)); n != 1 {
		t.Fatalf("%d devices bound to the image, want 1 (the failed direct-I/O attempt leaked)", n)
	}
	if _, err := DetachIfBackedBy(context.Background(), dev.Path, image); err != nil {
		t.Fatal(err)
	}
}

func TestAttachOfAMissingImageFails(t *testing.T) {
	dir := scratch(t)
	if _, err := Attach(context.Background(), filepath.Join(dir, "absent.img"), false); err == nil {
		t.Fatal("attached a file that does not exist")
	}
	if left := attached(t, dir); len(left) != 0 {
		t.Fatalf("left attached: %v", left)
	}
}

func TestRejectsDevicesThatAreNotLoopDevices(t *testing.T) {
	if _, err := BackingFile("/dev/sda"); err == nil {
		t.Error("BackingFile accepted /dev/sda")
	}
	if err := Refresh(context.Background(), "/dev/sda"); err == nil {
		t.Error("Refresh accepted /dev/sda")
	}
	if ours, err := NamedBy("/dev/sda", "/x.img"); ours || err == nil {
		t.Errorf("NamedBy(/dev/sda) = %v, %v", ours, err)
	}
}

// TestDevicesOfIsTheImageNow: the devices bound to this very image, not
// another image's, and not a deleted image of the same name.
func TestDevicesOfIsTheImageNow(t *testing.T) {
	dir := scratch(t)
	a, b := filepath.Join(dir, "a.img"), filepath.Join(dir, "b.img")
	sparseFile(t, a, 8*mib)
	sparseFile(t, b, 8*mib)
	devA, err := Attach(context.Background(), a, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = DetachIfBackedBy(context.Background(), devA.Path, a) })
	devB, err := Attach(context.Background(), b, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = DetachIfBackedBy(context.Background(), devB.Path, b) })
	if got, err := DevicesOf(a); err != nil || len(got) != 1 || got[0] != devA.Path {
		t.Fatalf("DevicesOf(a) = %v, %v; want [%s]", got, err, devA.Path)
	}
	// a deleted and made again: its old device is not the image now.
	if err := os.Remove(a); err != nil {
		t.Fatal(err)
	}
	sparseFile(t, a, 8*mib)
	if got, err := DevicesOf(a); err != nil || len(got) != 0 {
		t.Fatalf("DevicesOf(a made again) = %v, %v; want none", got, err)
	}
}

// TestConcurrentAttachesGetDevicesOfTheirOwn: attaches racing for the same
// free device each end up bound, each to a device of its own, with the
// image it asked for; none fails because another took its device first.
func TestConcurrentAttachesGetDevicesOfTheirOwn(t *testing.T) {
	dir := scratch(t)
	const n = 16
	images := make([]string, n)
	for i := range images {
		images[i] = filepath.Join(dir, fmt.Sprintf("c%d.img", i))
		sparseFile(t, images[i], 4*mib)
	}
	devs := make([]Device, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range images {
		wg.Go(func() { devs[i], errs[i] = Attach(context.Background(), images[i], i%2 == 1) })
	}
	wg.Wait()
	seen := map[string]int{}
	for i := range images {
		if errs[i] != nil {
			t.Fatalf("attach %d: %v", i, errs[i])
		}
		if j, dup := seen[devs[i].Path]; dup {
			t.Fatalf("images %d and %d were both given %s", j, i, devs[i].Path)
		}
		seen[devs[i].Path] = i
		if same, err := BoundTo(devs[i].Path, images[i]); err != nil || !same {
			t.Fatalf("%s is not bound to %s: %v, %v", devs[i].Path, images[i], same, err)
		}
		if ro, _ := ReadOnly(devs[i].Path); ro != (i%2 == 1) {
			t.Fatalf("%s read-only = %v, asked %v", devs[i].Path, ro, i%2 == 1)
		}
	}
	for i := range images {
		if done, err := DetachIfBackedBy(context.Background(), devs[i].Path, images[i]); err != nil || !done {
			t.Fatalf("detach %s: %v, %v", devs[i].Path, done, err)
		}
	}
}

// TestAttachAtATakenDeviceLeavesItAlone: a device recorded as free and
// bound by someone else since is refused, and its binding is not touched.
func TestAttachAtATakenDeviceLeavesItAlone(t *testing.T) {
	dir := scratch(t)
	theirs, ours := filepath.Join(dir, "theirs.img"), filepath.Join(dir, "ours.img")
	sparseFile(t, theirs, 4*mib)
	sparseFile(t, ours, 4*mib)
	// Someone else binds a device between our choice of it and our
	// attach. Their losetup picks the device itself: a device this test
	// found free and then bound could be taken first by another package's
	// test running at the same time.
	out, err := exec.Command("losetup", "--find", "--show", theirs).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup --find %s: %v: %s", theirs, err, out)
	}
	dev := strings.TrimSpace(string(out))
	if !ValidDevice(dev) {
		t.Fatalf("losetup --find named %q", dev)
	}
	if _, err := AttachAt(context.Background(), dev, ours, false); err == nil || !strings.Contains(err.Error(), "was taken") {
		t.Fatalf("AttachAt a device bound since = %v, want an error saying it was taken", err)
	}
	if same, err := BoundTo(dev, theirs); err != nil || !same {
		t.Fatalf("%s no longer bound to the other image: %v, %v", dev, same, err)
	}
}

// A detach returns once the kernel has let go of the image: while someone
// else holds the device open the kernel only marks it, and the detach waits
// for that opener to close it rather than report a device that is still
// bound as detached.
func TestDetachWaitsForTheLastOpener(t *testing.T) {
	dir := scratch(t)
	image := filepath.Join(dir, "held.img")
	sparseFile(t, image, 8*mib)
	ctx := context.Background()
	dev, err := Attach(ctx, image, false)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := os.Open(dev.Path)
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		close(released)
		holder.Close()
	}()
	done, err := DetachIfBackedBy(ctx, dev.Path, image)
	if err != nil || !done {
		t.Fatalf("DetachIfBackedBy = %v, %v", done, err)
	}
	select {
	case <-released:
	default:
		t.Fatal("the detach returned while another opener still held the device")
	}
	// Not "unbound": loop devices are the machine's, and a test of another
	// package may take the freed device at once.
	if named, err := NamedBy(dev.Path, image); err != nil || named {
		t.Fatalf("after the detach, %s is still %s's: %v, %v", dev.Path, image, named, err)
	}
}

// A device held open for longer than the caller can wait is not reported
// detached: the error says who holds it, and the kernel completes the
// detach at the holder's close.
func TestDetachOfAHeldDeviceFailsNamingTheHolder(t *testing.T) {
	dir := scratch(t)
	image := filepath.Join(dir, "held.img")
	sparseFile(t, image, 8*mib)
	dev, err := Attach(context.Background(), image, false)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := os.Open(dev.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { holder.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done, err := DetachIfBackedBy(ctx, dev.Path, image)
	if err == nil || done {
		t.Fatalf("DetachIfBackedBy of a held device = %v, %v; want an error", done, err)
	}
	if want := fmt.Sprintf("open in process %d", os.Getpid()); !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
	if backing, _ := BackingFile(dev.Path); backing == "" {
		t.Error("the device was detached while held")
	}
	holder.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		named, err := NamedBy(dev.Path, image)
		if err == nil && !named {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still bound to %s after its holder closed it (%v)", dev.Path, image, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestARebindIsSeenThroughLibblkidsCache: a device bound to another image
// must not keep the identity libblkid cached for the image before. The
// cache is a file of the test's, as ganesha's shared one would be, filled
// by probing the device while it held the first image; right after the
// device is bound to the second, blkid must answer the second image's
// UUID, not trust its two-second-old entry.
func TestARebindIsSeenThroughLibblkidsCache(t *testing.T) {
	dir := scratch(t)
	for _, tool := range []string{"blkid", "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s", tool)
		}
	}
	ctx := context.Background()
	cache := filepath.Join(dir, "blkid.tab")
	uuid := func(dev string) string {
		t.Helper()
		out, err := exec.Command("blkid", "-c", cache, "-o", "value", "-s", "UUID", dev).Output()
		if err != nil {
			t.Fatalf("blkid %s: %v", dev, err)
		}
		return strings.TrimSpace(string(out))
	}
	images := map[string]string{}
	for _, name := range []string{"first", "second"} {
		image := filepath.Join(dir, name+".img")
		sparseFile(t, image, 16*mib)
		if out, err := exec.Command("mkfs.ext4", "-q", image).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.ext4: %v: %s", err, out)
		}
		out, err := exec.Command("blkid", "-p", "-o", "value", "-s", "UUID", image).Output()
		if err != nil {
			t.Fatal(err)
		}
		images[name] = strings.TrimSpace(string(out))
	}
	for round := range 5 {
		first, err := Attach(ctx, filepath.Join(dir, "first.img"), false)
		if err != nil {
			t.Fatal(err)
		}
		if got := uuid(first.Path); got != images["first"] {
			t.Fatalf("round %d: %s holding the first image reads as %q, want %q", round, first.Path, got, images["first"])
		}
		if _, err := DetachIfBackedBy(ctx, first.Path, filepath.Join(dir, "first.img")); err != nil {
			t.Fatal(err)
		}
		second, err := AttachAt(ctx, first.Path, filepath.Join(dir, "second.img"), false)
		if err != nil {
			// Another test took the device in between: try again.
			t.Logf("round %d: %v", round, err)
			continue
		}
		if got := uuid(second.Path); got != images["second"] {
			t.Errorf("round %d: %s, bound to the second image a moment after the first, reads as %q through the cache, want the second image's %q",
				round, second.Path, got, images["second"])
		}
		if _, err := DetachIfBackedBy(ctx, second.Path, filepath.Join(dir, "second.img")); err != nil {
			t.Fatal(err)
		}
	}
}

// A device that changes hands between the detach's look at it and its
// detach is left to its new owner: freed (as an autoclear device is at its
// last close) and bound at once to another volume's image, it stays bound
// to that image, and the detach reports that it detached nothing.
func TestDetachLeavesADeviceThatChangedHandsAlone(t *testing.T) {
	dir := scratch(t)
	ours, theirs := filepath.Join(dir, "ours.img"), filepath.Join(dir, "theirs.img")
	sparseFile(t, ours, 4*mib)
	sparseFile(t, theirs, 4*mib)
	ctx := context.Background()
	dev, err := Attach(ctx, ours, false)
	if err != nil {
		t.Fatal(err)
	}
	rebound := false
	betweenCheckAndOpen = func(path string) {
		if out, err := exec.Command("losetup", "--detach", path).CombinedOutput(); err != nil {
			t.Errorf("losetup -d %s: %v: %s", path, err, out)
			return
		}
		// Another package's test may take the freed device first; then
		// this run cannot show the case, and says so below.
		if _, err := AttachAt(ctx, path, theirs, false); err == nil {
			rebound = true
		}
	}
	t.Cleanup(func() { betweenCheckAndOpen = nil })
	done, err := DetachIfBackedBy(ctx, dev.Path, ours)
	betweenCheckAndOpen = nil
	if err != nil || done {
		t.Fatalf("DetachIfBackedBy of a device that changed hands = %v, %v; want false, nil", done, err)
	}
	if !rebound {
		t.Skipf("%s was taken by someone else before this test could bind it", dev.Path)
	}
	if same, err := BoundTo(dev.Path, theirs); err != nil || !same {
		t.Fatalf("%s was taken from the image bound to it since: bound to it = %v, %v", dev.Path, same, err)
	}
}

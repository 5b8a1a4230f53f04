package block

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	mount "k8s.io/mount-utils"
)

const (
	mib = int64(1) << 20
	// xfsprogs refuses to make filesystems smaller than 300 MB.
	xfsMinSize = 320 * mib
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: attaches loop devices and mounts filesystems")
	}
}

// testRoot is a temporary directory whose mounts and loop devices are all
// released when the test ends, passed or failed. It is registered after
// t.TempDir, so it runs before the directory is removed.
func testRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { releaseUnder(t, root) })
	return root
}

func under(path, root string) bool {
	return path == root || strings.HasPrefix(path, root+"/")
}

func mountsUnder(t *testing.T, root string) []mount.MountPoint {
	t.Helper()
	mps, err := mount.ListProcMounts("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	var out []mount.MountPoint
	for _, mp := range mps {
		if under(mp.Path, root) {
			out = append(out, mp)
		}
	}
	// Deepest first, so nested mounts come off before their parents.
	sort.Slice(out, func(i, j int) bool { return len(out[i].Path) > len(out[j].Path) })
	return out
}

func loopsUnder(t *testing.T, root string) []loop.Attached {
	t.Helper()
	all, err := loop.List()
	if err != nil {
		t.Fatal(err)
	}
	var out []loop.Attached
	for _, a := range all {
		if under(strings.TrimSuffix(a.BackingFile, " (deleted)"), root) {
			out = append(out, a)
		}
	}
	return out
}

// releaseUnder unmounts the filesystems on loop devices, then detaches the
// loop devices, then unmounts whatever else (pool tmpfs) is under root: a
// pool cannot be unmounted while a loop device holds one of its files.
func releaseUnder(t *testing.T, root string) {
	for _, mp := range mountsUnder(t, root) {
		if loop.ValidDevice(mp.Device) {
			if out, err := exec.Command("umount", mp.Path).CombinedOutput(); err != nil {
				t.Errorf("cleanup: umount %s: %v: %s", mp.Path, err, out)
			}
		}
	}
	for _, a := range loopsUnder(t, root) {
		if out, err := exec.Command("losetup", "--detach", a.Device).CombinedOutput(); err != nil {
			t.Errorf("cleanup: losetup -d %s: %v: %s", a.Device, err, out)
		}
	}
	for _, mp := range mountsUnder(t, root) {
		if out, err := exec.Command("umount", mp.Path).CombinedOutput(); err != nil {
			t.Errorf("cleanup: umount %s: %v: %s", mp.Path, err, out)
		}
	}
}

// assertNothingStagedUnder fails if a loop device or a loop-device mount
// under root survived: the code under test must release them itself.
//
// A device someone else still has open when it is detached (a parallel test's
// blkid, a probe) is only marked autoclear: the kernel unbinds it at that
// opener's last close. Such a device was detached; it is given a few seconds
// to go. A bound device without autoclear was never detached: that fails at
// once.
func assertNothingStagedUnder(t *testing.T, root string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		releasing := 0
		var leaked []loop.Attached
		for _, a := range loopsUnder(t, root) {
			if autoclear(a.Device) && time.Now().Before(deadline) {
				releasing++
			} else {
				leaked = append(leaked, a)
			}
		}
		if releasing == 0 || len(leaked) > 0 {
			for _, a := range leaked {
				t.Errorf("loop device %s still bound to %s", a.Device, a.BackingFile)
			}
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, mp := range mountsUnder(t, root) {
		if loop.ValidDevice(mp.Device) {
			t.Errorf("%s still mounted at %s", mp.Device, mp.Path)
		}
	}
}

func mountTmpfs(t *testing.T, dir, size string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v: %s", err, out)
	}
}

type fixture struct {
	root  string
	pools map[string]string
	ctrl  *Controller
	node  *Node
}

// newFixture makes one pool per zone under a fresh test root, and a
// controller and a node on them.
func newFixture(t *testing.T, zones ...string) *fixture {
	t.Helper()
	requireRoot(t)
	root := testRoot(t)
	pools := map[string]string{}
	for _, z := range zones {
		dir := filepath.Join(root, "pool-"+z)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		pools[z] = dir
	}
	return openFixture(t, root, pools)
}

func openFixture(t *testing.T, root string, pools map[string]string) *fixture {
	t.Helper()
	ctrl, err := NewController(pools)
	if err != nil {
		t.Fatalf("NewController: %v", err)
	}
	node, err := NewNode(pools)
	if err != nil {
		t.Fatalf("NewNode: %v", err)
	}
	return &fixture{root: root, pools: pools, ctrl: ctrl, node: node}
}

func volID(t *testing.T, zone, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func snapID(t *testing.T, zone, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, name))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func mountSpec(t *testing.T, zone, name, fsType string, size int64) backend.VolumeSpec {
	return backend.VolumeSpec{
		ID:            volID(t, zone, name),
		Name:          name,
		CapacityBytes: size,
		AccessType:    accessmode.Mount,
		FsType:        fsType,
		Modes:         []accessmode.Mode{accessmode.SingleNodeWriter},
	}
}

func (f *fixture) create(t *testing.T, spec backend.VolumeSpec) *backend.Volume {
	t.Helper()
	v, err := f.ctrl.CreateVolume(context.Background(), spec)
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", spec.Name, err)
	}
	return v
}

func (f *fixture) attach(t *testing.T, id volumeid.ID, attachments ...accessmode.Attachment) {
	t.Helper()
	if _, err := f.ctrl.SetAttachments(context.Background(), id, attachments); err != nil {
		t.Fatalf("SetAttachments: %v", err)
	}
}

// testNode is the node of key name in zone-a.
func testNode(name string) nodeid.Node { return nodeid.Node{Name: name, Zone: "zone-a"} }

func writer(node string) accessmode.Attachment {
	return accessmode.Attachment{Node: testNode(node), Mode: accessmode.SingleNodeWriter}
}

func reader(node string) accessmode.Attachment {
	return accessmode.Attachment{Node: testNode(node), Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true}
}

// stage stages and makes sure the stage is undone when the test ends.
func (f *fixture) stage(t *testing.T, req backend.StageRequest) *backend.Staged {
	t.Helper()
	staged, err := f.node.Stage(context.Background(), req)
	if err != nil {
		t.Fatalf("Stage %s at %s: %v", req.VolumeID, req.StagingPath, err)
	}
	t.Cleanup(func() {
		if err := f.node.Unstage(context.Background(), staged); err != nil {
			t.Errorf("cleanup: Unstage: %v", err)
		}
	})
	return staged
}

func (f *fixture) unstage(t *testing.T, staged *backend.Staged) {
	t.Helper()
	if err := f.node.Unstage(context.Background(), staged); err != nil {
		t.Fatalf("Unstage: %v", err)
	}
}

func (f *fixture) mountReq(id volumeid.ID, node, stagingName string, readOnly bool) backend.StageRequest {
	return backend.StageRequest{
		VolumeID:    id,
		Node:        testNode(node),
		StagingPath: filepath.Join(f.root, "staging", stagingName),
		AccessType:  accessmode.Mount,
		ReadOnly:    readOnly,
	}
}

func wantCode(t *testing.T, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("got code %v (%v), want %v", got, err, want)
	}
}

func writeFileSynced(t *testing.T, path, content string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func imageOf(t *testing.T, f *fixture, id volumeid.ID) string {
	t.Helper()
	path, err := f.ctrl.pools[id.Zone].imagePath(id)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return !errors.Is(err, os.ErrNotExist)
}

func codeOf(err error) codes.Code { return status.Code(err) }

// autoclear reports whether the kernel will unbind dev at its last close.
func autoclear(dev string) bool {
	v, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "autoclear"))
	return err == nil && strings.TrimSpace(string(v)) == "1"
}

package driver_test

// An in-process driver (controller + node role) reached over a real gRPC
// unix socket, as test/sanity does, on one of two worlds: the real block
// backend on a size-capped tmpfs with the kernel's mounts (newEnv, as root),
// or the in-memory backend with an in-memory mount table (newMemoryEnv,
// without root, in milliseconds), for the tests of the driver's rules,
// idempotency, locking and errors that no kernel takes part in. Every
// volume, attachment, stage and publish a test makes through the helpers
// is undone by t.Cleanup in reverse order, and the env fails the test if a
// mount or loop device survives that.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
)

const (
	mib        = int64(1) << 20
	testZone   = "zone-a"
	testNode   = "node-1"
	volumeSize = 16 * mib
)

type env struct {
	root     string
	pool     string
	stateDir string
	maxVols  int64
	nodeName string           // the node role's --node-id (testNode unless set)
	metrics  *metrics.Metrics // nil: metrics off
	// mountTable is what the driver reads mounts from; the zero value is
	// the kernel's.
	mountTable mounts.Table
	// attachDelay, when set, makes every SetAttachments of the block
	// backend wait that long first: a wider window for races between the
	// driver's check of a node and the record of an attachment.
	attachDelay time.Duration
	// fenceFile is the controller's --fence-file ("": none).
	fenceFile string
	// otherPools are the pools of zones besides the node's (zone ->
	// directory), which the controller serves too (withPool).
	otherPools map[string]string
	// wrap, when set, is put around the block controller the driver gets.
	wrap func(backend.Controller) backend.Controller
	// mem, when set, is the in-memory world the driver runs on instead
	// of the kernel's (newMemoryEnv).
	mem *memoryWorld

	d      *driver.Driver
	srv    *grpc.Server
	conn   *grpc.ClientConn
	ctrl   csi.ControllerClient
	node   csi.NodeClient
	starts int
}

// newEnv starts a driver on a fresh tmpfs. maxVolumes is MaxVolumesPerNode;
// opts adjust the env before the driver starts.
func newEnv(t *testing.T, maxVolumes int64, opts ...func(*env)) *env {
	t.Helper()
	testenv.RequireRoot(t)
	root := testenv.Tmpfs(t, "320m")
	e := &env{
		root:     root,
		pool:     filepath.Join(root, "pool-"+testZone),
		stateDir: filepath.Join(root, "state"),
		maxVols:  maxVolumes,
		nodeName: testNode,
	}
	for _, o := range opts {
		o(e)
	}
	dirs := []string{e.pool, e.stateDir, filepath.Join(root, "staging"), filepath.Join(root, "targets")}
	if e.fenceFile != "" {
		dirs = append(dirs, filepath.Dir(e.fenceFile))
	}
	for _, dir := range e.otherPools {
		dirs = append(dirs, dir)
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	// Runs after every per-volume cleanup below (cleanups run last in,
	// first out) and before testenv's, which would clean up silently.
	t.Cleanup(func() {
		if m := localcluster.MountsUnder(root); len(m) > 0 {
			t.Errorf("mounts left behind under %s: %v", root, m)
			unmountNewestFirst(t, root)
		}
		if l := localcluster.LoopsUnder(root); len(l) > 0 {
			t.Errorf("loop devices left behind for %s: %v", root, l)
		}
	})
	e.start(t)
	t.Cleanup(e.stop)
	return e
}

// memoryWorld is the in-memory backend and mount table a driver of
// newMemoryEnv runs on; it outlives the driver's restarts, as a pool and a
// kernel outlive a plugin's.
type memoryWorld struct {
	ctrl  *memory.Controller
	node  *memory.Node
	table *mounts.Memory
}

// newMemoryEnv starts a driver on the in-memory backend (one pool of
// 1 GiB in testZone) and mount table. maxVolumes is MaxVolumesPerNode;
// opts adjust the env before the driver starts.
func newMemoryEnv(t *testing.T, maxVolumes int64, opts ...func(*env)) *env {
	t.Helper()
	// The socket's path must stay within the 108 bytes of a unix address,
	// which a test's own TempDir, named after the test, may not.
	root, err := os.MkdirTemp("", "mg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	ctrl, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: testZone, SizeBytes: 1 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	table := mounts.NewMemory()
	devices := filepath.Join(root, "dev")
	e := &env{
		root:       root,
		stateDir:   filepath.Join(root, "state"),
		maxVols:    maxVolumes,
		nodeName:   testNode,
		mountTable: table.Table(),
		mem:        &memoryWorld{ctrl: ctrl, node: memory.NewNode(ctrl, memory.WithMounts(table, devices)), table: table},
	}
	for _, o := range opts {
		o(e)
	}
	dirs := []string{e.stateDir, devices, filepath.Join(root, "staging"), filepath.Join(root, "targets")}
	if e.fenceFile != "" {
		dirs = append(dirs, filepath.Dir(e.fenceFile))
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if m := table.MountPoints(); len(m) > 0 {
			t.Errorf("mounts left behind: %v", m)
		}
	})
	e.start(t)
	t.Cleanup(e.stop)
	return e
}

// onReflinkPool puts the env's pool on an xfs with reflinks, where volumes
// in use can be snapshotted and cloned (block.copyVolumeAtOnePoint).
func onReflinkPool(t *testing.T) func(*env) {
	return func(e *env) {
		e.pool = filepath.Join(testenv.ReflinkXFS(t, 2<<30), "pool-"+testZone)
	}
}

// withPool gives the controller a pool of another zone at dir.
func withPool(zone, dir string) func(*env) {
	return func(e *env) {
		if e.otherPools == nil {
			e.otherPools = map[string]string{}
		}
		e.otherPools[zone] = dir
	}
}

// start builds a driver process the way cmd/modeguard does (fresh backends
// reading the pools, a driver on the same state dir, Reconcile) and serves it.
func (e *env) start(t *testing.T) {
	t.Helper()
	ctrl, node, mounter := e.backends(t)
	d, err := driver.New(driver.Config{
		Version:           "test",
		Roles:             []driver.Role{driver.RoleController, driver.RoleNode},
		NodeName:          e.nodeName,
		Zone:              testZone,
		StateDir:          e.stateDir,
		MaxVolumesPerNode: e.maxVols,
		Controllers:       map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: e.controller(ctrl)},
		Nodes:             map[accessmode.Backend]backend.Node{accessmode.BackendBlock: node},
		Metrics:           e.metrics,
		MountTable:        e.mountTable,
		Mounter:           mounter,
		FenceFile:         e.fenceFile,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatalf("Reconcile at start: %v", err)
	}
	e.starts++
	sock := filepath.Join(e.root, fmt.Sprintf("csi-%d.sock", e.starts))
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := d.NewGRPCServer()
	go srv.Serve(lis)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		srv.Stop()
		t.Fatal(err)
	}
	e.d, e.srv, e.conn = d, srv, conn
	e.ctrl, e.node = csi.NewControllerClient(conn), csi.NewNodeClient(conn)
}

// backends are what a start of the driver gets: the in-memory world's, or
// the block backend reading the pools afresh (and the kernel's mounter).
func (e *env) backends(t *testing.T) (backend.Controller, backend.Node, mounts.Mounter) {
	if e.mem != nil {
		return e.mem.ctrl, e.mem.node, e.mem.table
	}
	pools := map[string]string{testZone: e.pool}
	maps.Copy(pools, e.otherPools)
	ctrl, err := block.NewController(pools)
	if err != nil {
		t.Fatal(err)
	}
	node, err := block.NewNode(pools)
	if err != nil {
		t.Fatal(err)
	}
	return ctrl, node, nil
}

func (e *env) stop() {
	if e.srv == nil {
		return
	}
	e.conn.Close()
	e.srv.Stop()
	e.srv, e.conn = nil, nil
}

// restart replaces the driver by a new instance on the same pool and state
// dir, as a restarted plugin process would be.
func (e *env) restart(t *testing.T) {
	t.Helper()
	e.stop()
	e.start(t)
}

// unmountNewestFirst removes every mount below root in the reverse order of
// their creation, so that a mount stacked on an ancestor of another (which
// hides it from a deepest-path-first cleanup) goes first.
func unmountNewestFirst(t *testing.T, root string) {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(root))
	if err != nil {
		t.Errorf("listing mounts: %v", err)
		return
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].ID > infos[j].ID })
	for _, m := range infos {
		if m.Mountpoint == root {
			continue
		}
		if err := unix.Unmount(m.Mountpoint, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting leftover %s (mount %d): %v", m.Mountpoint, m.ID, err)
		}
	}
}

func (e *env) nodeID() string { return e.d.NodeID() }

// controller is the block backend as the driver gets it (see attachDelay
// and wrap).
func (e *env) controller(c backend.Controller) backend.Controller {
	if e.attachDelay != 0 {
		c = slowAttach{Controller: c, delay: e.attachDelay}
	}
	if e.wrap != nil {
		c = e.wrap(c)
	}
	return c
}

// slowAttach is the real block controller with a pause before each
// SetAttachments.
type slowAttach struct {
	backend.Controller
	delay time.Duration
}

func (s slowAttach) SetAttachments(ctx context.Context, id volumeid.ID, a []accessmode.Attachment) (*backend.Volume, error) {
	time.Sleep(s.delay)
	return s.Controller.SetAttachments(ctx, id, a)
}

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

func mountCap(mode accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// createVolume makes a volume and deletes it at cleanup.
func (e *env) createVolume(t *testing.T, name string, c *csi.VolumeCapability) string {
	t.Helper()
	resp, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: volumeSize},
		VolumeCapabilities: []*csi.VolumeCapability{c},
	})
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	id := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() {
		if _, err := e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("cleanup: DeleteVolume %s: %v", id, err)
		}
	})
	return id
}

// controllerPublish attaches the volume to this node (unpublished at cleanup).
func (e *env) controllerPublish(t *testing.T, volID string, c *csi.VolumeCapability) map[string]string {
	t.Helper()
	resp, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: e.nodeID(), VolumeCapability: c,
	})
	if err != nil {
		t.Fatalf("ControllerPublishVolume %s: %v", volID, err)
	}
	e.cleanupControllerUnpublish(t, volID, e.nodeID())
	return resp.GetPublishContext()
}

func (e *env) cleanupControllerUnpublish(t *testing.T, volID, nodeID string) {
	t.Cleanup(func() {
		if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: nodeID}); err != nil {
			t.Errorf("cleanup: ControllerUnpublishVolume %s from %s: %v", volID, nodeID, err)
		}
	})
}

func (e *env) stagingPath(name string) string { return filepath.Join(e.root, "staging", name) }
func (e *env) targetPath(name string) string  { return filepath.Join(e.root, "targets", name) }

// stage stages the volume (unstaged at cleanup) and returns its staging path.
func (e *env) stage(t *testing.T, volID, name string, c *csi.VolumeCapability, pc map[string]string) string {
	t.Helper()
	staging := e.stagingPath(name)
	if _, err := e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc,
	}); err != nil {
		t.Fatalf("NodeStageVolume %s: %v", volID, err)
	}
	t.Cleanup(func() {
		if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
			t.Errorf("cleanup: NodeUnstageVolume %s: %v", volID, err)
		}
	})
	return staging
}

// setup creates, attaches and stages a volume.
func (e *env) setup(t *testing.T, name string, c *csi.VolumeCapability) (volID, staging string, pc map[string]string) {
	t.Helper()
	volID = e.createVolume(t, name, c)
	pc = e.controllerPublish(t, volID, c)
	staging = e.stage(t, volID, name, c, pc)
	return volID, staging, pc
}

// publish calls NodePublishVolume; a success is unpublished at cleanup.
func (e *env) publish(t *testing.T, volID, staging, target string, c *csi.VolumeCapability, pc map[string]string, readOnly bool) error {
	t.Helper()
	_, err := e.node.NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: c, PublishContext: pc, Readonly: readOnly,
	})
	if err == nil {
		t.Cleanup(func() {
			if _, err := e.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
				t.Errorf("cleanup: NodeUnpublishVolume %s at %s: %v", volID, target, err)
			}
		})
	}
	return err
}

// mountsAt counts the mounts stacked at exactly p.
// mountsAt counts the mounts stacked at p in the env's mount table.
func (e *env) mountsAt(t *testing.T, p string) int {
	t.Helper()
	if e.mountTable.Read == nil {
		return kernelMountsAt(t, p)
	}
	return countMounts(t, e.mountTable.Read, p)
}

// kernelMountsAt counts the mounts stacked at p in the kernel's table.
func kernelMountsAt(t *testing.T, p string) int {
	t.Helper()
	return countMounts(t, mountinfo.GetMounts, p)
}

func countMounts(t *testing.T, read func(mountinfo.FilterFunc) ([]*mounts.Mount, error), p string) int {
	t.Helper()
	infos, err := read(func(m *mountinfo.Info) (skip, stop bool) {
		return m.Mountpoint != p, false // every mount stacked there, not just the first
	})
	if err != nil {
		t.Fatal(err)
	}
	return len(infos)
}

// serveDriver serves d on a socket of its own until the test ends, and
// answers a connection to it.
func serveDriver(t *testing.T, d *driver.Driver) *grpc.ClientConn {
	t.Helper()
	dir, err := os.MkdirTemp("", "mg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	lis, err := net.Listen("unix", filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	srv := d.NewGRPCServer()
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func wantCode(t *testing.T, what string, err error, want ...codes.Code) {
	t.Helper()
	got := status.Code(err)
	for _, w := range want {
		if got == w {
			return
		}
	}
	t.Errorf("%s: code %v (%v), want one of %v", what, got, err, want)
}

// fileState is what treeState records of one file: enough to notice a
// file being created, removed, replaced or written.
type fileState struct {
	mode  os.FileMode
	size  int64
	mtime time.Time
}

// treeState lists every path below root (sockets excepted: the test's own).
func treeState(t *testing.T, root string) map[string]fileState {
	t.Helper()
	out := map[string]fileState{}
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if fi.Mode()&os.ModeSocket != 0 {
			return nil
		}
		st := fileState{fi.Mode(), fi.Size(), fi.ModTime()}
		if strings.HasSuffix(p, ".img") {
			// A staged volume's filesystem writes to its image through the
			// loop device on its own (journal commits, lazy init).
			st.mtime = time.Time{}
		}
		out[p] = st
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffTrees(before, after map[string]fileState) []string {
	var d []string
	for p, b := range before {
		a, ok := after[p]
		switch {
		case !ok:
			d = append(d, "removed "+p)
		case a != b:
			d = append(d, fmt.Sprintf("changed %s: %+v -> %+v", p, b, a))
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok {
			d = append(d, "created "+p)
		}
	}
	return d
}

// writeProbe writes a file at dir and returns the error.
func writeProbe(dir, name, content string) error {
	return os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644)
}

func isEROFS(err error) bool { return errors.Is(err, syscall.EROFS) }

// otherNode is a second node plugin on the env's pool: another node of the
// same zone (and kernel), with its own state directory and socket, as a
// node-only process of a cluster would be. The env's controller attaches
// volumes to it by its id.
type otherNode struct {
	e    *env
	name string
	id   string
	node csi.NodeClient
}

// addNode starts a node-only driver named name; it stops at cleanup, after
// the stages and publishes made on it are undone.
func (e *env) addNode(t *testing.T, name string) *otherNode {
	t.Helper()
	nb, mounter := e.otherNodeBackend(t, name)
	stateDir := filepath.Join(e.root, "state-"+name)
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	d, err := driver.New(driver.Config{
		Version:    "test",
		Roles:      []driver.Role{driver.RoleNode},
		NodeName:   name,
		Zone:       testZone,
		StateDir:   stateDir,
		Nodes:      map[accessmode.Backend]backend.Node{accessmode.BackendBlock: nb},
		Metrics:    e.metrics,
		MountTable: e.mountTable,
		Mounter:    mounter,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatalf("Reconcile at start of %s: %v", name, err)
	}
	lis, err := net.Listen("unix", filepath.Join(e.root, "csi-"+name+".sock"))
	if err != nil {
		t.Fatal(err)
	}
	srv := d.NewGRPCServer()
	go srv.Serve(lis)
	conn, err := grpc.NewClient("unix://"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		srv.Stop()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
	})
	return &otherNode{e: e, name: name, id: d.NodeID(), node: csi.NewNodeClient(conn)}
}

// otherNodeBackend is the backend of another node: on the env's pool, or
// on its in-memory backend with a device directory of its own.
func (e *env) otherNodeBackend(t *testing.T, name string) (backend.Node, mounts.Mounter) {
	if e.mem != nil {
		devices := filepath.Join(e.root, "dev-"+name)
		if err := os.MkdirAll(devices, 0o700); err != nil {
			t.Fatal(err)
		}
		return memory.NewNode(e.mem.ctrl, memory.WithMounts(e.mem.table, devices)), e.mem.table
	}
	nb, err := block.NewNode(map[string]string{testZone: e.pool})
	if err != nil {
		t.Fatal(err)
	}
	return nb, nil
}

// controllerPublishTo attaches the volume to nodeID (unpublished at cleanup).
func (e *env) controllerPublishTo(t *testing.T, volID, nodeID string, c *csi.VolumeCapability, readOnly bool) map[string]string {
	t.Helper()
	resp, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: nodeID, VolumeCapability: c, Readonly: readOnly,
	})
	if err != nil {
		t.Fatalf("ControllerPublishVolume %s to %s: %v", volID, nodeID, err)
	}
	e.cleanupControllerUnpublish(t, volID, nodeID)
	return resp.GetPublishContext()
}

func (n *otherNode) stagingPath(name string) string {
	return filepath.Join(n.e.root, "staging", n.name+"-"+name)
}

func (n *otherNode) targetPath(name string) string {
	return filepath.Join(n.e.root, "targets", n.name+"-"+name)
}

// stage stages the volume on this node (unstaged at cleanup) and returns
// its staging path.
func (n *otherNode) stage(t *testing.T, volID, name string, c *csi.VolumeCapability, pc map[string]string) string {
	t.Helper()
	staging := n.stagingPath(name)
	if _, err := n.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc,
	}); err != nil {
		t.Fatalf("NodeStageVolume %s on %s: %v", volID, n.name, err)
	}
	t.Cleanup(func() {
		if _, err := n.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
			t.Errorf("cleanup: NodeUnstageVolume %s on %s: %v", volID, n.name, err)
		}
	})
	return staging
}

// publish calls NodePublishVolume on this node; a success is unpublished
// at cleanup.
func (n *otherNode) publish(t *testing.T, volID, staging, target string, c *csi.VolumeCapability, pc map[string]string, readOnly bool) error {
	t.Helper()
	_, err := n.node.NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: c, PublishContext: pc, Readonly: readOnly,
	})
	if err == nil {
		t.Cleanup(func() {
			if _, err := n.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
				t.Errorf("cleanup: NodeUnpublishVolume %s at %s on %s: %v", volID, target, n.name, err)
			}
		})
	}
	return err
}

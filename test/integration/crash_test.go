package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	_ "github.com/modeguard/modeguard/pkg/backend/block" // declares its fault points
	_ "github.com/modeguard/modeguard/pkg/backend/nfs"   // declares its fault points
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	_ "github.com/modeguard/modeguard/pkg/driver" // declares its fault points
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/nodestate"
	"github.com/modeguard/modeguard/test/testenv"
)

// crashPoints are the steps that change state in a block volume's life, and
// the process each one is in. TestCrashAtEveryStepConverges kills that
// process there with SIGKILL, restarts it and retries the call, as a CO does.
var crashPoints = map[string]string{
	"block.create.image-written":    "controller",
	"block.create.image-published":  "controller",
	"block.create.recorded":         "controller",
	"block.volume.updated":          "controller", // attachments recorded (publish)
	"block.expand.image-grown":      "controller",
	"block.snapshot.copied":         "controller",
	"block.delete.meta-removed":     "controller",
	"block.stage.attached":          "node",
	"node.stage.backend-staged":     "node",
	"node.stage.recorded":           "node",
	"node.publish.holder-recorded":  "node",
	"node.publish.mounted":          "node",
	"node.unpublish.unmounted":      "node",
	"block.unstage.unmounted":       "node",
	"block.expand.device-refreshed": "node",
	"node.unstage.backend-unstaged": "node",
}

// Every fault point the driver and its backends declare is exercised by a
// crash scenario, and every scenario names a declared point.
func TestCrashPointsCoverEveryDeclaredPoint(t *testing.T) {
	var missing []string
	for _, n := range faultpoint.Names() {
		if crashPoints[n] == "" && !slices.Contains(nfsCrashPoints, n) && !slices.Contains(vmCrashPoints, n) && !slices.Contains(fenceCrashPoints, n) {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("fault points without a crash scenario: %v", missing)
	}
	for _, n := range slices.Concat(slices.Collect(maps.Keys(crashPoints)), nfsCrashPoints, vmCrashPoints, fenceCrashPoints) {
		if !slices.Contains(faultpoint.Names(), n) {
			t.Errorf("crash scenario for %s, which no code declares", n)
		}
	}
}

// TestCrashAtEveryStepConverges kills the controller or the node plugin with
// SIGKILL at each step that changes state, restarts it and retries the same
// call until it succeeds, then finishes the volume's life. Afterwards data
// written and fsync'd before the crash reads back, and nothing is left: no
// image, metadata, loop device, mount or lock record.
func TestCrashAtEveryStepConverges(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	names := make([]string, 0, len(crashPoints))
	for n := range crashPoints {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) { crashScenario(t, bin, name, crashPoints[name]) })
	}
}

// crashProc is one driver process of the scenario.
type crashProc struct {
	t    *testing.T
	name string
	bin  string
	args []string
	env  []string // only for the first start: the fault point
	// baseEnv is set at every start (e.g. the boot id file of a reboot test).
	baseEnv []string
	socket  string
	log     string
	// netns, when set, is the network namespace (/run/netns/NAME) it runs
	// in, entered with nsenter --net, which runs the driver in place: the
	// PID signalled is the driver's own.
	netns  string
	cmd    *exec.Cmd
	done   chan struct{}
	conn   *grpc.ClientConn
	killed int // how many times it died of SIGKILL
}

func (p *crashProc) start() {
	p.t.Helper()
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		p.t.Fatal(err)
	}
	argv := append([]string{p.bin, "--endpoint", "unix://" + p.socket}, p.args...)
	if p.netns != "" {
		argv = append([]string{"nsenter", "--net=" + p.netns, "--"}, argv...)
	}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	p.cmd.Env = append(append(os.Environ(), p.baseEnv...), p.env...)
	p.env = nil // a restart runs without the fault
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	done := make(chan struct{})
	p.done = done
	go func(cmd *exec.Cmd) { _ = cmd.Wait(); logf.Close(); close(done) }(p.cmd)
	if p.conn == nil {
		conn, err := grpc.NewClient("unix://"+p.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			p.t.Fatal(err)
		}
		p.conn = conn
	}
	id := csi.NewIdentityClient(p.conn)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := id.Probe(ctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && resp.GetReady().GetValue() {
			return
		}
		select {
		case <-p.done:
			p.t.Fatalf("%s exited during start-up:\n%s", p.name, testenv.ReadFile(p.log))
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s not ready:\n%s", p.name, testenv.ReadFile(p.log))
		}
	}
}

// diedOfSIGKILL reports (and records) whether the process has exited
// because of SIGKILL; any other exit fails the test.
func (p *crashProc) diedOfSIGKILL() bool {
	select {
	case <-p.done:
	case <-time.After(200 * time.Millisecond):
		return false
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		p.t.Fatalf("%s exited, not by SIGKILL (%v):\n%s", p.name, p.cmd.ProcessState, testenv.ReadFile(p.log))
	}
	p.killed++
	return true
}

// call runs one CSI call to p; when p died of SIGKILL meanwhile, it
// restarts p and retries the call, as a CO would.
func (p *crashProc) call(what string, f func(ctx context.Context) error) {
	p.t.Helper()
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err := f(ctx)
		cancel()
		if err == nil {
			return
		}
		if p.diedOfSIGKILL() {
			p.t.Logf("%s: %s killed; restarting it and retrying", what, p.name)
			p.start()
			continue
		}
		if status.Code(err) == codes.Unavailable && attempt < 20 {
			time.Sleep(100 * time.Millisecond) // reconnecting to the restarted process
			continue
		}
		p.t.Fatalf("%s: %v", what, err)
	}
}

func (p *crashProc) stop() {
	if p.cmd != nil {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-p.done:
			case <-time.After(20 * time.Second):
				_ = p.cmd.Process.Kill()
				<-p.done
			}
		}
	}
	if p.conn != nil {
		p.conn.Close()
	}
}

func crashScenario(t *testing.T, bin, point, where string) {
	work := t.TempDir()
	// The scenario snapshots its volume while it is published: a pool with
	// reflinks copies a volume in use (one without refuses).
	pool := filepath.Join(testenv.ReflinkXFS(t, 2<<30), "pool")
	state := filepath.Join(work, "node-state")
	kubelet := filepath.Join(work, "kubelet")
	for _, d := range []string{pool, state, kubelet} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	poolArg := "--block-pool=zone-a=" + pool
	ctrl := &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", poolArg, "--block-pool-filesystem=direct", "-v", "2"}}
	node := &crashProc{t: t, name: "node", bin: bin, socket: filepath.Join(work, "n.sock"), log: filepath.Join(work, "node.log"),
		args: []string{"--roles", "node", "--node-id", "crash-node", "--zone", "zone-a", poolArg, "--block-pool-filesystem=direct", "--state-dir", state, "-v", "2"}}
	target := map[string]*crashProc{"controller": ctrl, "node": node}[where]
	target.env = []string{faultpoint.EnvVar + "=" + point}
	ctrl.start()
	node.start()
	t.Cleanup(func() {
		ctrl.stop()
		node.stop()
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log:\n%s\nnode log:\n%s", testenv.ReadFile(ctrl.log), testenv.ReadFile(node.log))
		}
	})
	cc := func() csi.ControllerClient { return csi.NewControllerClient(ctrl.conn) }
	nc := func() csi.NodeClient { return csi.NewNodeClient(node.conn) }

	call := func(what string, p *crashProc, f func(ctx context.Context) error) {
		t.Helper()
		p.call(what, f)
	}

	// xfs: it grows while mounted without CAP_SYS_RESOURCE, which growing a
	// mounted ext4 needs and these machines withhold.
	mountCap := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
	}
	var nodeID, volID, snapID string
	var volCtx, pubCtx map[string]string
	call("NodeGetInfo", node, func(ctx context.Context) error {
		r, err := nc().NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		nodeID = r.GetNodeId()
		return err
	})
	call("CreateVolume", ctrl, func(ctx context.Context) error {
		r, err := cc().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "crash", CapacityRange: &csi.CapacityRange{RequiredBytes: 320 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{mountCap}})
		volID, volCtx = r.GetVolume().GetVolumeId(), r.GetVolume().GetVolumeContext()
		return err
	})
	call("ControllerPublishVolume", ctrl, func(ctx context.Context) error {
		r, err := cc().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: nodeID, VolumeCapability: mountCap})
		pubCtx = r.GetPublishContext()
		return err
	})
	staging := filepath.Join(kubelet, "staging")
	stage := func() {
		call("NodeStageVolume", node, func(ctx context.Context) error {
			_, err := nc().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: volID, StagingTargetPath: staging,
				VolumeCapability: mountCap, PublishContext: pubCtx, VolumeContext: volCtx})
			return err
		})
	}
	publish := func(target string) {
		call("NodePublishVolume", node, func(ctx context.Context) error {
			_, err := nc().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: volID, StagingTargetPath: staging, TargetPath: target,
				VolumeCapability: mountCap, PublishContext: pubCtx, VolumeContext: volCtx})
			return err
		})
	}
	unpublish := func(target string) {
		call("NodeUnpublishVolume", node, func(ctx context.Context) error {
			_, err := nc().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target})
			return err
		})
	}
	unstage := func() {
		call("NodeUnstageVolume", node, func(ctx context.Context) error {
			_, err := nc().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging})
			return err
		})
	}

	first := filepath.Join(kubelet, "pods", "first", "vol")
	stage()
	publish(first)
	// Data acknowledged before any later crash: written and fsync'd
	// through the mount.
	data := make([]byte, 1<<20)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	writeSynced(t, filepath.Join(first, "acknowledged"), data)

	call("ControllerExpandVolume", ctrl, func(ctx context.Context) error {
		_, err := cc().ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: volID,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 400 << 20}, VolumeCapability: mountCap})
		return err
	})
	call("NodeExpandVolume", node, func(ctx context.Context) error {
		_, err := nc().NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: volID, VolumePath: first, StagingTargetPath: staging,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 400 << 20}, VolumeCapability: mountCap})
		return err
	})
	var st syscall.Statfs_t
	if err := syscall.Statfs(first, &st); err != nil || int64(st.Blocks)*st.Bsize < 300<<20 {
		t.Fatalf("after NodeExpandVolume the filesystem has %d bytes (err %v), want more than 300 MiB (400 MiB less the xfs log)", int64(st.Blocks)*st.Bsize, err)
	}
	call("CreateSnapshot", ctrl, func(ctx context.Context) error {
		r, err := cc().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: volID, Name: "crash-snap"})
		snapID = r.GetSnapshot().GetSnapshotId()
		return err
	})
	unpublish(first)
	unstage()

	// The same node again: the data is there.
	second := filepath.Join(kubelet, "pods", "second", "vol")
	stage()
	publish(second)
	got, err := os.ReadFile(filepath.Join(second, "acknowledged"))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("data written and fsync'd before the crash: read back %d bytes, err %v (equal: %v)", len(got), err, bytes.Equal(got, data))
	}
	unpublish(second)
	unstage()

	call("ControllerUnpublishVolume", ctrl, func(ctx context.Context) error {
		_, err := cc().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: nodeID})
		return err
	})
	call("DeleteSnapshot", ctrl, func(ctx context.Context) error {
		_, err := cc().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID})
		return err
	})
	call("DeleteVolume", ctrl, func(ctx context.Context) error {
		_, err := cc().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volID})
		return err
	})

	if target.killed != 1 {
		t.Fatalf("%s died %d times at %s; want exactly once (is the step on the path of this scenario?)", target.name, target.killed, point)
	}
	// A restart of both finds nothing to clean up either.
	ctrl.stop()
	node.stop()
	ctrl.conn, node.conn = nil, nil
	assertNothingLeft(t, work, []string{pool, state})
}

func writeSynced(t *testing.T, path string, data []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(errors.Join(err, fmt.Errorf("closing %s", path)))
	}
}

// TestInterruptedStageUndoneByUnstage: the node plugin is killed after it
// attached the loop device and before it recorded the stage, and the CO
// then gives up on the stage and unstages instead of retrying. The unstage
// finds the stage recorded as begun and detaches what it left.
func TestInterruptedStageUndoneByUnstage(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	pool, state := filepath.Join(work, "pool"), filepath.Join(work, "node-state")
	poolArg := "--block-pool=zone-a=" + pool
	if err := os.MkdirAll(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	ctrl := &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", poolArg, "--block-pool-filesystem=direct"}}
	node := &crashProc{t: t, name: "node", bin: bin, socket: filepath.Join(work, "n.sock"), log: filepath.Join(work, "node.log"),
		args: []string{"--roles", "node", "--node-id", "crash-node", "--zone", "zone-a", poolArg, "--block-pool-filesystem=direct", "--state-dir", state},
		env:  []string{faultpoint.EnvVar + "=block.stage.attached"}}
	ctrl.start()
	node.start()
	t.Cleanup(func() {
		ctrl.stop()
		node.stop()
		testenv.CleanupUnder(t, work)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cc, nc := csi.NewControllerClient(ctrl.conn), csi.NewNodeClient(node.conn)
	blockCap := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	}
	info, err := nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	vol, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "given-up", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{blockCap}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId(), VolumeCapability: blockCap})
	if err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(work, "kubelet", "staging")
	_, err = nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: blockCap,
		PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolume().GetVolumeContext()})
	if err == nil || !node.diedOfSIGKILL() {
		t.Fatalf("NodeStageVolume: want the node plugin killed at block.stage.attached, got %v", err)
	}
	if loops := localcluster.LoopsUnder(work); len(loops) != 1 {
		t.Fatalf("after the crash: loop devices %v, want the one the interrupted stage attached", loops)
	}
	node.start()
	if _, err := csi.NewNodeClient(node.conn).NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume after the interrupted stage: %v", err)
	}
	if loops := settledLoops(work, 0); len(loops) > 0 {
		t.Fatalf("loop devices left after the unstage: %v", loops)
	}
	if entries, _ := os.ReadDir(filepath.Join(state, nodestate.DirName)); len(entries) > 0 {
		t.Fatalf("lock records left after the unstage: %d", len(entries))
	}
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}

// TestVanishedNodeHandsOverItsVolume: the node holding a ReadWriteOnce
// volume disappears (its plugin killed, its mounts and loop device gone with
// its kernel). Until the CO forces ControllerUnpublishVolume for the dead
// node, no other node gets the volume; afterwards the next node stages it,
// reads what was fsync'd on the dead one, and the filesystem checks clean.
func TestVanishedNodeHandsOverItsVolume(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	pool := filepath.Join(work, "pool")
	if err := os.MkdirAll(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	poolArg := "--block-pool=zone-a=" + pool
	ctrl := &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", poolArg, "--block-pool-filesystem=direct"}}
	nodes := map[string]*crashProc{}
	for _, n := range []string{"node-a1", "node-a2"} {
		nodes[n] = &crashProc{t: t, name: n, bin: bin, socket: filepath.Join(work, n+".sock"), log: filepath.Join(work, n+".log"),
			args: []string{"--roles", "node", "--node-id", n, "--zone", "zone-a", poolArg, "--block-pool-filesystem=direct", "--state-dir", filepath.Join(work, n+"-state")}}
	}
	ctrl.start()
	nodes["node-a1"].start()
	nodes["node-a2"].start()
	t.Cleanup(func() {
		ctrl.stop()
		for _, n := range nodes {
			n.stop()
		}
		testenv.CleanupUnder(t, work)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cc := csi.NewControllerClient(ctrl.conn)
	mountCap := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	}
	vol, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "handed-over", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap}})
	if err != nil {
		t.Fatal(err)
	}
	id, volCtx := vol.GetVolume().GetVolumeId(), vol.GetVolume().GetVolumeContext()
	nodeID := func(n string) string {
		info, err := csi.NewNodeClient(nodes[n].conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return info.GetNodeId()
	}
	a1, a2 := nodeID("node-a1"), nodeID("node-a2")
	use := func(n, nid string) (target string) {
		pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nid, VolumeCapability: mountCap})
		if err != nil {
			t.Fatalf("ControllerPublishVolume to %s: %v", n, err)
		}
		nc := csi.NewNodeClient(nodes[n].conn)
		staging, target := filepath.Join(work, n, "staging"), filepath.Join(work, n, "pod", "vol")
		if _, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap,
			PublishContext: pub.GetPublishContext(), VolumeContext: volCtx}); err != nil {
			t.Fatalf("NodeStageVolume on %s: %v", n, err)
		}
		if _, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
			VolumeCapability: mountCap, PublishContext: pub.GetPublishContext(), VolumeContext: volCtx}); err != nil {
			t.Fatalf("NodePublishVolume on %s: %v", n, err)
		}
		return target
	}
	data := make([]byte, 256<<10)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	writeSynced(t, filepath.Join(use("node-a1", a1), "acknowledged"), data)

	// node-a1 vanishes: its plugin dies, and what its kernel held goes.
	dead := nodes["node-a1"]
	_ = dead.cmd.Process.Kill()
	<-dead.done
	for _, m := range localcluster.MountsUnder(filepath.Join(work, "node-a1")) {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
	}
	for _, l := range localcluster.LoopsUnder(pool) {
		if out, err := exec.Command("losetup", "-d", l).CombinedOutput(); err != nil {
			t.Fatalf("detaching %s: %v: %s", l, err, out)
		}
	}

	// Still attached to the dead node: nobody else may have it.
	_, err = cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: a2, VolumeCapability: mountCap})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("ControllerPublishVolume to node-a2 while attached to the dead node: %v, want FailedPrecondition", err)
	}
	// The CO forces the detach from the dead node (its plugin cannot answer).
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: a1}); err != nil {
		t.Fatalf("forced ControllerUnpublishVolume of the dead node: %v", err)
	}
	target := use("node-a2", a2)
	if got, err := os.ReadFile(filepath.Join(target, "acknowledged")); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("node-a2 reads %d bytes of what node-a1 fsync'd (err %v)", len(got), err)
	}
	nc := csi.NewNodeClient(nodes["node-a2"].conn)
	if _, err := nc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(work, "node-a2", "staging")}); err != nil {
		t.Fatal(err)
	}
	image := filepath.Join(pool, "volumes", strings.NewReplacer(":", "_").Replace(id)+".img")
	if out, err := exec.Command("fsck.ext4", "-n", "-f", image).CombinedOutput(); err != nil {
		t.Fatalf("the filesystem after the hand-over does not check clean: %v\n%s", err, out)
	}
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: a2}); err != nil {
		t.Fatal(err)
	}
	if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}

// vmCrashPoints are steps only a VM's kernel reaches (the host here has no
// iSCSI initiator); their scenarios are in test/vm: the stage over iSCSI
// killed after its login (TestCSIOverISCSIEndsASessionACrashLeft).
var vmCrashPoints = []string{"block.stage.iscsi-logged-in"}

// nfsCrashPoints are the NFS controller's steps that change state.
var nfsCrashPoints = []string{
	"nfs.create.storage-made",
	"nfs.create.recorded",
	"nfs.export.file-written",
	"nfs.export.applied",
	"nfs.attachments.recorded",
	"nfs.delete.export-removed",
	"nfs.delete.record-removed",
}

// TestNFSCrashAtEveryStepConverges: the NFS controller killed with SIGKILL
// at each step of create, publish, unpublish and delete (its ganesha and
// bus die with it, the restart starts new ones), the call retried until it
// succeeds. After each call what ganesha serves, asked over its bus, is
// exactly what the records say; at the end no export, record, image, loop
// device or mount is left.
func TestNFSCrashAtEveryStepConverges(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	for i, point := range nfsCrashPoints {
		t.Run(point, func(t *testing.T) { nfsCrashScenario(t, bin, point, 20600+i) })
	}
}

func nfsCrashScenario(t *testing.T, bin, point string, port int) {
	work := t.TempDir()
	gdir := filepath.Join(work, "ganesha")
	ctrl := &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", "-v", "2", "--nfs-export-root", filepath.Join(work, "nfs"), "--nfs-storage", "images",
			"--nfs-server", "127.0.0.1", "--nfs-listen-address", "127.0.0.1", "--nfs-port", fmt.Sprint(port), "--nfs-ganesha-dir", gdir},
		env: []string{faultpoint.EnvVar + "=" + point}}
	ctrl.start()
	t.Cleanup(func() {
		ctrl.stop()
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log:\n%s", testenv.ReadFile(ctrl.log))
		}
	})
	call := ctrl.call
	// served asks ganesha, over its own bus, which clients the export of
	// the volume's directory has; ok is false when there is no such export.
	served := func(volID string) (clients []string, ok bool) {
		t.Helper()
		control, err := ganesha.Dial("unix:path=" + filepath.Join(gdir, ganesha.BusSocketName))
		if err != nil {
			t.Fatal(err)
		}
		defer control.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		exports, err := control.Exports(ctx)
		if err != nil {
			t.Fatal(err)
		}
		dir := strings.NewReplacer(":", "_").Replace(volID)
		for _, e := range exports {
			if filepath.Base(e.Path) == dir {
				for _, c := range e.Clients {
					clients = append(clients, c.Match+" "+c.Access)
				}
				return clients, true
			}
		}
		return nil, false
	}
	c := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
	const node = "nfs-node@zone-a@127.0.0.21"
	var volID string
	call("CreateVolume", func(ctx context.Context) error {
		r, err := csi.NewControllerClient(ctrl.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "nfs-crash",
			CapacityRange: &csi.CapacityRange{RequiredBytes: 300 << 20}, VolumeCapabilities: []*csi.VolumeCapability{c},
			Parameters: map[string]string{"backend": "nfs"}})
		volID = r.GetVolume().GetVolumeId()
		return err
	})
	// A volume no node holds is served to no one: by an export with no
	// clients, or (after a restart, which exports only what nodes hold)
	// by none at all.
	if clients, ok := served(volID); len(clients) != 0 {
		t.Fatalf("after CreateVolume ganesha serves %v (exported: %v), want no client", clients, ok)
	}
	call("ControllerPublishVolume", func(ctx context.Context) error {
		_, err := csi.NewControllerClient(ctrl.conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: node, VolumeCapability: c})
		return err
	})
	if clients, _ := served(volID); !slices.Equal(clients, []string{"127.0.0.21/32 RW"}) {
		t.Fatalf("after ControllerPublishVolume ganesha serves clients %v, want exactly 127.0.0.21 RW", clients)
	}
	call("ControllerUnpublishVolume", func(ctx context.Context) error {
		_, err := csi.NewControllerClient(ctrl.conn).ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: node})
		return err
	})
	if clients, ok := served(volID); len(clients) != 0 {
		t.Fatalf("after ControllerUnpublishVolume ganesha serves %v (exported: %v), want no client", clients, ok)
	}
	call("DeleteVolume", func(ctx context.Context) error {
		_, err := csi.NewControllerClient(ctrl.conn).DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volID})
		return err
	})
	if clients, ok := served(volID); ok {
		t.Fatalf("after DeleteVolume ganesha still exports the volume (clients %v)", clients)
	}
	if ctrl.killed != 1 {
		t.Fatalf("the controller died %d times at %s; want exactly once", ctrl.killed, point)
	}
	ctrl.stop()
	ctrl.conn = nil
	assertNothingLeft(t, work, []string{filepath.Join(work, "nfs", "images"), filepath.Join(work, "nfs", "meta"), filepath.Join(gdir, "exports")})
}

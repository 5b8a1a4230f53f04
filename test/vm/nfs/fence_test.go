package nfs

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/agentapi"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// TestKernelNFSFenceOfAMountedClient: a node (vm1) has a single-writer
// volume mounted, holds an fcntl write lock on a file and keeps appending to
// it with fsync. The controller gets ControllerUnpublishVolume for vm1 and
// no node call at all, as after Kubernetes' force-detach of a dead node.
// From the answer on, vm1's writes fail at the server; vm2 is published,
// stages, takes the same lock within a bound (vm1's NFSv4 open and lock
// went with the export) and reads exactly the records vm1 had fsync'd
// (plus, at most, the one in flight when the fence came, whose fsync
// failed). vm1's own unpublish and unstage, when they come, are clean.
// Twice: with vm1 holding nothing else of the server, and with vm1 holding
// another volume of the same server, so its client keeps renewing its
// lease and only the fence can free the lock; that other volume keeps
// working on vm1 throughout. Then the fence of the whole node by a
// csi-addons NetworkFence (fenceByNetwork).
func TestKernelNFSFenceOfAMountedClient(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestKernelNFSAccessModes and TestNetworkFenceOverNFS")
	e := setup(t, 2)
	for _, otherVolume := range []bool{false, true} {
		name := "fence-idle"
		if otherVolume {
			name = "fence-busy"
		}
		if !t.Run(name, func(t *testing.T) { fenceSingleNode(t, e, name, otherVolume) }) {
			return
		}
	}
	if !t.Run("fence-writer-of-many", func(t *testing.T) { fenceWriterOfMany(t, e) }) {
		return
	}
	t.Run("network-fence", func(t *testing.T) { fenceByNetwork(t, e) })
}

// writeUntilFenced starts the lock holder on vm1, has it write and fsync
// records, and while it goes on cuts vm1 off with fence (forceDetach, or a
// network fence). beforeFence, when set, runs once the first records are
// fsync'd. It fails the test if a write that starts after the answer
// succeeds.
func writeUntilFenced(t *testing.T, e *env, path string, beforeFence func(), fence func() error) *vmtest.FencedWriter {
	holder, err := e.vm("vm1").HoldLock(e.ctx, path, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("vm1: pid %d holds a write lock on %s", holder.PID, filepath.Base(path))
	w, err := vmtest.WriteThroughFence(e.ctx, holder, beforeFence, fence)
	if err != nil {
		t.Fatalf("vm1: %v", err)
	}
	t.Logf("records fsync'd by vm1: %d; the write in flight at the fence: %v", w.Acked, w.InFlight)
	return w
}

// vm2TakesOver starts the volume on vm2 (pod "app") after vm1, which
// wrote the journal w holds, was fenced: vm2 must take vm1's lock within a
// bound and read exactly what vm1 fsync'd (and at most the record in
// flight).
func vm2TakesOver(t *testing.T, e *env, v *volume, w *vmtest.FencedWriter) {
	t.Helper()
	vm2 := e.vm("vm2")
	wantCode(t, "start on vm2", v.start("vm2", "app", false), codes.OK)
	path2 := filepath.Join(v.target("vm2", "app"), "journal")
	tl, err := vm2.TryLock(e.ctx, path2, 0, 1<<20, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if tl.Outcome != agentapi.LockAcquired {
		t.Fatalf("vm2 cannot take the lock vm1 held before the fence (%s after it): %+v", time.Since(w.FencedAt).Round(time.Second), tl)
	}
	t.Logf("vm2 took the lock %s after the fence", time.Since(w.FencedAt).Round(100*time.Millisecond))
	got, err := vm2.ReadFile(e.ctx, path2)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.CheckJournal(got, 0); err != nil {
		t.Fatal(err)
	}
}

// forceDetach is the CO's force-detach of vm1: ControllerUnpublishVolume
// with no node call before it.
func forceDetach(t *testing.T, e *env, v *volume) func() error {
	return func() error {
		t.Log("the CO force-detaches vm1: ControllerUnpublishVolume, no node call")
		_, err := e.ctrl.CSI.ControllerUnpublishVolume(e.ctx, &csi.ControllerUnpublishVolumeRequest{
			VolumeId: v.v.GetVolumeId(), NodeId: e.nodeID("vm1")})
		return err
	}
}

// cleanUpFenced is vm1 coming back: its lock holder goes, then the CO's
// NodeUnpublish, NodeUnstage and (again) ControllerUnpublish all succeed,
// and vm1 mounts nothing of the volume any more.
func cleanUpFenced(t *testing.T, e *env, v *volume, w *vmtest.FencedWriter, pod string) {
	t.Helper()
	if err := w.Holder.Release(e.ctx); err != nil {
		t.Logf("vm1's lock holder letting go after the fence: %v", err)
	}
	v.stop("vm1", pod)
	if mounts, _, err := e.vm("vm1").Run(e.ctx, "cat", "/proc/mounts"); err != nil || strings.Contains(mounts, v.v.GetVolumeId()) {
		t.Fatalf("vm1 still mounts %s after its unstage (%v):\n%s", v.v.GetVolumeId(), err, mounts)
	}
}

// fenceSingleNode: an RWO volume moves from a fenced vm1 to vm2.
func fenceSingleNode(t *testing.T, e *env, name string, otherVolume bool) {
	v := e.create(name, accessmode.SingleNodeWriter, nil)
	wantCode(t, "start on vm1", v.start("vm1", "app", false), codes.OK)
	var other *volume
	if otherVolume {
		other = e.create(name+"-other", accessmode.SingleNodeWriter, nil)
		wantCode(t, "start the other volume on vm1", other.start("vm1", "other", false), codes.OK)
		other.mustWrite("vm1", "other", "before", "before the fence\n")
	}

	w := writeUntilFenced(t, e, filepath.Join(v.target("vm1", "app"), "journal"), nil, forceDetach(t, e, v))

	t.Log("vm2 takes over: published, staged, the lock within a bound, exactly what vm1 fsync'd")
	vm2TakesOver(t, e, v, w)
	v.mustWrite("vm2", "app", "after", "vm2 writes after the fence\n")
	if other != nil {
		// Another export of the same server: untouched by the fence.
		other.mustWrite("vm1", "other", "after", "after the fence\n")
		other.mustRead("vm1", "other", "before", "before the fence\n")
	}

	cleanUpFenced(t, e, v, w, "app")
	v.mustRead("vm2", "app", "after", "vm2 writes after the fence\n")
	v.stop("vm2", "app")
	v.delete()
	if other != nil {
		other.stop("vm1", "other")
		other.delete()
	}
}

// fenceWriterOfMany: the writer of a MULTI_NODE_SINGLE_WRITER volume (vm1)
// is fenced while a reader (vm2) keeps the volume. The export stays, for
// the reader, and is served anew rather than updated, so that the writer's
// lock goes with it: the reader's read lock, refused before, is granted
// within a bound, and the reader reads what the writer fsync'd.
func fenceWriterOfMany(t *testing.T, e *env) {
	ctx, vm2 := e.ctx, e.vm("vm2")
	v := e.create("fence-mnsw", accessmode.MultiNodeSingleWriter, nil)
	wantCode(t, "writer on vm1", v.start("vm1", "app", false), codes.OK)
	wantCode(t, "reader on vm2", v.start("vm2", "reader", true), codes.OK)
	path2 := filepath.Join(v.target("vm2", "reader"), "journal")
	tryRead := func() agentapi.TryLockResponse {
		t.Helper()
		r, err := vm2.TryReadLock(ctx, path2, 0, 1<<20, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	w := writeUntilFenced(t, e, filepath.Join(v.target("vm1", "app"), "journal"), func() {
		if r := tryRead(); r.Outcome != agentapi.LockDenied {
			t.Fatalf("the reader's read lock while the writer holds its write lock: %+v, want denied", r)
		}
		got, err := vm2.ReadFile(ctx, path2)
		if err != nil || !strings.HasPrefix(string(got), vmtest.FenceRecord(0)) {
			t.Fatalf("the reader does not see the writer's first records: %q, %v", tail(string(got), 40), err)
		}
	}, forceDetach(t, e, v))
	// A bound, not at once: the server may free the lock after it answers.
	r := tryRead()
	for deadline := time.Now().Add(30 * time.Second); r.Outcome == agentapi.LockDenied && time.Now().Before(deadline); {
		time.Sleep(500 * time.Millisecond)
		r = tryRead()
	}
	if r.Outcome != agentapi.LockAcquired {
		t.Fatalf("the reader cannot read-lock what the fenced writer held (%s after the fence): %+v",
			time.Since(w.FencedAt).Round(time.Second), r)
	}
	t.Logf("the reader read-locked the journal %s after the fence", time.Since(w.FencedAt).Round(100*time.Millisecond))
	got, err := vm2.ReadFile(ctx, path2)
	if err != nil {
		t.Fatalf("the reader's mount after the writer's fence: %v", err)
	}
	if err := w.CheckJournal(got, 0); err != nil {
		t.Fatal(err)
	}
	v.mustNotWrite("vm2", "reader", "journal")
	cleanUpFenced(t, e, v, w, "app")
	v.stop("vm2", "reader")
	v.delete()
}

// fenceByNetwork: the fence of a node rather than of a volume, by a
// csi-addons NetworkFence on vm1's address, with no call for any of its
// volumes. vm1's writer fails on the RWO volume it writes, and so does a
// write to the other volume it holds: the fence is the node's. The CO still
// has the RWO volume on vm1, so vm2 is refused until the CO's force-detach;
// then vm2 takes the lock within a bound and reads exactly what vm1 had
// fsync'd. After the lift vm1 reads and writes the other volume again, which
// it still holds.
func fenceByNetwork(t *testing.T, e *env) {
	ctx, vm1 := e.ctx, e.vm("vm1")
	v := e.create("netfence", accessmode.SingleNodeWriter, nil)
	wantCode(t, "start on vm1", v.start("vm1", "app", false), codes.OK)
	other := e.create("netfence-other", accessmode.SingleNodeWriter, nil)
	wantCode(t, "start the other volume on vm1", other.start("vm1", "other", false), codes.OK)
	other.mustWrite("vm1", "other", "before", "before the fence\n")
	node, err := nodeid.Parse(e.nodeID("vm1"))
	if err != nil || node.Address == "" {
		t.Fatalf("vm1's node id %q states no address: %v", e.nodeID("vm1"), err)
	}
	block := []*fence.CIDR{{Cidr: node.Address + "/32"}}
	fc := fence.NewFenceControllerClient(e.ctrl.Conn())

	w := writeUntilFenced(t, e, filepath.Join(v.target("vm1", "app"), "journal"), nil, func() error {
		t.Logf("a NetworkFence on vm1's address %s: FenceClusterNetwork, no call for any volume", block[0].Cidr)
		_, err := fc.FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: block})
		return err
	})
	if err := other.write("vm1", "other", "during", "behind the fence\n"); err == nil {
		t.Error("vm1 wrote and fsync'd its other volume behind the fence")
	} else {
		t.Logf("vm1 writing its other volume behind the fence: %v", err)
	}
	wantCode(t, "publish to vm2 while the fenced vm1 still holds the RWO volume", v.attach("vm2", false), codes.FailedPrecondition)

	if err := forceDetach(t, e, v)(); err != nil {
		t.Fatal(err)
	}
	vm2TakesOver(t, e, v, w)

	t.Log("the fence is lifted: UnfenceClusterNetwork")
	if _, err := fc.UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatal(err)
	}
	// The kernel's client finds its way back to the export on its own
	// (a new lease, its state reclaimed): within a bound.
	var lastErr error
	for deadline := time.Now().Add(90 * time.Second); time.Now().Before(deadline); time.Sleep(time.Second) {
		if lastErr = other.write("vm1", "other", "after", "after the lift\n"); lastErr == nil {
			break
		}
	}
	if lastErr != nil {
		t.Fatalf("vm1 writing the volume it still holds, after the lift: %v", lastErr)
	}
	other.mustRead("vm1", "other", "before", "before the fence\n")
	if _, err := vm1.ReadFile(ctx, filepath.Join(v.target("vm1", "app"), "journal")); err == nil {
		t.Error("vm1 reads the RWO volume it was force-detached from, after the lift")
	}
	cleanUpFenced(t, e, v, w, "app")
	v.stop("vm2", "app")
	v.delete()
	other.stop("vm1", "other")
	other.delete()
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

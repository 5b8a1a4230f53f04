package nfs

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/test/vm/agentapi"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// fenceLine is the n-th record the writer on the fenced node appends: fixed
// width, so record n starts at n*len(fenceLine(0)).
func fenceLine(n int) string { return fmt.Sprintf("record %06d\n", n) }

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
// working on vm1 throughout.
func TestKernelNFSFenceOfAMountedClient(t *testing.T) {
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
	t.Run("fence-writer-of-many", func(t *testing.T) { fenceWriterOfMany(t, e) })
}

// fencedWriter is vm1 writing records through a process that holds a write
// lock on the whole journal, fenced while it writes.
type fencedWriter struct {
	holder   *vmtest.LockHolder
	acked    int   // records whose write and fsync succeeded, in order
	inFlight error // how the write in flight at the fence ended
	fencedAt time.Time
}

// writeUntilFenced starts the lock holder on vm1, has it write and fsync
// records, and while it goes on sends ControllerUnpublishVolume for vm1
// with no node call before it. beforeFence, when set, runs once the first
// records are fsync'd. It fails the test if a write that starts after the
// answer succeeds.
func writeUntilFenced(t *testing.T, e *env, v *volume, path string, beforeFence func()) *fencedWriter {
	ctx := e.ctx
	holder, err := e.vm("vm1").HoldLock(ctx, path, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("vm1: pid %d holds a write lock on %s", holder.PID, filepath.Base(path))
	w := &fencedWriter{holder: holder}
	write := func(n int) error {
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		line := fenceLine(n)
		return holder.Write(wctx, int64(n*len(line)), []byte(line))
	}
	for n := range 3 {
		if err := write(n); err != nil {
			t.Fatalf("vm1 writing record %d before the fence: %v", n, err)
		}
	}
	if beforeFence != nil {
		beforeFence()
	}
	type result struct {
		acked  int
		failed error
	}
	stop := make(chan struct{})
	done := make(chan result, 1)
	go func() {
		n := 3
		for {
			select {
			case <-stop:
				done <- result{acked: n}
				return
			default:
			}
			if err := write(n); err != nil {
				done <- result{acked: n, failed: err}
				return
			}
			n++
		}
	}()
	time.Sleep(time.Second) // a few records under way

	t.Log("the CO force-detaches vm1: ControllerUnpublishVolume, no node call")
	if _, err := e.ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
		VolumeId: v.v.GetVolumeId(), NodeId: e.nodeID("vm1")}); err != nil {
		t.Fatalf("ControllerUnpublish of vm1: %v", err)
	}
	w.fencedAt = time.Now()
	close(stop)
	select {
	case r := <-done:
		w.acked, w.inFlight = r.acked, r.failed
	case <-time.After(2 * time.Minute):
		t.Fatal("vm1's write in flight at the fence neither finished nor failed within 2 minutes")
	}
	t.Logf("records fsync'd by vm1: %d; the write in flight at the fence: %v", w.acked, w.inFlight)
	if err := write(w.acked); err == nil {
		t.Fatalf("vm1 wrote and fsync'd record %d after ControllerUnpublishVolume answered", w.acked)
	} else {
		t.Logf("vm1's write+fsync after the fence: %v", err)
	}
	return w
}

// checkJournal fails the test unless got is exactly the records vm1
// fsync'd, or those and the one whose fsync failed at the fence (it may
// have reached the server just before).
func (w *fencedWriter) checkJournal(t *testing.T, got []byte) {
	t.Helper()
	var want strings.Builder
	for n := range w.acked {
		want.WriteString(fenceLine(n))
	}
	switch {
	case string(got) == want.String():
	case w.inFlight != nil && string(got) == want.String()+fenceLine(w.acked):
		t.Logf("record %d, whose fsync failed at the fence, reached the server before it", w.acked)
	default:
		t.Fatalf("the journal holds %d bytes ending %q; want the %d records vm1 fsync'd (%d bytes)",
			len(got), tail(string(got), 40), w.acked, want.Len())
	}
}

// cleanUpFenced is vm1 coming back: its lock holder goes, then the CO's
// NodeUnpublish, NodeUnstage and (again) ControllerUnpublish all succeed,
// and vm1 mounts nothing of the volume any more.
func cleanUpFenced(t *testing.T, e *env, v *volume, w *fencedWriter, pod string) {
	t.Helper()
	if err := w.holder.Release(e.ctx); err != nil {
		t.Logf("vm1's lock holder letting go after the fence: %v", err)
	}
	v.stop("vm1", pod)
	if mounts, _, err := e.vm("vm1").Run(e.ctx, "cat", "/proc/mounts"); err != nil || strings.Contains(mounts, v.v.GetVolumeId()) {
		t.Fatalf("vm1 still mounts %s after its unstage (%v):\n%s", v.v.GetVolumeId(), err, mounts)
	}
}

// fenceSingleNode: an RWO volume moves from a fenced vm1 to vm2.
func fenceSingleNode(t *testing.T, e *env, name string, otherVolume bool) {
	ctx, vm2 := e.ctx, e.vm("vm2")
	v := e.create(name, accessmode.SingleNodeWriter, nil)
	wantCode(t, "start on vm1", v.start("vm1", "app", false), codes.OK)
	var other *volume
	if otherVolume {
		other = e.create(name+"-other", accessmode.SingleNodeWriter, nil)
		wantCode(t, "start the other volume on vm1", other.start("vm1", "other", false), codes.OK)
		other.mustWrite("vm1", "other", "before", "before the fence\n")
	}

	w := writeUntilFenced(t, e, v, filepath.Join(v.target("vm1", "app"), "journal"), nil)

	t.Log("vm2 takes over: published, staged, the lock within a bound, exactly what vm1 fsync'd")
	wantCode(t, "start on vm2", v.start("vm2", "app", false), codes.OK)
	path2 := filepath.Join(v.target("vm2", "app"), "journal")
	tl, err := vm2.TryLock(ctx, path2, 0, 1<<20, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if tl.Outcome != agentapi.LockAcquired {
		t.Fatalf("vm2 cannot take the lock vm1 held before the fence (%s after it): %+v", time.Since(w.fencedAt).Round(time.Second), tl)
	}
	t.Logf("vm2 took the lock %s after the fence", time.Since(w.fencedAt).Round(100*time.Millisecond))
	got, err := vm2.ReadFile(ctx, path2)
	if err != nil {
		t.Fatal(err)
	}
	w.checkJournal(t, got)
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

	w := writeUntilFenced(t, e, v, filepath.Join(v.target("vm1", "app"), "journal"), func() {
		if r := tryRead(); r.Outcome != agentapi.LockDenied {
			t.Fatalf("the reader's read lock while the writer holds its write lock: %+v, want denied", r)
		}
		got, err := vm2.ReadFile(ctx, path2)
		if err != nil || !strings.HasPrefix(string(got), fenceLine(0)) {
			t.Fatalf("the reader does not see the writer's first records: %q, %v", tail(string(got), 40), err)
		}
	})
	// A bound, not at once: the server may free the lock after it answers.
	r := tryRead()
	for deadline := time.Now().Add(30 * time.Second); r.Outcome == agentapi.LockDenied && time.Now().Before(deadline); {
		time.Sleep(500 * time.Millisecond)
		r = tryRead()
	}
	if r.Outcome != agentapi.LockAcquired {
		t.Fatalf("the reader cannot read-lock what the fenced writer held (%s after the fence): %+v",
			time.Since(w.fencedAt).Round(time.Second), r)
	}
	t.Logf("the reader read-locked the journal %s after the fence", time.Since(w.fencedAt).Round(100*time.Millisecond))
	got, err := vm2.ReadFile(ctx, path2)
	if err != nil {
		t.Fatalf("the reader's mount after the writer's fence: %v", err)
	}
	w.checkJournal(t, got)
	v.mustNotWrite("vm2", "reader", "journal")
	cleanUpFenced(t, e, v, w, "app")
	v.stop("vm2", "reader")
	v.delete()
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

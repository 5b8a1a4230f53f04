package nfs

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/agentapi"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// journal is a writer on a node VM appending fixed-width records through
// a lock holder's descriptor, each write fsynced, with the time of every
// acknowledged one.
type journal struct {
	holder *vmtest.LockHolder
	stop   chan struct{}
	done   chan struct{}

	mu     sync.Mutex
	acked  []time.Time // acked[n]: when record n's write and fsync returned
	failed error
}

func startJournal(ctx context.Context, holder *vmtest.LockHolder) *journal {
	j := &journal{holder: holder, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(j.done)
		for n := 0; ; n++ {
			select {
			case <-j.stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			line := vmtest.FenceRecord(n)
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			err := holder.Write(wctx, int64(n*len(line)), []byte(line))
			cancel()
			j.mu.Lock()
			if err != nil {
				j.failed = err
				j.mu.Unlock()
				return
			}
			j.acked = append(j.acked, time.Now())
			j.mu.Unlock()
		}
	}()
	return j
}

// written is how many records are acknowledged so far.
func (j *journal) written() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.acked)
}

// finish stops the writer and answers its records, the longest time
// between two acknowledged writes, and how a write failed, if one did.
func (j *journal) finish() (records int, longestGap time.Duration, err error) {
	close(j.stop)
	<-j.done
	for i := 1; i < len(j.acked); i++ {
		longestGap = max(longestGap, j.acked[i].Sub(j.acked[i-1]))
	}
	return len(j.acked), longestGap, j.failed
}

// TestKernelNFSWritesAcrossTakeover: the NFS volumes are served by a
// storage target, and two controllers use it, one acting. A kernel NFS
// client on vm1 holds a POSIX lock on a file and writes records through
// it while the acting controller is killed, and then its successor
// frozen. Each time the other takes over within 30 s and acts (a new
// volume, published to vm2, is written there), while vm1's writes go on
// without a pause: no byte goes through a controller, and ganesha, on
// the target, never restarts, so vm1 keeps its lock without a grace
// period, and vm2 cannot take it. Thawed, the frozen controller is
// refused and stands by.
func TestKernelNFSWritesAcrossTakeover(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestNFSServedByATarget (test/integration, libnfs clients)")
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	c := vmtest.Start(t, vmtest.Options{VMs: 2, Binary: bin})
	ctx := testenv.Context(t, 15*time.Minute)
	target := testenv.StartNFSTarget(ctx, t, bin, c.ServerNS, c.Server.String(), "--nfs-pool-size", "2Gi")
	controller := func(name string) *testenv.Controller {
		work := t.TempDir()
		p := testenv.NewController(t, bin, c.ServerNS, work, "--roles", "controller", "-v", "2",
			"--nfs-target", target.Endpoint(), "--max-volumes-per-node", "8")
		p.Log = filepath.Join(work, name+".log")
		p.Start(ctx)
		t.Cleanup(func() {
			p.Stop()
			if t.Failed() {
				t.Logf("%s log:\n%s", name, testenv.ReadFile(p.Log))
			}
		})
		return p
	}
	first := controller("first")
	second := controller("second")
	e := &env{t: t, ctx: ctx, c: c, ctrl: first, nodes: map[string]csi.NodeClient{}}
	for _, vm := range c.VMs {
		if err := vm.StartPlugin(ctx, "--max-volumes-per-node", "8"); err != nil {
			t.Fatal(err)
		}
		e.nodes[vm.Name] = vm.NodeClient(t)
	}
	vm2 := e.vm("vm2")
	ganeshaPID, _ := testenv.NFSServerPIDs(t, target.GaneshaDir)

	v := e.create("journal", accessmode.MultiNodeMultiWriter, nil)
	for _, n := range []string{"vm1", "vm2"} {
		wantCode(t, "start on "+n, v.start(n, "app", false), codes.OK)
	}
	const lockLen = 1 << 20 // vm1's range: the whole journal
	holder, err := e.vm("vm1").HoldLock(ctx, filepath.Join(v.target("vm1", "app"), "journal"), 0, lockLen)
	if err != nil {
		t.Fatal(err)
	}
	j := startJournal(ctx, holder)
	for j.written() < 20 {
		time.Sleep(100 * time.Millisecond)
	}

	// takeOver waits until next acts after fault, and shows it acting: a
	// new volume, published to vm2 and written there.
	takeOver := func(name string, next *testenv.Controller, fault time.Time) {
		t.Helper()
		e.ctrl = next
		for {
			_, err := next.CSI.ListVolumes(ctx, &csi.ListVolumesRequest{})
			if err == nil {
				break
			}
			if status.Code(err) != codes.Unavailable || time.Since(fault) > 30*time.Second {
				t.Fatalf("%s: the other controller does not act %v after the fault: %v", name, time.Since(fault).Round(time.Millisecond), err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("%s: the other controller acted %v after the fault; vm1 has written %d records", name, time.Since(fault).Round(time.Millisecond), j.written())
		nv := e.create(name, accessmode.SingleNodeWriter, nil)
		wantCode(t, name+": start on vm2", nv.start("vm2", name, false), codes.OK)
		nv.mustWrite("vm2", name, "acted", name)
		nv.stop("vm2", name)
		nv.delete()
	}

	first.Kill()
	takeOver("after-a-kill", second, time.Now())

	// The killed one comes back as the standby; then the acting one
	// freezes.
	first.Start(ctx)
	second.Freeze()
	takeOver("after-a-freeze", first, time.Now())
	second.Thaw()
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(testenv.ReadFile(second.Log), "Stepping down as the acting controller"); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the thawed controller did not step down")
		}
	}
	if _, err := second.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
		VolumeId: v.v.GetVolumeId(), NodeId: e.nodeID("vm1")}); status.Code(err) != codes.Unavailable {
		t.Errorf("unpublish through the thawed former controller: %v, want UNAVAILABLE", err)
	}

	records, gap, err := j.finish()
	if err != nil {
		t.Fatalf("vm1's write %d failed: %v", records, err)
	}
	t.Logf("vm1 wrote %d records; the longest time between two acknowledged writes was %v", records, gap.Round(time.Millisecond))
	// A ganesha restart would hold writes for its grace period (tens of
	// seconds); a write through the emulated VM's agent takes a fraction
	// of a second.
	if gap > 5*time.Second {
		t.Errorf("vm1's writes paused for %v across the take-overs", gap.Round(time.Millisecond))
	}
	if now, _ := testenv.NFSServerPIDs(t, target.GaneshaDir); now != ganeshaPID {
		t.Errorf("ganesha was restarted (pid %d, then %d)", ganeshaPID, now)
	}
	if r, err := vm2.TryLock(ctx, filepath.Join(v.target("vm2", "app"), "journal"), 100, 10, time.Minute); err != nil || r.Outcome != agentapi.LockDenied {
		t.Errorf("vm2 on vm1's locked range: %+v, %v; want it denied: vm1 still holds it", r, err)
	}
	got, err := vm2.ReadFile(ctx, filepath.Join(v.target("vm2", "app"), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	for n := range records {
		line := vmtest.FenceRecord(n)
		if off := n * len(line); off+len(line) > len(got) || string(got[off:off+len(line)]) != line {
			t.Fatalf("record %d, acknowledged, is not in the journal vm2 reads (%d bytes)", n, len(got))
		}
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	v.stop("vm1", "app")
	v.stop("vm2", "app")
	v.delete()
}

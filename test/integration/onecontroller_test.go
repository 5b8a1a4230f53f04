package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestOneControllerActsAtATime: a second controller on the same pool (a
// replacement started while the old one still runs) waits for the first's
// lock: it says so in its log, answers Probe not ready and every Controller
// call UNAVAILABLE, so it cannot grant a second node a single-node volume
// from a state it does not own. Once the first dies it takes over, with
// the attachments the first made.
func TestOneControllerActsAtATime(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	oneControllerActsAtATime(t, bin, work, nil, "--block-pool=zone-a="+filepath.Join(work, "pool"),
		"Waiting for another controller to stop", "locked by another controller", false)
}

// TestOneControllerPerStorageTarget: the same with the pool behind a
// storage target: the target's lease does what the pool's lock file does.
// The first controller dies without giving the lease back, so the second
// takes over once the lease's term has run out. The second is elected: a
// standby that knows another controller acts answers Probe ready (its
// sidecars wait in their own elections, and its liveness probe stays
// quiet), and refuses the calls that act.
func TestOneControllerPerStorageTarget(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	sock := filepath.Join(work, "target.sock")
	stopTarget := startTarget(t, bin, work, sock)
	// The target restarts while the second controller waits: it still
	// knows the first holds its lease (its record, in the pool's
	// directory), so the second keeps waiting and the first keeps acting,
	// rather than the waiting one taking the lease the moment the target
	// is back.
	restart := func(cc1 csi.ControllerClient) {
		stopTarget()
		stopTarget = startTarget(t, bin, work, sock)
		// The first's next call would take a lease the target forgot;
		// the waiting one, asking every second, gets the chance first.
		time.Sleep(2 * time.Second)
		vol, err := cc1.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "after-restart", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{capability(accessmode.SingleNodeWriter, "ext4")}})
		if err != nil {
			t.Fatalf("the first controller's call after the target restarted: %v", err)
		}
		if _, err := cc1.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: vol.GetVolume().GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { stopTarget() })
	oneControllerActsAtATime(t, bin, work, restart, "--block-target=zone-a=unix://"+sock,
		"Waiting for another controller to let go of a storage target", "another controller holds storage target", true)
}

// zoneTargets starts a storage target of each zone in work (startZoneTarget,
// serving work/ZONE.sock), stopped when the test ends, and answers the
// controller's --block-target arguments and each zone's target's stop
// function, which the test may call to stop it early (and set to the stop
// of a target it starts again).
func zoneTargets(t *testing.T, bin, work string, zones ...string) ([]string, map[string]func()) {
	var args []string
	stops := map[string]func(){}
	for _, zone := range zones {
		sock := filepath.Join(work, zone+".sock")
		stops[zone] = startZoneTarget(t, bin, work, zone, sock)
		args = append(args, "--block-target="+zone+"=unix://"+sock)
	}
	t.Cleanup(func() {
		for _, stop := range stops {
			stop()
		}
	})
	return args, stops
}

// runController starts a controller process called name in work with
// args, stopped when the test ends (thawed first, should the test have
// frozen it), its log shown when the test failed.
func runController(t *testing.T, bin, work, name string, args ...string) *crashProc {
	p := &crashProc{t: t, name: name, bin: bin, socket: filepath.Join(work, name+".sock"), log: filepath.Join(work, name+".log"),
		args: append([]string{"--roles", "controller", "-v", "2"}, args...)}
	p.start()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		p.stop()
		if t.Failed() {
			t.Logf("%s log:\n%s", name, testenv.ReadFile(p.log))
		}
	})
	return p
}

// startTarget runs a storage target of one block pool in work, serving
// sock, until the function it answers stops it.
func startTarget(t *testing.T, bin, work, sock string) (stop func()) {
	return startZoneTarget(t, bin, work, "zone-a", sock)
}

// startZoneTarget is startTarget for zone's pool, in work/pool (zone-a) or
// work/pool-ZONE, logging to work/target.log or work/target-ZONE.log.
func startZoneTarget(t *testing.T, bin, work, zone, sock string) (stop func()) {
	pool, logPath := filepath.Join(work, "pool"), filepath.Join(work, "target.log")
	if zone != "zone-a" {
		pool, logPath = filepath.Join(work, "pool-"+zone), filepath.Join(work, "target-"+zone+".log")
	}
	p := testenv.NewTarget(t, bin, "", sock, logPath, "--roles", "target", "--block-pool="+zone+"="+pool, "--block-pool-filesystem=direct", "-v", "2")
	p.Start(context.Background())
	return func() {
		p.Stop()
		if t.Failed() {
			t.Logf("target log %s:\n%s", logPath, testenv.ReadFile(logPath))
		}
	}
}

// oneControllerActsAtATime starts two controllers with blockArg and
// checks that the second waits (logging waitingLog, refusing calls with
// refusal, answering Probe ready only when standbyReady) until the first
// dies, then takes over. meanwhile, unless nil,
// runs while the second waits, given the first's client; the second must
// go on waiting after it.
func oneControllerActsAtATime(t *testing.T, bin, work string, meanwhile func(csi.ControllerClient), blockArg, waitingLog, refusal string, standbyReady bool) {
	poolArg := blockArg
	first := &crashProc{t: t, name: "first controller", bin: bin, socket: filepath.Join(work, "c1.sock"), log: filepath.Join(work, "c1.log"),
		args: []string{"--roles", "controller", poolArg, "--block-pool-filesystem=direct", "-v", "2"}}
	first.start()
	t.Cleanup(first.stop)
	cc1 := csi.NewControllerClient(first.conn)
	ctx := context.Background()
	c := capability(accessmode.SingleNodeWriter, "ext4")
	vol, err := cc1.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "one-owner", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{c}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	if _, err := cc1.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1@zone-a", VolumeCapability: c}); err != nil {
		t.Fatal(err)
	}

	// The second one, started by hand: it must not become ready.
	log2 := filepath.Join(work, "c2.log")
	logf, err := os.Create(log2)
	if err != nil {
		t.Fatal(err)
	}
	sock2 := filepath.Join(work, "c2.sock")
	second := exec.Command(bin, "--endpoint", "unix://"+sock2, "--roles", "controller", poolArg, "--block-pool-filesystem=direct", "-v", "2")
	second.Stdout, second.Stderr = logf, logf
	if err := second.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = second.Wait(); logf.Close(); close(done) }()
	t.Cleanup(func() {
		_ = second.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = second.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("first controller log:\n%s\nsecond controller log:\n%s", testenv.ReadFile(first.log), testenv.ReadFile(log2))
		}
	})
	conn, err := grpc.NewClient("unix://"+sock2, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	probe := func() (bool, error) {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		resp, err := csi.NewIdentityClient(conn).Probe(pctx, &csi.ProbeRequest{})
		return resp.GetReady().GetValue(), err
	}
	// Wait until it serves and has logged that it waits.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := probe()
		if err == nil && strings.Contains(testenv.ReadFile(log2), waitingLog) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second controller neither served nor said it waits: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !strings.Contains(testenv.ReadFile(log2), "pid "+strconv.Itoa(first.cmd.Process.Pid)) {
		t.Errorf("the second controller's log does not name the first (pid %d) as the holder", first.cmd.Process.Pid)
	}
	cc2 := csi.NewControllerClient(conn)
	waits := 3
	if meanwhile != nil {
		meanwhile(cc1)
		// Until the second has asked again (it says what it saw last,
		// which may be that meanwhile made it wait for something else),
		// then long enough for a waiting controller, which asks every
		// second, to take a lease the target no longer knew.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			_, err := cc2.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2@zone-a", VolumeCapability: c})
			if strings.Contains(status.Convert(err).Message(), refusal) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("publish through the waiting controller after meanwhile: %v, want UNAVAILABLE saying another controller holds the lock", err)
			}
		}
		waits = 10
	}
	for i := 0; i < waits; i++ {
		if ready, err := probe(); err != nil || ready != standbyReady {
			t.Fatalf("Probe of the waiting controller = ready %t, %v; want ready %t", ready, err, standbyReady)
		}
		// What it can do is answered whatever its state: sidecars ask
		// before they elect.
		if _, err := cc2.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{}); err != nil {
			t.Fatalf("ControllerGetCapabilities of the waiting controller: %v", err)
		}
		_, err := cc2.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2@zone-a", VolumeCapability: c})
		if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), refusal) {
			t.Fatalf("publish through the waiting controller: %v, want UNAVAILABLE saying another controller holds the lock", err)
		}
		if _, err := cc2.ListVolumes(ctx, &csi.ListVolumesRequest{}); status.Code(err) != codes.Unavailable {
			t.Fatalf("ListVolumes through the waiting controller: %v, want UNAVAILABLE", err)
		}
		time.Sleep(300 * time.Millisecond)
	}

	// The first dies (SIGKILL: no chance to clean up); the kernel drops its
	// locks and the second takes over.
	_ = first.cmd.Process.Kill()
	<-first.done
	deadline = time.Now().Add(30*time.Second + remote.LeaseTerm)
	for {
		ready, perr := probe()
		_, err = cc2.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2@zone-a", VolumeCapability: c})
		if perr == nil && ready && status.Code(err) != codes.Unavailable {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second controller did not act after the first died: Probe ready %t, %v; publish: %v", ready, perr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("publish to a second node through the controller that took over: %v, want FAILED_PRECONDITION (node-1 holds it)", err)
	}
	if _, err := cc2.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1@zone-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cc2.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}

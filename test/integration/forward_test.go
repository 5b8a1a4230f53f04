package integration

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/peer"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
)

// freePort is a loopback address:port nothing listens on now.
func freePort(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// TestStandbyForwardsToTheActingController: two controllers of one
// storage target, each with a peer listener. The standby is ready and
// serves every call by forwarding it to the acting one, which it finds in
// the target's lease. When the acting one dies the standby takes over, and
// the first, started again, is the standby that forwards.
func TestStandbyForwardsToTheActingController(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	sock := filepath.Join(work, "target.sock")
	t.Cleanup(startTarget(t, bin, work, sock))
	ca := certs.NewCA(t, "controllers")
	controller := func(name string) *crashProc {
		files := ca.Peer(peer.ServerName)
		return runController(t, bin, work, name, "--block-target=zone-a=unix://"+sock,
			"--controller-peer-listen=tcp://"+freePort(t), "--tls-cert="+files.Cert, "--tls-key="+files.Key, "--tls-ca="+files.CA)
	}
	ctx := context.Background()
	c := capability(accessmode.SingleNodeWriter, "")
	create := func(p *crashProc, name string) (string, error) {
		resp, err := csi.NewControllerClient(p.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}, VolumeCapabilities: []*csi.VolumeCapability{c}})
		return resp.GetVolume().GetVolumeId(), err
	}

	first := controller("first")
	second := controller("second")
	id, err := create(second, "through-the-standby")
	if err != nil {
		t.Fatalf("CreateVolume through the standby: %v", err)
	}
	if !strings.Contains(testenv.ReadFile(first.log), "through-the-standby") {
		t.Errorf("the acting controller's log does not show the forwarded CreateVolume")
	}
	_, err = csi.NewControllerClient(second.conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1@zone-a", VolumeCapability: c})
	if err != nil {
		t.Fatalf("publish through the standby: %v", err)
	}
	_, err = csi.NewControllerClient(second.conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2@zone-a", VolumeCapability: c})
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("publish to a second node through the standby: %v, want the acting controller's FAILED_PRECONDITION", err)
	}

	// The acting one dies; the standby takes over once the lease ran out,
	// and serves calls itself.
	_ = first.cmd.Process.Signal(syscall.SIGKILL)
	<-first.done
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if _, err = create(second, "after-the-first-died"); status.Code(err) != codes.Unavailable {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the standby did not take over: %v", err)
		}
	}
	if err != nil {
		t.Fatalf("CreateVolume through the controller that took over: %v", err)
	}
	// The first, back, stands by and forwards.
	first.start()
	if _, err := create(first, "through-the-new-standby"); err != nil {
		t.Fatalf("CreateVolume through the restarted first controller: %v", err)
	}
	if !strings.Contains(testenv.ReadFile(second.log), "through-the-new-standby") {
		t.Errorf("the acting controller's log does not show the call forwarded by the new standby")
	}
}

// TestStandbyOnLockFilesForwards: two controllers of one pool that their
// lock files arbitrate (no storage target, so no lease names the acting
// one), each with a peer listener and both listed as --controller-peers.
// The one waiting for the lock is ready, and serves every call by asking
// the listed peers in turn; when the acting one dies it takes the lock at
// once and acts, and the first, started again, forwards to it.
func TestStandbyOnLockFilesForwards(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ca := certs.NewCA(t, "controllers")
	files := ca.Peer(peer.ServerName)
	addrs := []string{freePort(t), freePort(t)}
	controller := func(name, listen string) *crashProc {
		return runController(t, bin, work, name, "--block-pool=zone-a="+filepath.Join(work, "pool"), "--block-pool-filesystem=direct",
			"--controller-peer-listen=tcp://"+listen, "--controller-peers="+strings.Join(addrs, ","),
			"--tls-cert="+files.Cert, "--tls-key="+files.Key, "--tls-ca="+files.CA)
	}
	ctx := context.Background()
	c := capability(accessmode.SingleNodeWriter, "")
	create := func(p *crashProc, name string) error {
		_, err := csi.NewControllerClient(p.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}, VolumeCapabilities: []*csi.VolumeCapability{c}})
		return err
	}

	first := controller("first", addrs[0])
	// Ready although it waits for the first's lock: it forwards.
	second := controller("second", addrs[1])
	if !strings.Contains(testenv.ReadFile(second.log), "Waiting for another controller to stop") {
		t.Fatalf("the second controller does not wait for the first's lock")
	}
	if err := create(second, "through-the-waiting-one"); err != nil {
		t.Fatalf("CreateVolume through the controller waiting for the lock: %v", err)
	}
	if !strings.Contains(testenv.ReadFile(first.log), "through-the-waiting-one") {
		t.Errorf("the acting controller's log does not show the forwarded CreateVolume")
	}

	_ = first.cmd.Process.Signal(syscall.SIGKILL)
	<-first.done
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if err = create(second, "after-the-first-died"); status.Code(err) != codes.Unavailable {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second controller did not take over: %v", err)
		}
	}
	if err != nil {
		t.Fatalf("CreateVolume through the controller that took over: %v", err)
	}
	first.start()
	if err := create(first, "through-the-restarted-first"); err != nil {
		t.Fatalf("CreateVolume through the restarted first controller: %v", err)
	}
	if !strings.Contains(testenv.ReadFile(second.log), "through-the-restarted-first") {
		t.Errorf("the acting controller's log does not show the call the restarted first forwarded")
	}
}

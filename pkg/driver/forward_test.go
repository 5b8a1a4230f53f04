package driver_test

import (
	"context"
	"net"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/peer"
	"github.com/modeguard/modeguard/test/certs"
)

// electedDriver is an elected controller on ctrl, standing by.
func electedDriver(t *testing.T, ctrl backend.Controller, m *metrics.Metrics) *driver.Driver {
	t.Helper()
	d, err := driver.New(driver.Config{Version: "test", Roles: []driver.Role{driver.RoleController}, ControllersLater: true, Elected: true, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetControllers(map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: ctrl}); err != nil {
		t.Fatal(err)
	}
	return d
}

// servePeers serves d's peer listener on loopback with files, until the
// test ends, and answers its address.
func servePeers(t *testing.T, d *driver.Driver, files certs.Files) string {
	t.Helper()
	creds, err := peer.ServerCredentials(remote.TLSFiles(files))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := d.NewPeerServer(creds)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// actingController is an elected controller in a term on an in-memory
// backend, with its peer listener served with a certificate of ca.
func actingController(t *testing.T, ca *certs.CA) (*memory.Controller, *driver.Driver, string) {
	t.Helper()
	ctrl, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-a", SizeBytes: 1 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	acting := electedDriver(t, ctrl, nil)
	if err := acting.StartTerm(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ctrl, acting, servePeers(t, acting, ca.Peer(peer.ServerName))
}

// at is a peer.Dialer that finds the acting controller at addr.
func at(t *testing.T, files certs.Files, addr string) *peer.Dialer {
	d := peer.NewDialer(remote.TLSFiles(files), peer.DialerConfig{Find: func() (string, error) { return addr, nil }})
	t.Cleanup(d.Close)
	return d
}

// TestStandbyForwardsToTheActingController: a standby sends the Controller
// calls it receives on to the acting controller, whose answers, errors
// with their codes included, come back unchanged; it answers its
// capabilities itself; a forwarded call reaching a controller that no
// longer acts is refused there, never forwarded again.
func TestStandbyForwardsToTheActingController(t *testing.T) {
	ca := certs.NewCA(t, "controllers")
	ctrl, acting, addr := actingController(t, ca)
	m := metrics.New("test", []string{"controller"})
	standby := electedDriver(t, ctrl, m)
	standby.StandBy("another controller holds storage target t1", true)
	cc := csi.NewControllerClient(serveDriver(t, standby))
	ctx := context.Background()

	// Without peers, the standby refuses.
	create := func(name string) (*csi.CreateVolumeResponse, error) {
		return cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)}})
	}
	if _, err := create("refused"); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "another controller holds storage target t1") {
		t.Fatalf("CreateVolume through a standby that forwards nothing: %v, want UNAVAILABLE saying why", err)
	}

	standby.SetPeers(at(t, ca.Peer(peer.ServerName), addr))
	vol, err := create("forwarded")
	if err != nil {
		t.Fatalf("CreateVolume through the standby: %v", err)
	}
	id := vol.GetVolume().GetVolumeId()
	made, err := ctrl.ListVolumes(ctx)
	if err != nil || len(made) != 1 || made[0].ID != id {
		t.Fatalf("the backend after a create through the standby: %v, %v; want the one volume %s", made, err, id)
	}
	if _, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1@zone-a",
		VolumeCapability: blockCap(accessmode.SingleNodeWriter)}); err != nil {
		t.Fatalf("publish through the standby: %v", err)
	}
	_, err = cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2@zone-a",
		VolumeCapability: blockCap(accessmode.SingleNodeWriter)})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "node-1") {
		t.Errorf("publish to a second node through the standby: %v, want the acting controller's FAILED_PRECONDITION naming node-1", err)
	}
	if _, err := cc.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{}); err != nil {
		t.Errorf("ControllerGetCapabilities of the standby: %v", err)
	}
	families := gathered(t, m)
	if n, _ := sample(t, families, "modeguard_controller_forwarded_total", map[string]string{"method": "CreateVolume", "code": "OK"}); n != 1 {
		t.Errorf("forwarded CreateVolume calls answered OK = %v, want 1", n)
	}
	if n, _ := sample(t, families, "modeguard_controller_forwarded_total", map[string]string{"method": "ControllerPublishVolume", "code": "FailedPrecondition"}); n != 1 {
		t.Errorf("forwarded publishes answered FAILED_PRECONDITION = %v, want 1", n)
	}
	if n, _ := sample(t, families, "modeguard_controller_active", map[string]string{}); n != 0 {
		t.Errorf("modeguard_controller_active of the standby = %v, want 0", n)
	}

	// The acting one stops acting; it refuses what is forwarded to it
	// (and would forward nothing on: it has no peers).
	acting.EndTerm("lost the lease of storage target t1")
	acting.SetPeers(at(t, ca.Peer(peer.ServerName), addr)) // itself: a loop, if it forwarded again
	_, err = create("nobody-acts")
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "forwarded to a controller that is not acting") {
		t.Errorf("a call forwarded to a controller that stopped acting: %v, want UNAVAILABLE saying so", err)
	}
	if made, _ := ctrl.ListVolumes(ctx); len(made) != 1 {
		t.Errorf("%d volumes after a create no one served, want 1", len(made))
	}
}

// TestPeerListenerRefusesStrangers: the peer listener takes only
// certificates of the controllers' CA that name the peer service, and
// serves only the controller-side services.
func TestPeerListenerRefusesStrangers(t *testing.T) {
	ca := certs.NewCA(t, "controllers")
	ctrl, _, addr := actingController(t, ca)
	call := func(files certs.Files, serverName string) error {
		cfg, err := remote.TLSFiles(files).ClientConfig(serverName)
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_, err = csi.NewControllerClient(conn).ListVolumes(context.Background(), &csi.ListVolumesRequest{})
		return err
	}
	if err := call(ca.Peer(peer.ServerName), peer.ServerName); err != nil {
		t.Fatalf("a peer's call: %v", err)
	}
	stranger := certs.NewCA(t, "strangers").Peer(peer.ServerName)
	for _, c := range []struct {
		what  string
		files certs.Files
	}{
		{"a certificate of another CA", certs.Files{Cert: stranger.Cert, Key: stranger.Key, CA: ca.File}},
		{"a storage target's certificate of the same CA", ca.Peer("modeguard-target-zone-a")},
	} {
		if err := call(c.files, peer.ServerName); status.Code(err) != codes.Unavailable {
			t.Errorf("%s: %v, want the connection refused (UNAVAILABLE)", c.what, err)
		}
	}
	// The client checks the name too: a listener whose certificate is not
	// a controller's is not one to forward to.
	impostor := electedDriver(t, ctrl, nil)
	if err := impostor.StartTerm(context.Background()); err != nil {
		t.Fatal(err)
	}
	impostorAddr := servePeers(t, impostor, ca.Peer("modeguard-target-zone-a"))
	standby := electedDriver(t, ctrl, nil)
	standby.StandBy("another controller acts", true)
	standby.SetPeers(at(t, ca.Peer(peer.ServerName), impostorAddr))
	_, err := csi.NewControllerClient(serveDriver(t, standby)).ListVolumes(context.Background(), &csi.ListVolumesRequest{})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("forwarding to a listener with a certificate that is not a controller's: %v, want UNAVAILABLE", err)
	}
}

// forwardingStandby serves acting on loopback as an acting controller's
// peer listener would, and answers a connection to a standby controller
// that reads no lease and lists an idle peer, then acting: each call is
// refused by the first and forwarded to the second.
func forwardingStandby(t *testing.T, acting *driver.Driver) *grpc.ClientConn {
	t.Helper()
	ca := certs.NewCA(t, "controllers")
	files := ca.Peer(peer.ServerName)
	creds, err := peer.ServerCredentials(remote.TLSFiles(files))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := acting.NewGRPCServer(grpc.Creds(creds))
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	backendOf := func() backend.Controller {
		c, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-a", SizeBytes: 1 << 30}}})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	idle := electedDriver(t, backendOf(), nil)
	idle.StandBy("another controller acts", true)
	standby := electedDriver(t, backendOf(), nil)
	standby.StandBy("no storage target's lease can be read", false)
	dialer := peer.NewDialer(remote.TLSFiles(files), peer.DialerConfig{Peers: []string{servePeers(t, idle, files), lis.Addr().String()}})
	t.Cleanup(dialer.Close)
	standby.SetPeers(dialer)
	return serveDriver(t, standby)
}

// TestStandbyTriesTheListedPeers: a standby that reads no lease forwards
// each call to the listed peers in turn. One that does not act refuses it
// having done nothing, and the next is tried; the acting one's answer,
// whatever it is, is the call's: a failure there is never tried again
// elsewhere. A controller arbitrated by lock files (not elected) forwards
// too while it waits for them.
func TestStandbyTriesTheListedPeers(t *testing.T) {
	ca := certs.NewCA(t, "controllers")
	files := ca.Peer(peer.ServerName)
	ctrl, _, actingAddr := actingController(t, ca)
	idle := electedDriver(t, ctrl, nil)
	idle.StandBy("another controller acts", true)
	idleAddr := servePeers(t, idle, files)
	ctx := context.Background()
	create := func(cc csi.ControllerClient, name string) error {
		_, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)}})
		return err
	}
	listed := func(t *testing.T, d *driver.Driver, peers ...string) csi.ControllerClient {
		dialer := peer.NewDialer(remote.TLSFiles(files), peer.DialerConfig{Peers: peers, Self: "127.0.0.1:1"})
		t.Cleanup(dialer.Close)
		d.SetPeers(dialer)
		return csi.NewControllerClient(serveDriver(t, d))
	}
	names := func() []string {
		vols, err := ctrl.ListVolumes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, v := range vols {
			out = append(out, v.Name)
		}
		return out
	}

	t.Run("the idle peer first, then the acting one", func(t *testing.T) {
		standby := electedDriver(t, ctrl, nil)
		standby.StandBy("no storage target's lease can be read", false)
		if err := create(listed(t, standby, idleAddr, actingAddr), "through-the-second-peer"); err != nil {
			t.Fatalf("CreateVolume through a standby listing an idle and the acting peer: %v", err)
		}
		if got := names(); !slices.Equal(got, []string{"through-the-second-peer"}) {
			t.Fatalf("volumes %v, want the one created through the acting peer", got)
		}
	})
	t.Run("a listed address where no controller runs", func(t *testing.T) {
		standby := electedDriver(t, ctrl, nil)
		standby.StandBy("no storage target's lease can be read", false)
		gone, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		gone.Close()
		if err := create(listed(t, standby, gone.Addr().String(), actingAddr), "past-a-gone-peer"); err != nil {
			t.Fatalf("CreateVolume through a standby listing a gone peer, then the acting one: %v", err)
		}
		if got := names(); !slices.Contains(got, "past-a-gone-peer") {
			t.Fatalf("volumes %v, want the one created past the gone peer", got)
		}
	})
	t.Run("only idle peers", func(t *testing.T) {
		standby := electedDriver(t, ctrl, nil)
		standby.StandBy("no storage target's lease can be read", false)
		err := create(listed(t, standby, idleAddr, idleAddr), "nobody-acts")
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no other controller acts") {
			t.Fatalf("CreateVolume with no acting peer: %v, want UNAVAILABLE saying none acts", err)
		}
	})
	t.Run("the acting peer's failure is the answer", func(t *testing.T) {
		standby := electedDriver(t, ctrl, nil)
		standby.StandBy("no storage target's lease can be read", false)
		// A second acting controller on a backend of its own, listed after
		// the first: it must never see the call.
		other, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-a", SizeBytes: 1 << 30}}})
		if err != nil {
			t.Fatal(err)
		}
		second := electedDriver(t, other, nil)
		if err := second.StartTerm(ctx); err != nil {
			t.Fatal(err)
		}
		ctrl.Faults.FailNext("CreateVolume", status.Error(codes.Unavailable, "the pool is busy"))
		err = create(listed(t, standby, actingAddr, servePeers(t, second, files)), "failed-at-the-acting-peer")
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "the pool is busy") {
			t.Fatalf("CreateVolume failing at the acting peer: %v, want its UNAVAILABLE", err)
		}
		if vols, _ := other.ListVolumes(ctx); len(vols) != 0 {
			t.Fatalf("the call was tried again on the next peer: it holds %d volumes", len(vols))
		}
	})
	t.Run("a controller waiting for its lock files", func(t *testing.T) {
		waiting, err := driver.New(driver.Config{Version: "test", Roles: []driver.Role{driver.RoleController}, ControllersLater: true})
		if err != nil {
			t.Fatal(err)
		}
		waiting.WaitingFor("another controller holds the pool's lock")
		if err := create(listed(t, waiting, actingAddr), "while-waiting-for-the-lock"); err != nil {
			t.Fatalf("CreateVolume through a controller waiting for its lock files: %v", err)
		}
		if got := names(); !slices.Contains(got, "while-waiting-for-the-lock") {
			t.Fatalf("volumes %v, want the one created while the other waited", got)
		}
	})
}

package driver_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/driver"
)

// TestControllerActsOnlyDuringATerm: an elected controller serves the calls
// that act only between StartTerm and EndTerm; ending a term cancels the
// calls it runs and returns once they have, so that the leases are given
// back only when nothing of this controller still acts. A standby answers
// its capabilities, and Probe ready once it knows another controller acts.
func TestControllerActsOnlyDuringATerm(t *testing.T) {
	if _, err := driver.New(driver.Config{Version: "test", Roles: []driver.Role{driver.RoleController}, Elected: true}); err == nil {
		t.Error("an elected controller with its backends given at once was accepted; its backends come with the election")
	}
	d, err := driver.New(driver.Config{Version: "test", Roles: []driver.Role{driver.RoleController}, ControllersLater: true, Elected: true})
	if err != nil {
		t.Fatal(err)
	}
	conn := serveDriver(t, d)
	cc := csi.NewControllerClient(conn)
	ic := csi.NewIdentityClient(conn)
	ctx := context.Background()
	ready := func() bool {
		t.Helper()
		resp, err := ic.Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetReady().GetValue()
	}
	create := func(name string) error {
		_, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)}})
		return err
	}
	wantStandby := func(what, why string) {
		t.Helper()
		err := create("standby")
		if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), why) {
			t.Errorf("%s: CreateVolume = %v, want UNAVAILABLE saying %q", what, err, why)
		}
		if _, err := cc.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{}); err != nil {
			t.Errorf("%s: ControllerGetCapabilities = %v; it is answered in every state", what, err)
		}
	}

	if err := d.StartTerm(ctx); err == nil {
		t.Fatal("a term started before the controller had its backends")
	}
	wantStandby("before the backends", "")
	ctrl, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-a", SizeBytes: 1 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetControllers(map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: ctrl}); err != nil {
		t.Fatal(err)
	}
	wantStandby("with backends, before the election decided", "")
	if ready() {
		t.Error("Probe ready before the election decided anything")
	}
	d.StandBy("another controller holds storage target t1", false)
	wantStandby("standby", "another controller holds storage target t1")
	if ready() {
		t.Error("Probe ready while the standby does not know whether another acts")
	}
	d.StandBy("another controller holds storage target t1", true)
	if !ready() {
		t.Error("Probe not ready in a standby that knows another controller acts: its liveness probe would restart it")
	}

	if err := d.StartTerm(ctx); err != nil {
		t.Fatal(err)
	}
	if err := create("in-the-term"); err != nil {
		t.Fatalf("CreateVolume during a term: %v", err)
	}

	// A call running when the term ends is cancelled, answers UNAVAILABLE,
	// and EndTerm returns only after it has.
	entered := make(chan struct{})
	var returned time.Time
	ctrl.Hook("CreateVolume", func(ctx context.Context) error {
		close(entered)
		<-ctx.Done()
		time.Sleep(200 * time.Millisecond) // a backend slow to notice
		returned = time.Now()
		return ctx.Err()
	})
	callErr := make(chan error, 1)
	go func() { callErr <- create("cut-short") }()
	<-entered
	if !d.EndTerm("lost the lease of storage target t1") {
		t.Fatal("EndTerm: the call did not return in time")
	}
	ended := time.Now()
	if returned.IsZero() || returned.After(ended) {
		t.Errorf("EndTerm returned at %v, before the term's call did (%v)", ended, returned)
	}
	err = <-callErr
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "lost the lease of storage target t1") {
		t.Errorf("the call cut short by the term's end = %v, want UNAVAILABLE saying why", err)
	}
	ctrl.Hook("CreateVolume", nil)
	wantStandby("after the term", "lost the lease of storage target t1")
	if !d.EndTerm("again") {
		t.Error("EndTerm without a term")
	}

	if err := d.StartTerm(ctx); err != nil {
		t.Fatal(err)
	}
	if err := create("next-term"); err != nil {
		t.Fatalf("CreateVolume in the next term: %v", err)
	}
	d.EndTerm("the test ends")
}

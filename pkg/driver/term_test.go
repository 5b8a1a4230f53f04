package driver_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/metrics"
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

// TestStandbyReportsNoBackendState: the volumes, pools and fences are
// reported by the acting controller alone. A standby's scrape asks its
// backends nothing (they would refuse every call: it holds no lease) and
// fails nothing; during a term the state is there, and it goes again when
// the term ends.
func TestStandbyReportsNoBackendState(t *testing.T) {
	m := metrics.New("test", []string{"controller"})
	d, err := driver.New(driver.Config{Version: "test", Roles: []driver.Role{driver.RoleController}, ControllersLater: true,
		Elected: true, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	ctrl, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-a", SizeBytes: 1 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	var asked atomic.Int32
	ctrl.Hook("ListVolumes", func(context.Context) error {
		asked.Add(1)
		return nil
	})
	if err := d.SetControllers(map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: ctrl}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	scrape := func(when string) string {
		t.Helper()
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: scrape status %d: %s", when, resp.StatusCode, body)
		}
		return string(body)
	}
	standby := func(when string) {
		t.Helper()
		before := asked.Load()
		body := scrape(when)
		if strings.Contains(body, "modeguard_volumes{") || strings.Contains(body, "modeguard_pool_size_bytes{") {
			t.Errorf("%s: the standby reports the backends' state", when)
		}
		if n := asked.Load() - before; n != 0 {
			t.Errorf("%s: the standby's scrape listed the volumes %d times", when, n)
		}
		if !strings.Contains(body, "modeguard_controller_active 0") {
			t.Errorf("%s: the standby does not say it stands by", when)
		}
	}

	standby("before the election decided")
	d.StandBy("another controller holds storage target t1", true)
	standby("standby")
	if err := d.StartTerm(context.Background()); err != nil {
		t.Fatal(err)
	}
	body := scrape("during a term")
	if !strings.Contains(body, `modeguard_pool_size_bytes{backend="block",zone="zone-a"}`) || !strings.Contains(body, "modeguard_volumes{") ||
		!strings.Contains(body, "modeguard_controller_active 1") || asked.Load() == 0 {
		t.Errorf("the acting controller does not report its backends' state:\n%s", body)
	}
	if !d.EndTerm("lost the lease of storage target t1") {
		t.Fatal("EndTerm")
	}
	standby("after the term")
}

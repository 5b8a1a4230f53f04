package integration

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestFenceListOnTargets: with the pools behind storage targets, the
// controller keeps its network fence list on every target, not on its
// host. A controller started elsewhere, with nothing of the first's,
// takes over with the fences in force. A change stored while a target is
// down is in force and answered UNAVAILABLE; the target, once it answers
// again, is brought up to date.
func TestFenceListOnTargets(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	zones := []string{"zone-a", "zone-b"}
	pools := map[string]string{"zone-a": filepath.Join(work, "pool"), "zone-b": filepath.Join(work, "pool-zone-b")}
	targetArgs, stops := zoneTargets(t, bin, work, zones...)
	controller := func(name string) *crashProc { return runController(t, bin, work, name, targetArgs...) }
	// storedOn reads a target's record of the list: its version and blocks.
	storedOn := func(zone string) (uint64, []string) {
		t.Helper()
		var rec struct {
			Version uint64 `json:"version"`
			Fences  []struct {
				CIDR string `json:"cidr"`
			} `json:"fences"`
		}
		data, err := os.ReadFile(filepath.Join(pools[zone], ".modeguard-fences.json"))
		if err != nil {
			return 0, nil
		}
		if err := json.Unmarshal(data, &rec); err != nil {
			t.Fatalf("the fence record of %s: %v", zone, err)
		}
		var blocks []string
		for _, f := range rec.Fences {
			blocks = append(blocks, f.CIDR)
		}
		return rec.Version, blocks
	}
	ctx := context.Background()
	c := capability(accessmode.SingleNodeWriter, "")
	createIn := func(p *crashProc, name, zone string) string {
		t.Helper()
		vol, err := csi.NewControllerClient(p.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities:        []*csi.VolumeCapability{c},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{driver.TopologyZoneKey: zone}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return vol.GetVolume().GetVolumeId()
	}
	publish := func(p *crashProc, id, node string) error {
		_, err := csi.NewControllerClient(p.conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: c})
		return err
	}
	listed := func(p *crashProc) []string {
		t.Helper()
		resp, err := fence.NewFenceControllerClient(p.conn).ListClusterFence(ctx, &fence.ListClusterFenceRequest{})
		if err != nil {
			t.Fatalf("ListClusterFence: %v", err)
		}
		var out []string
		for _, c := range resp.GetCidrs() {
			out = append(out, c.GetCidr())
		}
		return out
	}
	block := []*fence.CIDR{{Cidr: "10.90.0.0/24"}}

	first := controller("first")
	fenced := createIn(first, "fenced", "zone-a")
	if _, err := fence.NewFenceControllerClient(first.conn).FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: block}); err != nil {
		t.Fatalf("FenceClusterNetwork: %v", err)
	}
	for _, zone := range zones {
		if v, blocks := storedOn(zone); v == 0 || !slices.Equal(blocks, []string{"10.90.0.0/24"}) {
			t.Errorf("the target of %s holds the list at version %d: %v; want the fence", zone, v, blocks)
		}
	}
	if err := publish(first, fenced, "node-1@zone-a@10.90.0.5"); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("publish to a fenced node: %v, want FAILED_PRECONDITION", err)
	}

	// The first dies; the second, which has nothing of it, takes over
	// with the fence in force.
	_ = first.cmd.Process.Signal(syscall.SIGKILL)
	<-first.done
	second := controller("second")
	// Ready as a standby at once; acting once the first's leases ran out.
	untilActing(t, second)
	if got := listed(second); !slices.Equal(got, []string{"10.90.0.0/24"}) {
		t.Errorf("the controller that took over lists the fences %v, want the first's", got)
	}
	if err := publish(second, fenced, "node-2@zone-a@10.90.0.6"); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "10.90.0.0/24") {
		t.Errorf("publish to a fenced node through the controller that took over: %v, want FAILED_PRECONDITION naming the fence", err)
	}

	// zone-b's target goes away: the lift is in force, and not
	// acknowledged.
	stops["zone-b"]()
	_, err := fence.NewFenceControllerClient(second.conn).UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: block})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("UnfenceClusterNetwork with a target down: %v, want UNAVAILABLE", err)
	}
	if got := listed(second); len(got) != 0 {
		t.Errorf("after the lift with a target down the list is %v, want it lifted (in force where it was stored)", got)
	}
	liftedAt, _ := storedOn("zone-a")
	if v, blocks := storedOn("zone-b"); v >= liftedAt || len(blocks) != 1 {
		t.Fatalf("zone-b's target, down, holds version %d %v; want the one before the lift (zone-a holds %d)", v, blocks, liftedAt)
	}
	// Back, it is brought up to date.
	stops["zone-b"] = startZoneTarget(t, bin, work, "zone-b", filepath.Join(work, "zone-b.sock"))
	for deadline := time.Now().Add(45 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		v, blocks := storedOn("zone-b")
		if v == liftedAt && len(blocks) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("zone-b's target, back, holds version %d %v; want %d with nothing fenced", v, blocks, liftedAt)
		}
	}
	if err := publish(second, fenced, "node-2@zone-a@10.90.0.6"); err != nil {
		t.Errorf("publish to the node the lifted fence covered: %v", err)
	}
}

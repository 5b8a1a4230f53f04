package integration

import (
	"context"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestFrozenControllerChangesNothing: two controllers over the storage
// targets of two zones. The acting one is frozen (SIGSTOP: a stalled
// process, a paused VM), which no lock file or lost connection reveals.
// The standby acts only once the frozen one's terms have run out, with
// the attachments the frozen one made. Thawed, the former acting
// controller finds its term over: it sends nothing to the targets, changes
// nothing, and steps down.
func TestFrozenControllerChangesNothing(t *testing.T) {
	// Its own processes and directories; it mostly waits for leases.
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	targetArgs, _ := zoneTargets(t, bin, work, "zone-a", "zone-b")
	controller := func(name string) *crashProc { return runController(t, bin, work, name, targetArgs...) }
	ctx := context.Background()
	c := capability(accessmode.SingleNodeWriter, "")
	inZone := func(zone string) *csi.TopologyRequirement {
		return &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{driver.TopologyZoneKey: zone}}}}
	}

	// A node stays in its zone: each zone has nodes of its own.
	nodeIn := func(name, zone string) string { return name + "-" + zone + "@" + zone }

	first := controller("first")
	cc1 := csi.NewControllerClient(first.conn)
	var ids []string
	for _, zone := range []string{"zone-a", "zone-b"} {
		vol, err := cc1.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "frozen-" + zone, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{c}, AccessibilityRequirements: inZone(zone)})
		if err != nil {
			t.Fatal(err)
		}
		id := vol.GetVolume().GetVolumeId()
		if _, err := cc1.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeIn("node-1", zone), VolumeCapability: c}); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}

	// The second is a standby: ready, and refusing what acts.
	second := controller("second")
	cc2 := csi.NewControllerClient(second.conn)
	publish2 := func(i int, node string) error {
		zone := []string{"zone-a", "zone-b"}[i]
		_, err := cc2.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: ids[i], NodeId: nodeIn(node, zone), VolumeCapability: c})
		return err
	}
	if err := publish2(0, "node-2"); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "another controller holds storage target") {
		t.Fatalf("publish through the standby: %v, want UNAVAILABLE saying another controller holds a target", err)
	}

	if err := first.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	var err error
	for {
		err = publish2(0, "node-2")
		if status.Code(err) != codes.Unavailable {
			break
		}
		if time.Since(frozen) > 2*time.Minute {
			t.Fatalf("the standby did not act %v after the acting controller froze: %v", time.Since(frozen), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	acted := time.Since(frozen)
	t.Logf("the standby acted %v after the acting controller froze", acted.Round(100*time.Millisecond))
	// It could act only once the frozen one's terms ran out on the
	// targets: their last renewal was at most 5 s before the freeze.
	if acted < remote.LeaseTerm-5*time.Second {
		t.Errorf("the standby acted %v after the freeze, while the frozen controller's term could still run", acted)
	}
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish to a second node through the controller that took over: %v, want FAILED_PRECONDITION (the frozen one attached node-1)", err)
	}
	for i, zone := range []string{"zone-a", "zone-b"} {
		if _, err := cc2.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: ids[i], NodeId: nodeIn("node-1", zone)}); err != nil {
			t.Fatal(err)
		}
		if err := publish2(i, "node-2"); err != nil {
			t.Fatal(err)
		}
	}

	// Thawed, the former acting controller is refused, and changes
	// nothing: the volumes stay on node-2.
	if err := first.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	for i, zone := range []string{"zone-a", "zone-b"} {
		_, err := cc1.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: ids[i], NodeId: nodeIn("node-2", zone)})
		if status.Code(err) != codes.Unavailable {
			t.Errorf("unpublish through the thawed former controller: %v, want UNAVAILABLE", err)
		}
	}
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(testenv.ReadFile(first.log), "Stepping down as the acting controller"); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the thawed controller did not step down")
		}
	}
	list, err := cc2.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list.GetEntries() {
		i := slices.Index(ids, e.GetVolume().GetVolumeId())
		if i < 0 {
			continue
		}
		zone := []string{"zone-a", "zone-b"}[i]
		if got := e.GetStatus().GetPublishedNodeIds(); !slices.Equal(got, []string{nodeIn("node-2", zone)}) {
			t.Errorf("volume %s is published to %v after the thaw, want only %s", ids[i], got, nodeIn("node-2", zone))
		}
	}
	if err := publish2(1, "node-3"); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("publish to a third node through the acting controller after the thaw: %v, want FAILED_PRECONDITION", err)
	}
}

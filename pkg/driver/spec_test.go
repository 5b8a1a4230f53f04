package driver_test

import (
	"os"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/backend/zoned"
	"github.com/modeguard/modeguard/pkg/driver"
)

// TestUnstageAtAnotherPath: the spec keeps NOT_FOUND for a volume that does
// not exist; an unstage at a path the volume is not staged at is done
// already (OK), leaves the real stage alone, and never takes a workload's
// mount for a stage.
func TestUnstageAtAnotherPath(t *testing.T) {
	e := newMemoryEnv(t, 0)
	c := mountCap(accessmode.SingleNodeWriter)
	volID, staging, pc := e.setup(t, "unstage-elsewhere", c)
	target := e.targetPath("unstage-elsewhere")
	if err := e.publish(t, volID, staging, target, c, pc, false); err != nil {
		t.Fatal(err)
	}
	other := e.stagingPath("never-staged-here")
	if err := os.MkdirAll(other, 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: other}); err != nil {
		t.Errorf("NodeUnstageVolume at a path the volume is not staged at: %v, want OK", err)
	}
	if e.mountsAt(t, staging) != 1 || e.mountsAt(t, target) != 1 {
		t.Errorf("the unstage elsewhere touched the stage (%d mounts) or the publish (%d)", e.mountsAt(t, staging), e.mountsAt(t, target))
	}
	_, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: target})
	wantCode(t, "NodeUnstageVolume at the workload's target path", err, codes.FailedPrecondition)
	if e.mountsAt(t, target) != 1 {
		t.Errorf("an unstage at the target path unmounted the workload's volume")
	}
}

// TestExpandGrowsOnlyToWhatIsAsked: a capacity range that requires nothing,
// or only sets a limit, leaves the volume as it is; a required size grows
// it to that size (rounded to MiB), never to the default size of new
// volumes; a limit below the volume's size is OUT_OF_RANGE (no shrinking).
func TestExpandGrowsOnlyToWhatIsAsked(t *testing.T) {
	e := newMemoryEnv(t, 0)
	volID := e.createVolume(t, "expand-asked", blockCap(accessmode.SingleNodeWriter))
	expand := func(r *csi.CapacityRange) (int64, error) {
		resp, err := e.ctrl.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{VolumeId: volID, CapacityRange: r})
		return resp.GetCapacityBytes(), err
	}
	for _, tt := range []struct {
		name string
		r    *csi.CapacityRange
		want int64
		code codes.Code
	}{
		{"empty range", &csi.CapacityRange{}, volumeSize, codes.OK},
		{"only a limit above", &csi.CapacityRange{LimitBytes: 4 * volumeSize}, volumeSize, codes.OK},
		{"only a limit below", &csi.CapacityRange{LimitBytes: volumeSize / 2}, 0, codes.OutOfRange},
		{"negative limit", &csi.CapacityRange{LimitBytes: -1}, 0, codes.InvalidArgument},
		{"required below the size", &csi.CapacityRange{RequiredBytes: volumeSize / 2}, volumeSize, codes.OK},
		{"required above", &csi.CapacityRange{RequiredBytes: 2*volumeSize + 1}, 2*volumeSize + mib, codes.OK},
	} {
		got, err := expand(tt.r)
		wantCode(t, tt.name, err, tt.code)
		if tt.code == codes.OK && got != tt.want {
			t.Errorf("%s: capacity %d, want %d", tt.name, got, tt.want)
		}
	}
	// And the image really has the size reported, nothing more.
	if got, err := expand(&csi.CapacityRange{}); err != nil || got != 2*volumeSize+mib {
		t.Errorf("capacity after the expansions: %d, %v; want %d", got, err, 2*volumeSize+mib)
	}
}

// TestRestoreKeepsTheSourceKind: a snapshot records its source's kind, and
// CreateVolume from it refuses another one (INVALID_ARGUMENT) rather than
// handing a raw device's bytes out as a filesystem.
func TestRestoreKeepsTheSourceKind(t *testing.T) {
	e := newMemoryEnv(t, 0)
	rawVol := e.createVolume(t, "raw-source", blockCap(accessmode.SingleNodeWriter))
	from := e.snapshotSource(t, "raw-snap", rawVol)
	_, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "raw-as-fs",
		CapacityRange:       &csi.CapacityRange{RequiredBytes: volumeSize},
		VolumeCapabilities:  []*csi.VolumeCapability{mountCap(accessmode.SingleNodeWriter)},
		VolumeContentSource: from})
	wantCode(t, "a filesystem volume from a raw block snapshot", err, codes.InvalidArgument)
	ok, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "raw-as-raw",
		CapacityRange:       &csi.CapacityRange{RequiredBytes: volumeSize},
		VolumeCapabilities:  []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)},
		VolumeContentSource: from})
	if err != nil {
		t.Fatalf("a raw block volume from a raw block snapshot: %v", err)
	}
	t.Cleanup(func() { e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: ok.GetVolume().GetVolumeId()}) })
}

// TestTopologyNamingOnlyANode: a requisite topology that names a node but
// not its zone places the volume in the zone the controller knows that
// node in, and nowhere when it knows the node not at all.
func TestTopologyNamingOnlyANode(t *testing.T) {
	e := newMemoryEnv(t, 0)
	c := mountCap(accessmode.SingleNodeWriter)
	onlyNode := &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{driver.TopologyNodeKey: testNode}}}}
	create := func(name string) (*csi.CreateVolumeResponse, error) {
		return e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: name,
			CapacityRange:             &csi.CapacityRange{RequiredBytes: volumeSize},
			VolumeCapabilities:        []*csi.VolumeCapability{c},
			AccessibilityRequirements: onlyNode})
	}
	_, err := create("for-an-unknown-node")
	wantCode(t, "a volume for a node the controller does not know", err, codes.ResourceExhausted)
	// Once the node holds a volume, the controller knows its zone.
	e.controllerPublish(t, e.createVolume(t, "makes-the-node-known", c), c)
	resp, err := create("for-a-known-node")
	if err != nil {
		t.Fatalf("a volume for a known node: %v", err)
	}
	t.Cleanup(func() {
		e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId()})
	})
	if top := resp.GetVolume().GetAccessibleTopology(); len(top) != 1 || top[0].GetSegments()[driver.TopologyZoneKey] != testZone {
		t.Errorf("the volume's topology is %v, want the node's zone %s", top, testZone)
	}
}

// TestRestoreGoesToTheSourcesZone: where each zone is served by a machine
// of its own (a storage target), a snapshot fills a new volume only in its
// own zone. A request that allows that zone gets the volume there, even
// when it prefers another, and its topology says so, so that the pod
// follows; a request that allows only other zones is RESOURCE_EXHAUSTED,
// naming the zone, so that the CO chooses again, never NOT_FOUND for a
// snapshot that exists.
func TestRestoreGoesToTheSourcesZone(t *testing.T) {
	e := newMemoryEnv(t, 0, func(e *env) {
		e.wrap = func(zoneA backend.Controller) backend.Controller {
			zoneB, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-b", SizeBytes: 1 << 30}}})
			if err != nil {
				t.Fatal(err)
			}
			joined, err := zoned.New(zoneA, zoneB)
			if err != nil {
				t.Fatal(err)
			}
			return joined
		}
	})
	c := mountCap(accessmode.SingleNodeWriter)
	inZones := func(zones ...string) []*csi.Topology {
		var top []*csi.Topology
		for _, z := range zones {
			top = append(top, &csi.Topology{Segments: map[string]string{driver.TopologyZoneKey: z}})
		}
		return top
	}
	create := func(name string, req *csi.TopologyRequirement, from *csi.VolumeContentSource) (*csi.CreateVolumeResponse, error) {
		resp, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: name,
			CapacityRange:             &csi.CapacityRange{RequiredBytes: volumeSize},
			VolumeCapabilities:        []*csi.VolumeCapability{c},
			AccessibilityRequirements: req, VolumeContentSource: from})
		if err == nil {
			id := resp.GetVolume().GetVolumeId()
			t.Cleanup(func() { e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id}) })
		}
		return resp, err
	}
	source, err := create("source-in-b", &csi.TopologyRequirement{Requisite: inZones("zone-b")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	from := e.snapshotSource(t, "snap-in-b", source.GetVolume().GetVolumeId())

	_, err = create("restored-in-a", &csi.TopologyRequirement{Requisite: inZones("zone-a"), Preferred: inZones("zone-a")}, from)
	wantCode(t, "a restore allowed only in another zone than its snapshot's", err, codes.ResourceExhausted)
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "zone zone-b") || !strings.Contains(msg, "zones zone-a") {
		t.Errorf("the refusal does not name the snapshot's zone and the allowed one: %q", msg)
	}

	resp, err := create("restored-anywhere", &csi.TopologyRequirement{Requisite: inZones("zone-a", "zone-b"), Preferred: inZones("zone-a")}, from)
	if err != nil {
		t.Fatalf("a restore allowed in the snapshot's zone too: %v", err)
	}
	if top := resp.GetVolume().GetAccessibleTopology(); len(top) != 1 || top[0].GetSegments()[driver.TopologyZoneKey] != "zone-b" {
		t.Errorf("the restored volume's topology is %v, want the snapshot's zone zone-b", top)
	}

	// Without topology, the same: any zone is allowed, the snapshot's is chosen.
	resp, err = create("restored-no-topology", nil, from)
	if err != nil {
		t.Fatalf("a restore without topology: %v", err)
	}
	if top := resp.GetVolume().GetAccessibleTopology(); len(top) != 1 || top[0].GetSegments()[driver.TopologyZoneKey] != "zone-b" {
		t.Errorf("the restored volume's topology is %v, want the snapshot's zone zone-b", top)
	}
}

// snapshotSource cuts a snapshot of volID, deleted when the test ends, and
// returns it as a content source.
func (e *env) snapshotSource(t *testing.T, name, volID string) *csi.VolumeContentSource {
	t.Helper()
	snap, err := e.ctrl.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: volID})
	if err != nil {
		t.Fatalf("CreateSnapshot %s: %v", name, err)
	}
	id := snap.GetSnapshot().GetSnapshotId()
	t.Cleanup(func() { e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: id}) })
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

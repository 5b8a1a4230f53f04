package driver_test

import (
	"bytes"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
)

// writeAt puts a 4 KiB record at the start of path (a device or an image)
// and makes it durable: an acknowledged write.
func writeAt(t *testing.T, path string, record string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	copy(buf, record)
	if _, err := f.WriteAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// recordAt reads the record writeAt put at the start of path.
func recordAt(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64)
	if _, err := f.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	return string(bytes.TrimRight(buf, "\x00"))
}

// TestGroupSnapshotIsOnePointInTime: a group snapshot of three block
// volumes, one of them attached read/write and written before and after:
// every member holds what its volume held at the group's moment and
// nothing written later; each member is reported with its group and is
// deleted with it, not alone. A second name for other volumes, two
// writers, a stranger among the snapshot ids are refused; a retry answers
// the same group.
func TestGroupSnapshotIsOnePointInTime(t *testing.T) {
	e := newEnv(t, 0, onReflinkPool(t)) // a volume being written is snapshotted by reflink
	gc := csi.NewGroupControllerClient(e.conn)
	c := blockCap(accessmode.SingleNodeWriter)
	a, b, third := e.createVolume(t, "grp-a", c), e.createVolume(t, "grp-b", c), e.createVolume(t, "grp-c", c)

	pc := e.controllerPublish(t, a, c)
	e.stage(t, a, "grp-a", c, pc)
	devs, err := loop.DevicesOf(e.imageOfVolume(t, a))
	if err != nil || len(devs) != 1 {
		t.Fatalf("devices of %s: %v, %v", a, devs, err)
	}
	writeAt(t, devs[0], "a before")
	writeAt(t, e.imageOfVolume(t, b), "b before")
	writeAt(t, e.imageOfVolume(t, third), "c before")

	create := func(name string, sources ...string) (*csi.VolumeGroupSnapshot, error) {
		resp, err := gc.CreateVolumeGroupSnapshot(ctx(t), &csi.CreateVolumeGroupSnapshotRequest{Name: name, SourceVolumeIds: sources})
		return resp.GetGroupSnapshot(), err
	}
	group, err := create("nightly", a, b, third)
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot with one volume being written: %v", err)
	}
	t.Cleanup(func() {
		_, _ = gc.DeleteVolumeGroupSnapshot(ctx(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: group.GetGroupSnapshotId()})
	})
	writeAt(t, devs[0], "a after")
	if !group.GetReadyToUse() || len(group.GetSnapshots()) != 3 {
		t.Fatalf("group: ready %v, %d members; want ready, 3", group.GetReadyToUse(), len(group.GetSnapshots()))
	}
	want := map[string]string{a: "a before", b: "b before", third: "c before"}
	var memberIDs []string
	for _, m := range group.GetSnapshots() {
		if m.GetGroupSnapshotId() != group.GetGroupSnapshotId() {
			t.Errorf("member %s names group %q, want %s", m.GetSnapshotId(), m.GetGroupSnapshotId(), group.GetGroupSnapshotId())
		}
		memberIDs = append(memberIDs, m.GetSnapshotId())
		restored, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
			Name: "restore-" + m.GetSnapshotId(), CapacityRange: &csi.CapacityRange{RequiredBytes: volumeSize},
			VolumeCapabilities: []*csi.VolumeCapability{c},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: m.GetSnapshotId()}}},
		})
		if err != nil {
			t.Fatalf("restoring %s: %v", m.GetSnapshotId(), err)
		}
		rid := restored.GetVolume().GetVolumeId()
		t.Cleanup(func() { _, _ = e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: rid}) })
		if got := recordAt(t, e.imageOfVolume(t, rid)); got != want[m.GetSourceVolumeId()] {
			t.Errorf("the member of %s holds %q, want %q (the volume at the group's moment)", m.GetSourceVolumeId(), got, want[m.GetSourceVolumeId()])
		}
	}

	again, err := create("nightly", third, a, b)
	if err != nil || again.GetGroupSnapshotId() != group.GetGroupSnapshotId() || len(again.GetSnapshots()) != 3 {
		t.Fatalf("the same request again: %v, %v; want group %s", again, err, group.GetGroupSnapshotId())
	}
	for _, m := range again.GetSnapshots() {
		if !slices.Contains(memberIDs, m.GetSnapshotId()) {
			t.Errorf("a retry made a new member %s", m.GetSnapshotId())
		}
	}
	if _, err := create("nightly", a, b); status.Code(err) != codes.AlreadyExists {
		t.Errorf("the same name for other volumes: %v, want AlreadyExists", err)
	}

	// A second writer: the pair cannot be taken at one point in time.
	e.controllerPublish(t, b, c)
	before := len(e.listSnapshots(t))
	_, err = create("two-writers", a, b)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), a) || !strings.Contains(err.Error(), b) {
		t.Errorf("a group of two volumes attached read/write: %v, want FailedPrecondition naming both", err)
	}
	if after := len(e.listSnapshots(t)); after != before {
		t.Errorf("a refused group left %d snapshots behind", after-before)
	}

	got, err := gc.GetVolumeGroupSnapshot(ctx(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: group.GetGroupSnapshotId(), SnapshotIds: memberIDs})
	if err != nil || len(got.GetGroupSnapshot().GetSnapshots()) != 3 {
		t.Fatalf("GetVolumeGroupSnapshot: %v, %v", got, err)
	}
	lone, err := e.ctrl.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "lone", SourceVolumeId: third})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: lone.GetSnapshot().GetSnapshotId()})
	})
	if _, err := gc.GetVolumeGroupSnapshot(ctx(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: group.GetGroupSnapshotId(),
		SnapshotIds: append(slices.Clone(memberIDs), lone.GetSnapshot().GetSnapshotId())}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("GetVolumeGroupSnapshot naming a snapshot of no group: %v, want InvalidArgument", err)
	}
	if _, err := e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: memberIDs[0]}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("DeleteSnapshot of a group's member: %v, want InvalidArgument", err)
	}
	for _, s := range e.listSnapshots(t) {
		if slices.Contains(memberIDs, s.GetSnapshotId()) && s.GetGroupSnapshotId() != group.GetGroupSnapshotId() {
			t.Errorf("ListSnapshots reports member %s without its group", s.GetSnapshotId())
		}
	}

	for range 2 { // deleting twice is fine
		if _, err := gc.DeleteVolumeGroupSnapshot(ctx(t), &csi.DeleteVolumeGroupSnapshotRequest{
			GroupSnapshotId: group.GetGroupSnapshotId(), SnapshotIds: memberIDs}); err != nil {
			t.Fatalf("DeleteVolumeGroupSnapshot: %v", err)
		}
	}
	for _, s := range e.listSnapshots(t) {
		if slices.Contains(memberIDs, s.GetSnapshotId()) {
			t.Errorf("member %s outlived its group", s.GetSnapshotId())
		}
	}
	if _, err := gc.GetVolumeGroupSnapshot(ctx(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: group.GetGroupSnapshotId()}); status.Code(err) != codes.NotFound {
		t.Errorf("GetVolumeGroupSnapshot after delete: %v, want NotFound", err)
	}
}

// listSnapshots is every snapshot ListSnapshots reports.
func (e *env) listSnapshots(t *testing.T) []*csi.Snapshot {
	t.Helper()
	resp, err := e.ctrl.ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var out []*csi.Snapshot
	for _, entry := range resp.GetEntries() {
		out = append(out, entry.GetSnapshot())
	}
	return out
}

// TestGroupSnapshotParameters: a group asked with the deletionPolicy
// parameter Kubernetes' e2e framework copies from its
// VolumeGroupSnapshotClass (Delete or Retain) is made as without it; a
// value that is no policy, and any other key outside csi.storage.k8s.io/,
// is refused before anything is taken.
func TestGroupSnapshotParameters(t *testing.T) {
	e := newEnv(t, 0)
	gc := csi.NewGroupControllerClient(e.conn)
	c := blockCap(accessmode.SingleNodeWriter)
	a, b := e.createVolume(t, "par-a", c), e.createVolume(t, "par-b", c)
	for _, policy := range []string{"Delete", "Retain"} {
		resp, err := gc.CreateVolumeGroupSnapshot(ctx(t), &csi.CreateVolumeGroupSnapshotRequest{
			Name: "policy-" + policy, SourceVolumeIds: []string{a, b},
			Parameters: map[string]string{"deletionPolicy": policy, "csi.storage.k8s.io/volumegroupsnapshot/name": "vgs"},
		})
		if err != nil {
			t.Fatalf("a group with deletionPolicy %s: %v", policy, err)
		}
		g := resp.GetGroupSnapshot()
		if !g.GetReadyToUse() || len(g.GetSnapshots()) != 2 {
			t.Errorf("a group with deletionPolicy %s: ready %v, %d members; want ready, 2", policy, g.GetReadyToUse(), len(g.GetSnapshots()))
		}
		if _, err := gc.DeleteVolumeGroupSnapshot(ctx(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId()}); err != nil {
			t.Fatalf("DeleteVolumeGroupSnapshot: %v", err)
		}
	}
	for _, params := range []map[string]string{{"deletionPolicy": "Sometimes"}, {"retention": "7d"}} {
		_, err := gc.CreateVolumeGroupSnapshot(ctx(t), &csi.CreateVolumeGroupSnapshotRequest{
			Name: "refused", SourceVolumeIds: []string{a, b}, Parameters: params,
		})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("a group with parameters %v: %v, want InvalidArgument", params, err)
		}
	}
	if left := len(e.listSnapshots(t)); left != 0 {
		t.Errorf("%d snapshots left after the groups were deleted or refused", left)
	}
}

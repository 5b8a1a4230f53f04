package driver_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
)

// readAheadOf is the read-ahead, in KiB, of the one loop device bound to
// the volume's image.
func (e *env) readAheadOf(t *testing.T, volID string) uint64 {
	t.Helper()
	devs, err := loop.DevicesOf(e.imageOfVolume(t, volID))
	if err != nil || len(devs) != 1 {
		t.Fatalf("devices of %s: %v, %v; want one", volID, devs, err)
	}
	kib, err := loop.ReadAhead(devs[0])
	if err != nil {
		t.Fatal(err)
	}
	return kib
}

func (e *env) modify(t *testing.T, volID string, params map[string]string) error {
	t.Helper()
	_, err := e.ctrl.ControllerModifyVolume(ctx(t), &csi.ControllerModifyVolumeRequest{VolumeId: volID, MutableParameters: params})
	return err
}

// TestModifiedReadAheadReachesTheDevice: a block volume's readAheadKiB, set
// by its VolumeAttributesClass at creation and changed by
// ControllerModifyVolume, is what the kernel reads ahead on the node's
// device after each stage, across a restart of the plugin; a stage made
// before the change keeps its setting until the volume is staged again.
func TestModifiedReadAheadReachesTheDevice(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    *csi.VolumeCapability
	}{
		{"raw block", blockCap(accessmode.SingleNodeWriter)},
		{"ext4", mountCap(accessmode.SingleNodeWriter)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 0)
			resp, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
				Name: "ra", CapacityRange: &csi.CapacityRange{RequiredBytes: volumeSize},
				VolumeCapabilities: []*csi.VolumeCapability{tc.c},
				MutableParameters:  map[string]string{"readAheadKiB": "1024"},
			})
			if err != nil {
				t.Fatal(err)
			}
			volID := resp.GetVolume().GetVolumeId()
			t.Cleanup(func() {
				if _, err := e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: volID}); err != nil {
					t.Errorf("cleanup: DeleteVolume: %v", err)
				}
			})
			pc := e.controllerPublish(t, volID, tc.c)
			staging := e.stage(t, volID, "ra", tc.c, pc)
			if got := e.readAheadOf(t, volID); got != 1024 {
				t.Fatalf("read-ahead after the first stage: %d KiB, the class says 1024", got)
			}

			if err := e.modify(t, volID, map[string]string{"readAheadKiB": "256"}); err != nil {
				t.Fatalf("ControllerModifyVolume: %v", err)
			}
			if got := e.readAheadOf(t, volID); got != 1024 {
				t.Fatalf("a stage made before the change has %d KiB; it keeps 1024 until staged again", got)
			}
			e.restart(t)
			if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
				t.Fatal(err)
			}
			e.stage(t, volID, "ra", tc.c, pc)
			if got := e.readAheadOf(t, volID); got != 256 {
				t.Fatalf("read-ahead after a stage following the change and a restart: %d KiB, want 256", got)
			}

			// A request with one bad key changes nothing.
			err = e.modify(t, volID, map[string]string{"readAheadKiB": "64", "rootSquash": "false"})
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("modify with an NFS key on a block volume: %v, want InvalidArgument", err)
			}
			if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
				t.Fatal(err)
			}
			e.stage(t, volID, "ra", tc.c, pc)
			if got := e.readAheadOf(t, volID); got != 256 {
				t.Fatalf("read-ahead after a refused modify: %d KiB, want 256 still", got)
			}
		})
	}
}

// TestModifyVolumeRefusals: what ControllerModifyVolume and CreateVolume
// refuse, with the codes the spec gives, and that a refused CreateVolume
// makes nothing.
func TestModifyVolumeRefusals(t *testing.T) {
	e := newMemoryEnv(t, 0)
	c := blockCap(accessmode.SingleNodeWriter)
	volID := e.createVolume(t, "plain", c)
	for _, tc := range []struct {
		name   string
		volID  string
		params map[string]string
		code   codes.Code
	}{
		{"no volume id", "", map[string]string{"readAheadKiB": "128"}, codes.InvalidArgument},
		{"a volume that does not exist", "non-existing-volume-id", map[string]string{"readAheadKiB": "128"}, codes.NotFound},
		{"an unknown key", volID, map[string]string{"XXX_FakeKey": "XXX_FakeValue"}, codes.InvalidArgument},
		{"a creation parameter", volID, map[string]string{"fsType": "xfs"}, codes.InvalidArgument},
		{"a value out of range", volID, map[string]string{"readAheadKiB": "99999999"}, codes.InvalidArgument},
		{"nothing to change", volID, nil, codes.OK},
		{"a change", volID, map[string]string{"readAheadKiB": "128"}, codes.OK},
		{"the same change again", volID, map[string]string{"readAheadKiB": "128"}, codes.OK},
	} {
		if err := e.modify(t, tc.volID, tc.params); status.Code(err) != tc.code {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.code)
		}
	}

	create := func(name string, mutable map[string]string) error {
		resp, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: volumeSize},
			VolumeCapabilities: []*csi.VolumeCapability{c}, MutableParameters: mutable,
		})
		if err == nil {
			id := resp.GetVolume().GetVolumeId()
			t.Cleanup(func() { _, _ = e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id}) })
		}
		return err
	}
	if err := create("bad-class", map[string]string{"XXX_FakeKey": "XXX_FakeValue"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("CreateVolume with an unknown mutable key: %v, want InvalidArgument", err)
	}
	list, err := e.ctrl.ListVolumes(ctx(t), &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(list.GetEntries()); n != 1 {
		t.Fatalf("%d volumes after a refused CreateVolume, want only the one made before", n)
	}
	if err := create("classed", map[string]string{"readAheadKiB": "512"}); err != nil {
		t.Fatal(err)
	}
	if err := create("classed", map[string]string{"readAheadKiB": "512"}); err != nil {
		t.Fatalf("the same CreateVolume again: %v, want OK", err)
	}
	if err := create("classed", map[string]string{"readAheadKiB": "1024"}); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("CreateVolume of the same name with another class: %v, want AlreadyExists", err)
	}
}

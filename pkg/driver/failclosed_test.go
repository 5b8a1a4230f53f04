package driver_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// TestMountCheckErrorFailsClosed_FakeMountTable: the driver's mount checks
// fail (here: the mount table read fails with EIO, which a healthy kernel
// does not produce on demand, hence a table that fails when told to; every
// mount, device and lock file is real). A failing check must never count as
// "not mounted": the RWOP holder stays, a second pod is refused, and
// neither a restart nor an unstage lets the volume go on a guess.
func TestMountCheckErrorFailsClosed_FakeMountTable(t *testing.T) {
	var failing atomic.Bool
	table := mounts.Table{Read: func(f mountinfo.FilterFunc) ([]*mounts.Mount, error) {
		if failing.Load() {
			return nil, unix.EIO
		}
		return mountinfo.GetMounts(f)
	}}
	e := newEnv(t, 0, func(e *env) { e.mountTable = table })
	c := mountCap(accessmode.SingleNodeSingleWriter)
	volID, staging, pc := e.setup(t, "unsure", c)
	first, second := e.targetPath("pod-a"), e.targetPath("pod-b")
	if err := e.publish(t, volID, staging, first, c, pc, false); err != nil {
		t.Fatal(err)
	}

	failing.Store(true)
	err := e.publish(t, volID, staging, second, c, pc, false)
	if err == nil {
		t.Fatal("a second RWOP publish succeeded while the first holder's mount could not be checked")
	}
	if code := status.Code(err); code != codes.Internal {
		t.Errorf("second publish while mounts cannot be checked: %v, want Internal", err)
	}
	if n := kernelMountsAt(t, second); n != 0 {
		t.Errorf("the refused publish left %d mounts at %s", n, second)
	}
	if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err == nil {
		t.Error("NodeUnstageVolume succeeded while the holder's mount could not be checked")
	}
	// A restart while the table cannot be read keeps the holder too.
	e.restart(t)

	failing.Store(false)
	err = e.publish(t, volID, staging, second, c, pc, false)
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("second RWOP publish once the mounts can be checked again: %v, want FailedPrecondition (the first pod still holds it)", err)
	}
	if n := kernelMountsAt(t, first); n != 1 {
		t.Errorf("the first pod's mount: %d mounts, want 1", n)
	}
}

// cannotTellCreations is a controller that cannot say whether a volume is
// being created, as a storage target of an older version cannot.
type cannotTellCreations struct{ backend.Controller }

func (cannotTellCreations) Creating(context.Context, volumeid.ID) (bool, error) {
	return false, status.Error(codes.Unavailable, "the storage target does not serve Creating")
}

// TestCreateVolumeFailsClosedWhenCreationsCannotBeTold: not knowing
// whether the backend is creating the volume in the background is no "no":
// a volume made then could be a second one, in another zone. The call
// answers UNAVAILABLE, which the CO retries, and makes nothing.
func TestCreateVolumeFailsClosedWhenCreationsCannotBeTold(t *testing.T) {
	e := newMemoryEnv(t, 0, func(e *env) {
		e.wrap = func(c backend.Controller) backend.Controller { return cannotTellCreations{c} }
	})
	_, err := e.createBlock(ctx(t), "unsure", volumeSize, nil)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("CreateVolume while the backend cannot tell its creations: %v, want UNAVAILABLE", err)
	}
	if list, err := e.ctrl.ListVolumes(ctx(t), &csi.ListVolumesRequest{}); err != nil || len(list.GetEntries()) != 0 {
		t.Fatalf("ListVolumes after the refusal: %v, %v; want none", list, err)
	}
}

package integration

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestNamesAndMinimaAcrossBackends: with both backends on one controller,
// a name names one volume (a second CreateVolume of that name for the other
// backend is ALREADY_EXISTS, not a second volume), and GetCapacity's
// minimum volume size is what CreateVolume would really make at the least.
func TestNamesAndMinimaAcrossBackends(t *testing.T) {
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nsenter", "mkfs.xfs")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1, Prefix: "mgs"})
	bin := testenv.BuildBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pool := filepath.Join(t.TempDir(), "pool")
	// Image storage: its volumes have a real minimum (an xfs image).
	ctrl := testenv.StartNFSController(ctx, t, bin, net.Server.Path, net.Server.Addr.String(),
		"--nfs-storage", "images", "--block-pool", "zone-a="+pool, "--block-pool-filesystem=direct")
	cc := ctrl.CSI

	create := func(backendName string) (*csi.Volume, error) {
		resp, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "one-name",
			CapacityRange:      &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(accessmode.SingleNodeWriter)},
			Parameters:         map[string]string{"backend": backendName}})
		return resp.GetVolume(), err
	}
	vol, err := create("block")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}) })
	if again, err := create("block"); err != nil || again.GetVolumeId() != vol.GetVolumeId() {
		t.Errorf("a repeated CreateVolume: %v, %v; want the same volume %s", again.GetVolumeId(), err, vol.GetVolumeId())
	}
	other, err := create("nfs")
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("CreateVolume of the same name for the other backend: %v, %v; want ALREADY_EXISTS", other.GetVolumeId(), err)
	}
	list, err := cc.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 {
		t.Errorf("ListVolumes after the refused create: %d volumes, %v; want 1", len(list.GetEntries()), err)
	}

	capacity, err := cc.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{"backend": "nfs"},
		VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(accessmode.MultiNodeMultiWriter)}})
	if err != nil {
		t.Fatal(err)
	}
	min := capacity.GetMinimumVolumeSize().GetValue()
	small, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "smallest-nfs",
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 1},
		VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(accessmode.MultiNodeMultiWriter)},
		Parameters:         map[string]string{"backend": "nfs"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: small.GetVolume().GetVolumeId()})
	})
	if got := small.GetVolume().GetCapacityBytes(); min != got || min < 300<<20 {
		t.Errorf("GetCapacity says the smallest NFS volume is %d bytes; CreateVolume of 1 byte made %d", min, got)
	}
}

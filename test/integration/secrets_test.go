package integration

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestSecretsNeitherLoggedNorStoredByTheBinaries runs the controller and a node plugin binary at
// -v 5, where every request and response is logged, and makes every call
// that carries secrets, the successful ones of a volume's whole life and
// failing ones (whose errors are logged too), with a secret value that
// must then appear nowhere in what either process wrote: not in its log,
// not in the pool, not in the lock files.
func TestSecretsNeitherLoggedNorStoredByTheBinaries(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	// Reflinks: the test snapshots its volume while it is published.
	work := testenv.ReflinkXFS(t, 1<<30)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cluster, err := localcluster.Start(ctx, bin, work, []localcluster.NodeSpec{{Name: "node-a1", Zone: "zone-a"}}, 5)
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			cluster.Stop()
		}
	})
	ctrl, node := cluster.Stories.Controller, cluster.Stories.Nodes[0].Client

	const secret = "s3cr3t-value-that-must-not-leak"
	secrets := map[string]string{"password": secret, "token": "Bearer " + secret, secret: "in-the-key-too"}
	info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	nodeID := info.GetNodeId()
	capability := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	}
	caps := []*csi.VolumeCapability{capability}
	// must fails the test on an error; may only logs it: the call was made,
	// and what it logged is what this test reads.
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	may := func(what string, err error) {
		t.Helper()
		t.Logf("%s: %v", what, err)
	}

	vol, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "secret-vol", VolumeCapabilities: caps,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}, Secrets: secrets})
	must("CreateVolume", err)
	id := vol.GetVolume().GetVolumeId()
	_, err = ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "secret-bad", VolumeCapabilities: caps,
		Parameters: map[string]string{"replication": "3"}, Secrets: secrets})
	may("CreateVolume with an unknown parameter", err)
	_, err = ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "secret-nfs", VolumeCapabilities: caps,
		Parameters: map[string]string{"backend": "nfs"}, Secrets: secrets})
	may("CreateVolume on a backend this controller lacks", err)
	_, err = ctrl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: caps, Secrets: secrets})
	may("ValidateVolumeCapabilities", err)

	pub, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: nodeID,
		VolumeCapability: capability, Secrets: secrets})
	must("ControllerPublishVolume", err)
	_, err = ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a2@zone-a",
		VolumeCapability: capability, Secrets: secrets})
	may("ControllerPublishVolume to a second node", err)
	_, err = ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets})
	may("DeleteVolume while attached", err)

	staging, target := filepath.Join(work, "staging"), filepath.Join(work, "target")
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: capability, PublishContext: pub.GetPublishContext(), Secrets: secrets})
	must("NodeStageVolume", err)
	_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: "relative/path",
		VolumeCapability: capability, PublishContext: pub.GetPublishContext(), Secrets: secrets})
	may("NodeStageVolume at a relative path", err)
	_, err = node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: capability, PublishContext: pub.GetPublishContext(), Secrets: secrets})
	must("NodePublishVolume", err)
	_, err = node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging + "-other",
		TargetPath: target + "-other", VolumeCapability: capability, Secrets: secrets})
	may("NodePublishVolume from the wrong staging path", err)

	_, err = ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20}, VolumeCapability: capability, Secrets: secrets})
	must("ControllerExpandVolume", err)
	_, err = node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target,
		StagingTargetPath: staging, CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20},
		VolumeCapability: capability, Secrets: secrets})
	may("NodeExpandVolume", err) // may need CAP_SYS_RESOURCE for a mounted ext4
	snap, err := ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "secret-snap", SourceVolumeId: id, Secrets: secrets})
	must("CreateSnapshot", err)
	_, err = ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{Secrets: secrets})
	may("ListSnapshots", err)
	_, err = ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId(), Secrets: secrets})
	must("DeleteSnapshot", err)

	_, err = node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	must("NodeUnpublishVolume", err)
	_, err = node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	must("NodeUnstageVolume", err)
	_, err = ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: nodeID, Secrets: secrets})
	must("ControllerUnpublishVolume", err)
	_, err = ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets})
	must("DeleteVolume", err)

	// SIGTERM: each process flushes its log before it exits.
	stopped = true
	if forced := cluster.Stop(); len(forced) > 0 {
		t.Errorf("stopping had to force: %v", forced)
	}
	var logs strings.Builder
	for name, path := range cluster.Logs() {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		logs.Write(data)
		for i, line := range strings.Split(string(data), "\n") {
			if strings.Contains(line, secret) {
				t.Errorf("%s log, line %d, holds the secret: %s", name, i+1, line)
			}
		}
	}
	// The calls were logged in full, with the secrets replaced: without
	// this the absence above would prove nothing.
	for _, want := range []string{
		"/csi.v1.Controller/CreateVolume", "/csi.v1.Controller/ControllerPublishVolume", "/csi.v1.Controller/DeleteVolume",
		"/csi.v1.Controller/ControllerExpandVolume", "/csi.v1.Controller/CreateSnapshot", "/csi.v1.Controller/ControllerUnpublishVolume",
		"/csi.v1.Node/NodeStageVolume", "/csi.v1.Node/NodePublishVolume", "/csi.v1.Node/NodeExpandVolume",
		"***stripped***", "secret-vol", "Call failed",
	} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the logs do not contain %q: the calls were not logged as at -v 4 and above", want)
		}
	}
	// Nor is a secret kept in any file the driver wrote.
	err = filepath.WalkDir(work, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		if data, err := os.ReadFile(p); err == nil && strings.Contains(string(data), secret) {
			t.Errorf("%s holds the secret", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if t.Failed() {
		t.Logf("logs:\n%s", logs.String())
	}
}

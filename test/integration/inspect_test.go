package integration

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/inspect"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestInspectExplainsAStuckPod is the operator's case: a second pod of an
// RWOP claim is stuck; one `modeguard inspect` says who holds the volume,
// where, and why the new publish is refused.
func TestInspectExplainsAStuckPod(t *testing.T) {
	ctx, bin, work, cluster := startLocalCluster(t, "256m")
	ctrl := cluster.Stories.Controller
	node := cluster.Stories.Nodes[0].Client // node-a1
	info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	capability := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
	}
	vol, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "db", VolumeCapabilities: []*csi.VolumeCapability{capability},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	pub, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId(), VolumeCapability: capability})
	if err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(work, "staging")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: capability, PublishContext: pub.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	publish := func(pod string) error {
		_, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			TargetPath: filepath.Join(work, "pods", pod), VolumeCapability: capability, PublishContext: pub.GetPublishContext(),
			VolumeContext: map[string]string{"csi.storage.k8s.io/pod.name": pod, "csi.storage.k8s.io/pod.namespace": "shop"}})
		return err
	}
	if err := os.MkdirAll(filepath.Join(work, "pods"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := publish("db-0"); err != nil {
		t.Fatal(err)
	}
	if err := publish("db-1"); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("the second pod: got %v, want FailedPrecondition", err)
	}

	args := []string{"inspect"}
	for zone, dir := range cluster.Pools {
		args = append(args, "--block-pool", zone+"="+dir)
	}
	for _, n := range localcluster.DefaultNodes {
		args = append(args, "--state-dir", filepath.Join(work, "nodes", n.Name, "state"))
	}
	out, err := exec.Command(bin, append(args, "--json", id)...).Output()
	if err != nil {
		t.Fatalf("modeguard inspect --json: %v", err)
	}
	var report inspect.Report
	if err := json.Unmarshal(out, &report); err != nil {
		t.Fatalf("inspect --json printed no report: %v\n%s", err, out)
	}
	if len(report.Volumes) != 1 {
		t.Fatalf("want exactly the asked volume, got %+v", report.Volumes)
	}
	v := report.Volumes[0]
	if len(v.Attachments) != 1 || v.Attachments[0].Node.String() != info.GetNodeId() || v.Attachments[0].ReadOnly {
		t.Errorf("attachments: %+v, want %s read/write", v.Attachments, info.GetNodeId())
	}
	if len(v.Holds) != 1 || v.Holds[0].Node != info.GetNodeId() || len(v.Holds[0].Workloads) != 1 ||
		v.Holds[0].Workloads[0].Pod != "shop/db-0" || v.Holds[0].StagingPath != staging {
		t.Errorf("holds: %+v, want shop/db-0 on %s staged at %s", v.Holds, info.GetNodeId(), staging)
	}
	joined := strings.Join(v.Verdicts, "\n")
	for _, want := range []string{"another node is refused", "another workload is refused", "shop/db-0"} {
		if !strings.Contains(joined, want) {
			t.Errorf("verdicts lack %q:\n%s", want, joined)
		}
	}
	text, err := exec.Command(bin, args...).Output()
	if err != nil {
		t.Fatalf("modeguard inspect: %v", err)
	}
	for _, want := range []string{id, "held by shop/db-0", "attached to: " + info.GetNodeId(), "SINGLE_NODE_SINGLE_WRITER"} {
		if !strings.Contains(string(text), want) {
			t.Errorf("inspect's text lacks %q:\n%s", want, text)
		}
	}
	t.Logf("modeguard inspect:\n%s", text)

	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(work, "pods", "db-0")}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}

// startLocalCluster runs a controller and the three default node plugins
// of the race-built binary on a tmpfs of the given size, stopped and
// checked for leftovers when the test ends.
func startLocalCluster(t *testing.T, tmpfsSize string) (context.Context, string, string, *localcluster.Cluster) {
	t.Helper()
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := testenv.Tmpfs(t, tmpfsSize)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	cluster, err := localcluster.Start(ctx, bin, work, localcluster.DefaultNodes, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if forced := cluster.Stop(); len(forced) > 0 {
			t.Errorf("cleanup had to force: %v", forced)
		}
	})
	return ctx, bin, work, cluster
}

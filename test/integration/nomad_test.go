package integration

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// nomadVolume is what the test reads from a Nomad volume specification.
type nomadVolume struct {
	name         string
	capabilities []*csi.VolumeCapability
	capacityMin  int64
	capacityMax  int64
	parameters   map[string]string
	zone         string
}

var (
	hclCapability = regexp.MustCompile(`(?s)capability \{\s*access_mode\s*=\s*"([^"]+)"\s*attachment_mode\s*=\s*"([^"]+)"`)
	hclString     = func(key string) *regexp.Regexp { return regexp.MustCompile(`(?m)^` + key + `\s*=\s*"([^"]+)"`) }
	hclFsType     = regexp.MustCompile(`(?m)^\s*fs_type\s*=\s*"([^"]+)"`)
	hclBackend    = regexp.MustCompile(`(?m)^\s*backend\s*=\s*"([^"]+)"`)
	hclZone       = regexp.MustCompile(`"topology.modeguard.csi.dev/zone"\s*=\s*"([^"]+)"`)
)

func mebibytes(t *testing.T, s string) int64 {
	n, err := strconv.ParseInt(strings.TrimSuffix(s, "MiB"), 10, 64)
	if err != nil || !strings.HasSuffix(s, "MiB") {
		t.Fatalf("capacity %q: the example uses MiB", s)
	}
	return n << 20
}

// capability is what Nomad sends for an access mode and attachment mode.
func nomadCapability(t *testing.T, accessMode, attachment, fsType string) *csi.VolumeCapability {
	mode, err := accessmode.Parse(accessMode)
	if err != nil {
		t.Fatal(err)
	}
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	switch attachment {
	case "file-system":
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}
	case "block-device":
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	default:
		t.Fatalf("attachment mode %q", attachment)
	}
	return c
}

func readNomadVolume(t *testing.T, file string) *nomadVolume {
	data, err := os.ReadFile(filepath.Join("..", "..", "docs", "nomad", file))
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	v := &nomadVolume{name: hclString("name").FindStringSubmatch(s)[1], parameters: map[string]string{}}
	fs := ""
	if m := hclFsType.FindStringSubmatch(s); m != nil {
		fs = m[1]
	}
	for _, m := range hclCapability.FindAllStringSubmatch(s, -1) {
		v.capabilities = append(v.capabilities, nomadCapability(t, m[1], m[2], fs))
	}
	v.capacityMin = mebibytes(t, hclString("capacity_min").FindStringSubmatch(s)[1])
	v.capacityMax = mebibytes(t, hclString("capacity_max").FindStringSubmatch(s)[1])
	if m := hclBackend.FindStringSubmatch(s); m != nil {
		v.parameters["backend"] = m[1]
	}
	if m := hclZone.FindStringSubmatch(s); m != nil {
		v.zone = m[1]
	}
	if len(v.capabilities) == 0 {
		t.Fatalf("%s has no capability block", file)
	}
	return v
}

// TestNomadExample makes, for the volumes and jobs in docs/nomad, the CSI
// calls Nomad makes, against a controller and node plugins.
func TestNomadExample(t *testing.T) {
	ctx, _, work, cluster := startLocalCluster(t, "384m")
	ctrl := cluster.Stories.Controller
	nodeIDs := map[string]string{}
	nodes := map[string]csi.NodeClient{}
	for _, n := range cluster.Stories.Nodes {
		info, err := n.Client.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		nodeIDs[n.Name], nodes[n.Name] = info.GetNodeId(), n.Client
	}

	// `nomad volume create`
	create := func(v *nomadVolume) *csi.Volume {
		t.Helper()
		req := &csi.CreateVolumeRequest{Name: v.name, VolumeCapabilities: v.capabilities, Parameters: v.parameters,
			CapacityRange: &csi.CapacityRange{RequiredBytes: v.capacityMin, LimitBytes: v.capacityMax}}
		if v.zone != "" {
			req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{
				{Segments: map[string]string{"topology.modeguard.csi.dev/zone": v.zone}}}}
		}
		resp, err := ctrl.CreateVolume(ctx, req)
		if err != nil {
			t.Fatalf("nomad volume create %s: %v", v.name, err)
		}
		return resp.GetVolume()
	}

	// A claim is one allocation's use of a volume on a node, as Nomad
	// makes it: publish to the node, stage at a per-usage path, publish
	// at a per-allocation path.
	type claim struct {
		vol      *csi.Volume
		cap      *csi.VolumeCapability
		node     string
		alloc    string
		readOnly bool
		pubCtx   map[string]string
	}
	staging := func(c *claim) string {
		return filepath.Join(work, "nomad", c.node, "staging", c.vol.GetVolumeId(), "usage")
	}
	target := func(c *claim) string {
		return filepath.Join(work, "nomad", c.node, "per-alloc", c.alloc, c.vol.GetVolumeId())
	}
	run := func(c *claim) error {
		resp, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: c.vol.GetVolumeId(),
			NodeId: nodeIDs[c.node], VolumeCapability: c.cap, Readonly: c.readOnly, VolumeContext: c.vol.GetVolumeContext()})
		if err != nil {
			return err
		}
		c.pubCtx = resp.GetPublishContext()
		if _, err := nodes[c.node].NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: c.vol.GetVolumeId(),
			StagingTargetPath: staging(c), VolumeCapability: c.cap, PublishContext: c.pubCtx, VolumeContext: c.vol.GetVolumeContext()}); err != nil {
			return err
		}
		if c.cap.GetMount() != nil {
			if err := os.MkdirAll(filepath.Dir(target(c)), 0o750); err != nil {
				return err
			}
		}
		_, err = nodes[c.node].NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: c.vol.GetVolumeId(),
			StagingTargetPath: staging(c), TargetPath: target(c), VolumeCapability: c.cap, Readonly: c.readOnly,
			PublishContext: c.pubCtx, VolumeContext: c.vol.GetVolumeContext()})
		return err
	}
	stop := func(c *claim) {
		t.Helper()
		if _, err := nodes[c.node].NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: c.vol.GetVolumeId(), TargetPath: target(c)}); err != nil {
			t.Fatal(err)
		}
		if _, err := nodes[c.node].NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: c.vol.GetVolumeId(), StagingTargetPath: staging(c)}); err != nil {
			t.Fatal(err)
		}
		if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: c.vol.GetVolumeId(), NodeId: nodeIDs[c.node]}); err != nil {
			t.Fatal(err)
		}
	}
	want := func(what string, err error, code codes.Code) {
		t.Helper()
		if status.Code(err) != code {
			t.Fatalf("%s: got %v, want %s", what, err, code)
		}
	}
	jobs, err := os.ReadFile(filepath.Join("..", "..", "docs", "nomad", "jobs.nomad.hcl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"single-node-writer", "single-node-reader-only", "multi-node-single-writer"} {
		if !strings.Contains(string(jobs), `access_mode     = "`+mode+`"`) {
			t.Fatalf("jobs.nomad.hcl has no claim with access_mode %s", mode)
		}
	}

	t.Run("reference data: a loader writes, single-node-reader-only readers cannot", func(t *testing.T) {
		v := readNomadVolume(t, "reference.volume.hcl")
		vol := create(v)
		if got := vol.GetAccessibleTopology(); len(got) != 1 || got[0].GetSegments()["topology.modeguard.csi.dev/zone"] != v.zone {
			t.Fatalf("the volume's topology is %v, want zone %s", got, v.zone)
		}
		writer := &claim{vol: vol, cap: nomadCapability(t, "single-node-writer", "file-system", "ext4"), node: "node-a1", alloc: "loader-1"}
		want("loader on node-a1", run(writer), codes.OK)
		if err := os.WriteFile(filepath.Join(target(writer), "data.txt"), []byte("reference data"), 0o644); err != nil {
			t.Fatal(err)
		}
		stop(writer)
		reader := &claim{vol: vol, cap: nomadCapability(t, "single-node-reader-only", "file-system", "ext4"), node: "node-a2", alloc: "reader-1", readOnly: true}
		want("reader on node-a2", run(reader), codes.OK)
		if data, err := os.ReadFile(filepath.Join(target(reader), "data.txt")); err != nil || string(data) != "reference data" {
			t.Fatalf("the reader read %q, %v", data, err)
		}
		if err := os.WriteFile(filepath.Join(target(reader), "data.txt"), []byte("changed"), 0o644); err == nil {
			t.Fatal("a single-node-reader-only reader wrote")
		}
		second := &claim{vol: vol, cap: reader.cap, node: "node-a1", alloc: "reader-2", readOnly: true}
		want("a second reader on another node (single-node: one node at a time)", run(second), codes.FailedPrecondition)
		stop(reader)
		if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("journal: one multi-node-single-writer writer, readers follow", func(t *testing.T) {
		v := readNomadVolume(t, "journal.volume.hcl")
		vol := create(v)
		c := nomadCapability(t, "multi-node-single-writer", "block-device", "")
		writer := &claim{vol: vol, cap: c, node: "node-a1", alloc: "writer-1"}
		want("writer on node-a1", run(writer), codes.OK)
		f, err := os.OpenFile(target(writer), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("entry\n"), 0); err != nil {
			t.Fatal(err)
		}
		f.Sync()
		f.Close()
		second := &claim{vol: vol, cap: c, node: "node-a2", alloc: "writer-2"}
		want("a second writer on node-a2", run(second), codes.FailedPrecondition)
		reader := &claim{vol: vol, cap: c, node: "node-a2", alloc: "reader-1", readOnly: true}
		want("a reader on node-a2", run(reader), codes.OK)
		buf := make([]byte, 6)
		rf, err := os.Open(target(reader))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := rf.ReadAt(buf, 0); err != nil || string(buf) != "entry\n" {
			t.Fatalf("the reader read %q, %v", buf, err)
		}
		rf.Close()
		if wf, err := os.OpenFile(target(reader), os.O_WRONLY, 0); err == nil {
			_, werr := wf.WriteAt([]byte("forged"), 0)
			wf.Close()
			if werr == nil {
				t.Fatal("a read-only journal reader wrote")
			}
		}
		stop(reader)
		stop(writer)
		if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
	})
}

package driver

import (
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
)

func mountCap(fs string, m accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

func blockCap(m accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

func TestParseCapabilities(t *testing.T) {
	noMode := mountCap("ext4", 0)
	noMode.AccessMode = nil
	noType := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: accessmode.SingleNodeWriter}}
	tests := []struct {
		name     string
		caps     []*csi.VolumeCapability
		want     capabilityRequest
		code     codes.Code
		mentions string
	}{
		{name: "one mount", caps: []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter)},
			want: capabilityRequest{accessType: accessmode.Mount, fsType: "ext4", modes: []accessmode.Mode{accessmode.SingleNodeWriter}}},
		{name: "mount without fs", caps: []*csi.VolumeCapability{mountCap("", accessmode.SingleNodeSingleWriter)},
			want: capabilityRequest{accessType: accessmode.Mount, modes: []accessmode.Mode{accessmode.SingleNodeSingleWriter}}},
		{name: "one block", caps: []*csi.VolumeCapability{blockCap(accessmode.MultiNodeMultiWriter)},
			want: capabilityRequest{accessType: accessmode.Block, modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}}},
		{name: "fs named once is the volume's", caps: []*csi.VolumeCapability{
			mountCap("", accessmode.SingleNodeWriter), mountCap("xfs", accessmode.MultiNodeReaderOnly), mountCap("", accessmode.SingleNodeReaderOnly)},
			want: capabilityRequest{accessType: accessmode.Mount, fsType: "xfs",
				modes: []accessmode.Mode{accessmode.SingleNodeWriter, accessmode.MultiNodeReaderOnly, accessmode.SingleNodeReaderOnly}}},
		{name: "same fs twice", caps: []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter), mountCap("ext4", accessmode.SingleNodeMultiWriter)},
			want: capabilityRequest{accessType: accessmode.Mount, fsType: "ext4",
				modes: []accessmode.Mode{accessmode.SingleNodeWriter, accessmode.SingleNodeMultiWriter}}},
		{name: "repeated mode listed once", caps: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter), blockCap(accessmode.SingleNodeWriter)},
			want: capabilityRequest{accessType: accessmode.Block, modes: []accessmode.Mode{accessmode.SingleNodeWriter}}},

		{name: "none", caps: nil, code: codes.InvalidArgument},
		{name: "nil capability", caps: []*csi.VolumeCapability{nil}, code: codes.InvalidArgument},
		{name: "nil after a good one", caps: []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter), nil}, code: codes.InvalidArgument},
		{name: "mixed mount then block", caps: []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter), blockCap(accessmode.SingleNodeWriter)},
			code: codes.InvalidArgument, mentions: "mix"},
		{name: "mixed block then mount", caps: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter), mountCap("", accessmode.SingleNodeWriter)},
			code: codes.InvalidArgument, mentions: "mix"},
		{name: "two fs types", caps: []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter), mountCap("xfs", accessmode.SingleNodeWriter)},
			code: codes.InvalidArgument, mentions: "two filesystems"},
		{name: "two fs types apart", caps: []*csi.VolumeCapability{
			mountCap("xfs", accessmode.SingleNodeWriter), mountCap("", accessmode.SingleNodeWriter), mountCap("ext4", accessmode.SingleNodeWriter)},
			code: codes.InvalidArgument, mentions: "two filesystems"},
		{name: "unsupported fs", caps: []*csi.VolumeCapability{mountCap("btrfs", accessmode.SingleNodeWriter)},
			code: codes.InvalidArgument, mentions: "btrfs"},
		{name: "missing access mode", caps: []*csi.VolumeCapability{noMode}, code: codes.InvalidArgument, mentions: "SINGLE_NODE_WRITER"},
		{name: "unknown access mode", caps: []*csi.VolumeCapability{mountCap("ext4", csi.VolumeCapability_AccessMode_UNKNOWN)},
			code: codes.InvalidArgument, mentions: "access mode"},
		{name: "undefined access mode", caps: []*csi.VolumeCapability{blockCap(99)}, code: codes.InvalidArgument, mentions: "access mode"},
		{name: "missing access type", caps: []*csi.VolumeCapability{noType}, code: codes.InvalidArgument, mentions: "access type"},
		{name: "missing access type after a good one", caps: []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter), noType},
			code: codes.InvalidArgument, mentions: "access type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseCapabilities(tt.caps)
			if tt.code == codes.OK {
				if err != nil {
					t.Fatalf("parseCapabilities: %v", err)
				}
				if got.accessType != tt.want.accessType || got.fsType != tt.want.fsType || !slices.Equal(got.modes, tt.want.modes) {
					t.Errorf("parseCapabilities = %+v, want %+v", got, tt.want)
				}
				return
			}
			if status.Code(err) != tt.code {
				t.Fatalf("parseCapabilities = %+v, %v; want %v", got, err, tt.code)
			}
			if tt.mentions != "" && !strings.Contains(status.Convert(err).Message(), tt.mentions) {
				t.Errorf("message %q does not mention %q", status.Convert(err).Message(), tt.mentions)
			}
		})
	}
}

// existingVolume is what a first CreateVolume("data") made.
func existingVolume() *backend.Volume {
	return &backend.Volume{
		ID:            "block:zone-a:vol-0123456789abcdef0123456789abcdef",
		Name:          "data",
		CapacityBytes: 64 * mib,
		Zone:          "zone-a",
		AccessType:    accessmode.Mount,
		FsType:        "ext4",
		Modes:         []accessmode.Mode{accessmode.SingleNodeWriter, accessmode.SingleNodeReaderOnly},
		Parameters:    map[string]string{"backend": "block", "csi.storage.k8s.io/pvc/name": "data"},
	}
}

// firstRequest is the CreateVolume that made existingVolume.
func firstRequest() *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name:               "data",
		CapacityRange:      capRange(64*mib, 128*mib),
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter), mountCap("", accessmode.SingleNodeReaderOnly)},
		Parameters:         map[string]string{"backend": "block", "csi.storage.k8s.io/pvc/name": "data"},
	}
}

func TestCompatible(t *testing.T) {
	snapSrc := func(id string) *csi.VolumeContentSource {
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
	}
	volSrc := func(id string) *csi.VolumeContentSource {
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
	}
	const snapA = "block:zone-a:snap-0123456789abcdef0123456789abcdef"
	const snapB = "block:zone-a:snap-fedcba9876543210fedcba9876543210"
	tests := []struct {
		name     string
		vol      func(*backend.Volume)
		req      func(*csi.CreateVolumeRequest)
		conflict string // empty: compatible; else a fragment of the ALREADY_EXISTS message
	}{
		{name: "identical repeat"},
		{name: "no capacity range", req: func(r *csi.CreateVolumeRequest) { r.CapacityRange = nil }},
		{name: "range still holding the volume", req: func(r *csi.CreateVolumeRequest) { r.CapacityRange = capRange(mib, 64*mib) }},
		{name: "subset of modes", req: func(r *csi.CreateVolumeRequest) {
			r.VolumeCapabilities = []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeWriter)}
		}},
		{name: "nil and empty parameters", vol: func(v *backend.Volume) { v.Parameters = nil },
			req: func(r *csi.CreateVolumeRequest) { r.Parameters = map[string]string{} }},
		{name: "requisite holding the zone", req: func(r *csi.CreateVolumeRequest) {
			r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-b"), topo("zone-a")}}
		}},
		{name: "a volume without a zone satisfies any requisite", vol: func(v *backend.Volume) { v.Zone = "" },
			req: func(r *csi.CreateVolumeRequest) {
				r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-b")}}
			}},
		{name: "preferred elsewhere is only a wish", req: func(r *csi.CreateVolumeRequest) {
			r.AccessibilityRequirements = &csi.TopologyRequirement{Preferred: []*csi.Topology{topo("zone-b")}}
		}},
		{name: "same snapshot source", vol: func(v *backend.Volume) { v.Source = &backend.Source{SnapshotID: snapA} },
			req: func(r *csi.CreateVolumeRequest) { r.VolumeContentSource = snapSrc(snapA) }},

		{name: "more capacity required", req: func(r *csi.CreateVolumeRequest) { r.CapacityRange = capRange(65*mib, 0) }, conflict: "capacity"},
		{name: "lower limit", req: func(r *csi.CreateVolumeRequest) { r.CapacityRange = capRange(0, 32*mib) }, conflict: "capacity"},
		{name: "other access type", req: func(r *csi.CreateVolumeRequest) {
			r.VolumeCapabilities = []*csi.VolumeCapability{blockCap(accessmode.SingleNodeWriter)}
		}, conflict: "access type"},
		{name: "other filesystem", req: func(r *csi.CreateVolumeRequest) {
			r.VolumeCapabilities = []*csi.VolumeCapability{mountCap("xfs", accessmode.SingleNodeWriter)}
		}, conflict: "filesystem"},
		{name: "other mode", req: func(r *csi.CreateVolumeRequest) {
			r.VolumeCapabilities = []*csi.VolumeCapability{mountCap("ext4", accessmode.SingleNodeSingleWriter)}
		}, conflict: "access modes"},
		{name: "one more mode", req: func(r *csi.CreateVolumeRequest) {
			r.VolumeCapabilities = append(r.VolumeCapabilities, mountCap("ext4", accessmode.SingleNodeMultiWriter))
		}, conflict: "access modes"},
		{name: "extra parameter", req: func(r *csi.CreateVolumeRequest) { r.Parameters["fsType"] = "ext4" }, conflict: "parameters"},
		{name: "other parameter value", req: func(r *csi.CreateVolumeRequest) { r.Parameters["backend"] = "auto" }, conflict: "parameters"},
		{name: "missing parameter", req: func(r *csi.CreateVolumeRequest) { delete(r.Parameters, "csi.storage.k8s.io/pvc/name") }, conflict: "parameters"},
		{name: "source added", req: func(r *csi.CreateVolumeRequest) { r.VolumeContentSource = snapSrc(snapA) }, conflict: "content source"},
		{name: "source dropped", vol: func(v *backend.Volume) { v.Source = &backend.Source{SnapshotID: snapA} }, conflict: "content source"},
		{name: "other snapshot", vol: func(v *backend.Volume) { v.Source = &backend.Source{SnapshotID: snapA} },
			req: func(r *csi.CreateVolumeRequest) { r.VolumeContentSource = snapSrc(snapB) }, conflict: "content source"},
		{name: "volume instead of snapshot", vol: func(v *backend.Volume) { v.Source = &backend.Source{SnapshotID: snapA} },
			req: func(r *csi.CreateVolumeRequest) { r.VolumeContentSource = volSrc(existingVolume().ID) }, conflict: "content source"},
		{name: "requisite elsewhere", req: func(r *csi.CreateVolumeRequest) {
			r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-b")}}
		}, conflict: "outside the requisite topology"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vol, req := existingVolume(), firstRequest()
			if tt.vol != nil {
				tt.vol(vol)
			}
			if tt.req != nil {
				tt.req(req)
			}
			// As CreateVolume does: parse the capabilities, default the fs.
			caps, err := parseCapabilities(req.GetVolumeCapabilities())
			if err != nil {
				t.Fatal(err)
			}
			if caps.accessType == accessmode.Mount && caps.fsType == "" {
				caps.fsType = DefaultFsType
			}
			src, err := contentSource(req.GetVolumeContentSource())
			if err != nil {
				t.Fatal(err)
			}
			err = compatible(vol, req, caps, nil, src, nil)
			if tt.conflict == "" {
				if err != nil {
					t.Errorf("compatible: %v; want the existing volume to be returned", err)
				}
				return
			}
			if status.Code(err) != codes.AlreadyExists {
				t.Fatalf("compatible = %v, want ALREADY_EXISTS", err)
			}
			msg := status.Convert(err).Message()
			for _, m := range []string{tt.conflict, vol.Name, vol.ID} {
				if !strings.Contains(msg, m) {
					t.Errorf("message %q does not mention %q", msg, m)
				}
			}
		})
	}
}

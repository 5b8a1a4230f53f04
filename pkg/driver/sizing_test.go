package driver

import (
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func capRange(required, limit int64) *csi.CapacityRange {
	return &csi.CapacityRange{RequiredBytes: required, LimitBytes: limit}
}

func TestSizeFor(t *testing.T) {
	const kib = int64(1) << 10
	tests := []struct {
		name     string
		r        *csi.CapacityRange
		fsType   string
		minimum  int64
		want     int64
		code     codes.Code
		mentions string
	}{
		// Defaults.
		{name: "no range ext4", r: nil, fsType: "ext4", want: DefaultVolumeSize},
		{name: "no range xfs", r: nil, fsType: "xfs", want: DefaultVolumeSize},
		{name: "no range raw block", r: nil, fsType: "", want: DefaultVolumeSize},
		{name: "zero range", r: capRange(0, 0), fsType: "ext4", want: DefaultVolumeSize},
		{name: "limit above default", r: capRange(0, 5*gib), fsType: "ext4", want: DefaultVolumeSize},
		{name: "limit below default", r: capRange(0, 100*mib), fsType: "ext4", want: 100 * mib},
		// Rounding up to whole MiB.
		{name: "one byte ext4", r: capRange(1, 0), fsType: "ext4", want: mib},
		{name: "one byte raw", r: capRange(1, 0), fsType: "", want: mib},
		{name: "exact MiB", r: capRange(10*mib, 0), fsType: "ext4", want: 10 * mib},
		{name: "MiB plus one", r: capRange(10*mib+1, 0), fsType: "ext4", want: 11 * mib},
		{name: "MiB minus one", r: capRange(10*mib-1, 0), fsType: "", want: 10 * mib},
		// The limit is respected, rounding stops at whole 4 KiB blocks.
		{name: "required equals limit", r: capRange(10*mib, 10*mib), fsType: "ext4", want: 10 * mib},
		{name: "rounding capped by limit", r: capRange(5*mib+1, 5*mib+8*kib), fsType: "ext4", want: 5*mib + 8*kib},
		{name: "rounding capped by unaligned limit", r: capRange(5*mib+1, 5*mib+8*kib+7), fsType: "", want: 5*mib + 8*kib},
		{name: "no block fits between required and limit", r: capRange(5*mib+1, 5*mib+100), fsType: "ext4", code: codes.OutOfRange},
		{name: "unaligned required equals limit", r: capRange(10*mib+1, 10*mib+1), fsType: "ext4", code: codes.OutOfRange},
		// Only a limit, and one that is no multiple of 4 KiB: anything
		// aligned at or below it will do (a PVC with limits.storage: 500M).
		{name: "only an unaligned limit", r: capRange(0, 500_000_000), fsType: "ext4", want: 500_000_000 / 4096 * 4096},
		{name: "only a limit one byte above a MiB", r: capRange(0, 100*mib+1), fsType: "ext4", want: 100 * mib},
		// Filesystem minimums.
		{name: "xfs minimum", r: capRange(10*mib, 0), fsType: "xfs", want: 300 * mib},
		{name: "xfs minimum with room", r: capRange(10*mib, 400*mib), fsType: "xfs", want: 300 * mib},
		{name: "xfs limit exactly minimum", r: capRange(0, 300*mib), fsType: "xfs", want: 300 * mib},
		{name: "xfs limit below minimum", r: capRange(0, 100*mib), fsType: "xfs", code: codes.OutOfRange, mentions: "xfs"},
		{name: "xfs required and limit below minimum", r: capRange(10*mib, 200*mib), fsType: "xfs", code: codes.OutOfRange, mentions: "xfs"},
		{name: "ext4 limit below minimum", r: capRange(0, 512*kib), fsType: "ext4", code: codes.OutOfRange, mentions: "ext4"},
		{name: "raw limit below one block", r: capRange(0, 1000), fsType: "", code: codes.OutOfRange},
		// The content source's size is a minimum too.
		{name: "source larger than required", r: capRange(10*mib, 0), fsType: "ext4", minimum: 64 * mib, want: 64 * mib},
		{name: "source larger than limit", r: capRange(0, 32*mib), fsType: "ext4", minimum: 64 * mib, code: codes.OutOfRange},
		{name: "source unaligned", r: nil, fsType: "", minimum: 64*mib + 1, want: DefaultVolumeSize},
		{name: "source unaligned small", r: capRange(1, 0), fsType: "", minimum: 3*mib + 1, want: 4 * mib},
		// Bad ranges.
		{name: "negative required", r: capRange(-1, 0), fsType: "ext4", code: codes.InvalidArgument},
		{name: "negative limit", r: capRange(0, -1), fsType: "ext4", code: codes.InvalidArgument},
		{name: "required above limit", r: capRange(20*mib, 10*mib), fsType: "ext4", code: codes.InvalidArgument},
		{name: "huge required", r: capRange(math.MaxInt64, 0), fsType: "ext4", code: codes.OutOfRange},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := sizeFor(tt.r, tt.fsType, tt.minimum)
			if tt.code == codes.OK {
				if err != nil {
					t.Fatalf("sizeFor(%v, %q, %d): %v", tt.r, tt.fsType, tt.minimum, err)
				}
				if got != tt.want {
					t.Errorf("sizeFor(%v, %q, %d) = %d, want %d", tt.r, tt.fsType, tt.minimum, got, tt.want)
				}
				return
			}
			if c := status.Code(err); c != tt.code {
				t.Fatalf("sizeFor(%v, %q, %d) = %d, %v; want code %v", tt.r, tt.fsType, tt.minimum, got, err, tt.code)
			}
			if tt.mentions != "" && !strings.Contains(status.Convert(err).Message(), tt.mentions) {
				t.Errorf("message %q does not mention %q", status.Convert(err).Message(), tt.mentions)
			}
		})
	}
}

// TestSizeForProperties checks every combination of a grid of ranges: a
// size is returned exactly when a whole number of 4 KiB blocks fits between
// what the volume must hold and the limit, and it then lies in that range.
func TestSizeForProperties(t *testing.T) {
	values := []int64{0, 1, 4095, 4096, 4097, mib - 1, mib, mib + 1, mib + 4096, 2*mib - 1, 100 * mib, 100*mib + 1,
		299 * mib, 300 * mib, 300*mib + 1, 500_000_000, DefaultVolumeSize - 1, DefaultVolumeSize, DefaultVolumeSize + 1}
	for _, fs := range []string{"", "ext4", "xfs"} {
		for _, minimum := range []int64{0, 3*mib + 1, 200 * mib} {
			for _, required := range values {
				for _, limit := range values {
					r := capRange(required, limit)
					got, err := sizeFor(r, fs, minimum)
					if limit > 0 && required > limit {
						if status.Code(err) != codes.InvalidArgument {
							t.Errorf("sizeFor(%v, %q, %d) = %d, %v; want InvalidArgument", r, fs, minimum, got, err)
						}
						continue
					}
					need := max(required, minimumSize[fs], minimum, 1)
					fits := limit == 0 || limit/4096*4096 >= need
					if !fits {
						if status.Code(err) != codes.OutOfRange {
							t.Errorf("sizeFor(%v, %q, %d) = %d, %v; want OutOfRange (needs %d)", r, fs, minimum, got, err, need)
						}
						continue
					}
					if err != nil {
						t.Errorf("sizeFor(%v, %q, %d): %v; but %d bytes fit", r, fs, minimum, err, need)
						continue
					}
					if got < need || (limit > 0 && got > limit) || got%4096 != 0 {
						t.Errorf("sizeFor(%v, %q, %d) = %d: not a whole number of 4 KiB blocks in [%d, %d]", r, fs, minimum, got, need, limit)
					}
					if limit == 0 && got%mib != 0 {
						t.Errorf("sizeFor(%v, %q, %d) = %d: without a limit the size is whole MiB", r, fs, minimum, got)
					}
				}
			}
		}
	}
}

func topo(zone string) *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyZoneKey: zone}}
}

func topoNode(zone, node string) *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyZoneKey: zone, TopologyNodeKey: node}}
}

// topoNoZone names a node (known to be in zone-c, see TestCandidateZones)
// without its zone.
func topoNoZone() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyNodeKey: "worker-9"}}
}

func topoUnknownNode() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyNodeKey: "worker-unknown"}}
}

func topoNeither() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{"example.com/rack": "r1"}}
}

func TestCandidateZones(t *testing.T) {
	all := []string{"zone-a", "zone-b", "zone-c"}
	tests := []struct {
		name      string
		req       *csi.TopologyRequirement
		available []string
		want      []string
		unordered bool // only the set of zones is specified
		code      codes.Code
	}{
		{name: "no requirement", req: nil, available: all, want: all},
		{name: "empty requirement", req: &csi.TopologyRequirement{}, available: all, want: all},
		{name: "requisite is a hard limit", req: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-b")}}, available: all,
			want: []string{"zone-b"}},
		{name: "requisite order kept", req: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-c"), topo("zone-a")}}, available: all,
			want: []string{"zone-c", "zone-a"}},
		{name: "preferred first, then the rest of requisite", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topo("zone-a"), topo("zone-b"), topo("zone-c")},
			Preferred: []*csi.Topology{topo("zone-c"), topo("zone-b")},
		}, available: all, want: []string{"zone-c", "zone-b", "zone-a"}},
		{name: "preferred outside requisite dropped", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topo("zone-a")},
			Preferred: []*csi.Topology{topo("zone-c")},
		}, available: all, want: []string{"zone-a"}},
		{name: "preferred only orders every zone", req: &csi.TopologyRequirement{
			Preferred: []*csi.Topology{topo("zone-c"), topo("zone-a")},
		}, available: all, want: []string{"zone-c", "zone-a", "zone-b"}},
		{name: "kubernetes segments with node keys", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topoNode("zone-b", "w1"), topoNode("zone-a", "w2"), topoNode("zone-b", "w3")},
			Preferred: []*csi.Topology{topoNode("zone-a", "w2"), topoNode("zone-b", "w1"), topoNode("zone-b", "w3")},
		}, available: all, want: []string{"zone-a", "zone-b"}},
		{name: "zones without pools dropped", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topo("zone-x"), topo("zone-b")},
			Preferred: []*csi.Topology{topo("zone-x")},
		}, available: all, want: []string{"zone-b"}},
		{name: "only zones without pools", req: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-x")}}, available: all,
			want: nil},
		{name: "no pools at all", req: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("zone-a")}}, available: nil, want: nil},
		{name: "requisite naming only a node: the node's zone", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topoNoZone()},
		}, available: all, want: []string{"zone-c"}},
		{name: "requisite naming only an unknown node: no zone", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topoUnknownNode()},
		}, available: all, want: nil},
		{name: "requisite segment with neither zone nor node allows all", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topoNeither()},
		}, available: all, want: all},
		{name: "requisite node segment next to a zoned one", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topo("zone-b"), topoNoZone()},
		}, available: all, want: []string{"zone-b", "zone-c"}},
		{name: "preferred segment without zone keeps earlier preference", req: &csi.TopologyRequirement{
			Preferred: []*csi.Topology{topo("zone-c"), topoNeither()},
		}, available: all, want: []string{"zone-c", "zone-a", "zone-b"}},
		{name: "preferred node segment within requisite", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topo("zone-a"), topo("zone-c")},
			Preferred: []*csi.Topology{topoNoZone()},
		}, available: all, want: []string{"zone-c", "zone-a"}},
		{name: "invalid requisite zone", req: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("../etc")}}, available: all,
			code: codes.InvalidArgument},
		{name: "empty requisite zone", req: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("")}}, available: all,
			code: codes.InvalidArgument},
		{name: "invalid preferred zone", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topo("zone-a")},
			Preferred: []*csi.Topology{topo("zone a")},
		}, available: all, code: codes.InvalidArgument},
		{name: "invalid zone after a segment without zone", req: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{topoNeither(), topo("zone/x")},
		}, available: all, code: codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			avail := slices.Clone(tt.available)
			got, err := candidateZones(tt.req, avail, map[string]string{"worker-9": "zone-c"})
			if !slices.Equal(avail, tt.available) {
				t.Errorf("candidateZones changed its available argument to %v", avail)
			}
			if tt.code != codes.OK {
				if status.Code(err) != tt.code {
					t.Fatalf("candidateZones = %v, %v; want code %v", got, err, tt.code)
				}
				return
			}
			if err != nil {
				t.Fatalf("candidateZones: %v", err)
			}
			if tt.unordered {
				got = slices.Sorted(slices.Values(got))
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("candidateZones = %v, want %v", got, tt.want)
			}
		})
	}
}

package driver

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
)

// TestVolumeFsType: the new volume's filesystem, and the restores refused
// because the content source is of another kind.
func TestVolumeFsType(t *testing.T) {
	snap := &backend.Source{SnapshotID: "block:zone-a:snap-x"}
	clone := &backend.Source{VolumeID: "block:zone-a:vol-x"}
	rawSrc := sourceFacts{accessType: accessmode.Block}
	xfsSrc := sourceFacts{accessType: accessmode.Mount, fsType: "xfs"}
	oldSnap := sourceFacts{} // a record made before snapshots kept their kind
	mount := func(fs string) capabilityRequest { return capabilityRequest{accessType: accessmode.Mount, fsType: fs} }
	raw := capabilityRequest{accessType: accessmode.Block}
	tests := []struct {
		name    string
		b       accessmode.Backend
		caps    capabilityRequest
		params  Params
		src     *backend.Source
		facts   sourceFacts
		want    string
		code    codes.Code
		mention string
	}{
		{"new, nothing named", accessmode.BackendBlock, mount(""), Params{}, nil, sourceFacts{}, DefaultFsType, codes.OK, ""},
		{"new, class names xfs", accessmode.BackendBlock, mount(""), Params{FsType: "xfs"}, nil, sourceFacts{}, "xfs", codes.OK, ""},
		{"class and capability disagree", accessmode.BackendBlock, mount("ext4"), Params{FsType: "xfs"}, nil, sourceFacts{}, "", codes.InvalidArgument, "disagrees"},
		{"raw block", accessmode.BackendBlock, raw, Params{}, nil, sourceFacts{}, "", codes.OK, ""},
		{"NFS has none", accessmode.BackendNFS, mount("ext4"), Params{}, nil, sourceFacts{}, "", codes.OK, ""},
		{"restore keeps xfs", accessmode.BackendBlock, mount(""), Params{}, snap, xfsSrc, "xfs", codes.OK, ""},
		{"clone keeps xfs", accessmode.BackendBlock, mount(""), Params{}, clone, xfsSrc, "xfs", codes.OK, ""},
		{"restore as the same fs", accessmode.BackendBlock, mount("xfs"), Params{}, snap, xfsSrc, "xfs", codes.OK, ""},
		{"restore as another fs", accessmode.BackendBlock, mount("ext4"), Params{}, snap, xfsSrc, "", codes.InvalidArgument, "xfs"},
		{"class names another fs", accessmode.BackendBlock, mount(""), Params{FsType: "ext4"}, clone, xfsSrc, "", codes.InvalidArgument, "ext4"},
		{"raw snapshot as a filesystem", accessmode.BackendBlock, mount(""), Params{}, snap, rawSrc, "", codes.InvalidArgument, "raw block"},
		{"filesystem snapshot as raw", accessmode.BackendBlock, raw, Params{}, snap, xfsSrc, "", codes.InvalidArgument, "xfs filesystem"},
		{"raw as raw", accessmode.BackendBlock, raw, Params{}, snap, rawSrc, "", codes.OK, ""},
		{"an old snapshot is not checked", accessmode.BackendBlock, mount("ext4"), Params{}, snap, oldSnap, "ext4", codes.OK, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := volumeFsType(tt.b, tt.caps, tt.params, tt.src, tt.facts, true)
			if status.Code(err) != tt.code {
				t.Fatalf("volumeFsType = %q, %v; want %s", got, err, tt.code)
			}
			if err != nil {
				if m := status.Convert(err).Message(); tt.mention != "" && !strings.Contains(m, tt.mention) {
					t.Errorf("message %q does not mention %q", m, tt.mention)
				}
				return
			}
			if got != tt.want {
				t.Errorf("volumeFsType = %q, want %q", got, tt.want)
			}
		})
	}
}

package driver

import (
	"maps"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

func TestParseParams(t *testing.T) {
	tests := []struct {
		name string
		in   map[string]string
		want Params
		// On error: the code and fragments the message must carry.
		code     codes.Code
		mentions []string
	}{
		{name: "nil", in: nil, want: Params{Backend: BackendAuto, RootSquash: true}},
		{name: "empty", in: map[string]string{}, want: Params{Backend: BackendAuto, RootSquash: true}},
		{name: "backend block", in: map[string]string{"backend": "block"}, want: Params{Backend: "block", RootSquash: true}},
		{name: "backend nfs", in: map[string]string{"backend": "nfs"}, want: Params{Backend: "nfs", RootSquash: true}},
		{name: "backend auto", in: map[string]string{"backend": "auto"}, want: Params{Backend: BackendAuto, RootSquash: true}},
		{name: "fsType ext4", in: map[string]string{"fsType": "ext4"}, want: Params{Backend: BackendAuto, FsType: "ext4", RootSquash: true}},
		{name: "fsType xfs with backend", in: map[string]string{"fsType": "xfs", "backend": "block"}, want: Params{Backend: "block", FsType: "xfs", RootSquash: true}},
		{name: "kubernetes fstype honoured", in: map[string]string{"csi.storage.k8s.io/fstype": "xfs"}, want: Params{Backend: BackendAuto, FsType: "xfs", RootSquash: true}},
		{name: "kubernetes fstype empty ignored", in: map[string]string{"csi.storage.k8s.io/fstype": ""}, want: Params{Backend: BackendAuto, RootSquash: true}},
		{name: "kubernetes keys accepted", in: map[string]string{
			"csi.storage.k8s.io/pvc/name":                     "data-0",
			"csi.storage.k8s.io/pvc/namespace":                "default",
			"csi.storage.k8s.io/pv/name":                      "pvc-123",
			"csi.storage.k8s.io/provisioner-secret-name":      "s",
			"csi.storage.k8s.io/provisioner-secret-namespace": "kube-system",
			"csi.storage.k8s.io/anything-new":                 "whatever value",
			"backend":                                         "block",
		}, want: Params{Backend: "block", RootSquash: true}},

		{name: "unknown key", in: map[string]string{"replicas": "3"}, code: codes.InvalidArgument,
			mentions: []string{`"replicas"`, "backend", "fsType", "csi.storage.k8s.io/"}},
		{name: "unknown key among good ones", in: map[string]string{"backend": "block", "fstype": "ext4"}, code: codes.InvalidArgument,
			mentions: []string{`"fstype"`, "backend", "fsType"}},
		{name: "key differs only in case", in: map[string]string{"Backend": "block"}, code: codes.InvalidArgument,
			mentions: []string{`"Backend"`, "accepted keys"}},
		{name: "prefix without slash is not kubernetes'", in: map[string]string{"csi.storage.k8s.io": "x"}, code: codes.InvalidArgument,
			mentions: []string{"accepted keys"}},
		{name: "other csi domain", in: map[string]string{"csi.storage.k8s.io.evil/x": "x"}, code: codes.InvalidArgument},
		{name: "empty key", in: map[string]string{"": "x"}, code: codes.InvalidArgument, mentions: []string{"accepted keys"}},
		{name: "bad backend", in: map[string]string{"backend": "ceph"}, code: codes.InvalidArgument,
			mentions: []string{"ceph", "block", "nfs", "auto"}},
		{name: "backend case", in: map[string]string{"backend": "Block"}, code: codes.InvalidArgument, mentions: []string{"Block"}},
		{name: "empty backend", in: map[string]string{"backend": ""}, code: codes.InvalidArgument},
		{name: "bad fsType", in: map[string]string{"fsType": "btrfs"}, code: codes.InvalidArgument,
			mentions: []string{"btrfs", "ext4", "xfs"}},
		{name: "fsType case", in: map[string]string{"fsType": "EXT4"}, code: codes.InvalidArgument, mentions: []string{"EXT4"}},
		{name: "rootSquash off", in: map[string]string{"backend": "nfs", "rootSquash": "false"}, want: Params{Backend: "nfs"}},
		{name: "rootSquash junk", in: map[string]string{"rootSquash": "maybe"}, code: codes.InvalidArgument,
			mentions: []string{"rootSquash", "maybe", "true, false"}},
		{name: "both fstype keys agree", in: map[string]string{"fsType": "xfs", "csi.storage.k8s.io/fstype": "xfs"},
			want: Params{Backend: BackendAuto, FsType: "xfs", RootSquash: true}},
		{name: "both fstype keys disagree", in: map[string]string{"fsType": "xfs", "csi.storage.k8s.io/fstype": "ext4"},
			code: codes.InvalidArgument, mentions: []string{"two filesystems", "xfs", "ext4"}},
		{name: "bad kubernetes fstype", in: map[string]string{"csi.storage.k8s.io/fstype": "ntfs"}, code: codes.InvalidArgument,
			mentions: []string{"ntfs", "ext4", "xfs"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseParams(tt.in)
			if tt.code == codes.OK {
				if err != nil {
					t.Fatalf("ParseParams(%v): %v", tt.in, err)
				}
				if got != tt.want {
					t.Errorf("ParseParams(%v) = %+v, want %+v", tt.in, got, tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("ParseParams(%v) = %+v, want %v", tt.in, got, tt.code)
			}
			if c := status.Code(err); c != tt.code {
				t.Errorf("code = %v, want %v (%v)", c, tt.code, err)
			}
			if got != (Params{}) {
				t.Errorf("on error ParseParams returned %+v, want the zero Params", got)
			}
			msg := status.Convert(err).Message()
			for _, m := range tt.mentions {
				if !strings.Contains(msg, m) {
					t.Errorf("message %q does not mention %q", msg, m)
				}
			}
		})
	}
}

// The message for an unknown key must list every accepted key, so a
// StorageClass author can fix the typo without reading the source.
func TestParseParamsUnknownKeyListsEveryAcceptedKey(t *testing.T) {
	_, err := ParseParams(map[string]string{"fs-type": "ext4"})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("code = %v, want InvalidArgument", status.Code(err))
	}
	msg := status.Convert(err).Message()
	for _, k := range acceptedParams {
		if !strings.Contains(msg, k) {
			t.Errorf("message %q does not list accepted key %q", msg, k)
		}
	}
	if len(acceptedParams) < 2 {
		t.Errorf("acceptedParams = %v; backend and fsType are documented keys", acceptedParams)
	}
}

func TestParseMutableParams(t *testing.T) {
	tests := []struct {
		name    string
		backend accessmode.Backend
		in      map[string]string
		want    map[string]string
		// On error: fragments the InvalidArgument message must carry.
		mentions []string
	}{
		{name: "none", backend: accessmode.BackendBlock, in: nil, want: nil},
		{name: "empty", backend: accessmode.BackendNFS, in: map[string]string{}, want: nil},
		{name: "read-ahead", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "512"},
			want: map[string]string{"readAheadKiB": "512"}},
		{name: "read-ahead canonical", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "0128"},
			want: map[string]string{"readAheadKiB": "128"}},
		{name: "read-ahead zero", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "0"},
			want: map[string]string{"readAheadKiB": "0"}},
		{name: "read-ahead at the bound", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "16384"},
			want: map[string]string{"readAheadKiB": "16384"}},
		{name: "root squash canonical", backend: accessmode.BackendNFS, in: map[string]string{"rootSquash": "FALSE"},
			want: map[string]string{"rootSquash": "false"}},
		{name: "root squash on", backend: accessmode.BackendNFS, in: map[string]string{"rootSquash": "1"},
			want: map[string]string{"rootSquash": "true"}},

		{name: "read-ahead above the bound", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "16385"},
			mentions: []string{"readAheadKiB", `"16385"`, "0 to 16384"}},
		{name: "read-ahead negative", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "-1"},
			mentions: []string{"readAheadKiB", `"-1"`}},
		{name: "read-ahead with a unit", backend: accessmode.BackendBlock, in: map[string]string{"readAheadKiB": "1Mi"},
			mentions: []string{"readAheadKiB", `"1Mi"`}},
		{name: "root squash junk", backend: accessmode.BackendNFS, in: map[string]string{"rootSquash": "maybe"},
			mentions: []string{"rootSquash", `"maybe"`, "true, false"}},
		{name: "unknown key", backend: accessmode.BackendBlock, in: map[string]string{"XXX_FakeKey": "XXX_FakeValue"},
			mentions: []string{`"XXX_FakeKey"`, "readAheadKiB (block)", "rootSquash (nfs)"}},
		{name: "creation parameter backend", backend: accessmode.BackendBlock, in: map[string]string{"backend": "nfs"},
			mentions: []string{`"backend"`, "fixed when a volume is created"}},
		{name: "creation parameter fsType", backend: accessmode.BackendBlock, in: map[string]string{"fsType": "xfs"},
			mentions: []string{`"fsType"`, "fixed when a volume is created"}},
		{name: "kubernetes key", backend: accessmode.BackendNFS, in: map[string]string{"csi.storage.k8s.io/pvc/name": "x"},
			mentions: []string{"csi.storage.k8s.io/pvc/name", "fixed when a volume is created"}},
		{name: "nfs key on block", backend: accessmode.BackendBlock, in: map[string]string{"rootSquash": "false"},
			mentions: []string{`"rootSquash"`, "nfs volumes", "block volume", "readAheadKiB"}},
		{name: "block key on nfs", backend: accessmode.BackendNFS, in: map[string]string{"readAheadKiB": "256"},
			mentions: []string{`"readAheadKiB"`, "block volumes", "nfs volume", "rootSquash"}},
		{name: "one bad key among good ones", backend: accessmode.BackendBlock,
			in: map[string]string{"readAheadKiB": "256", "replicas": "3"}, mentions: []string{`"replicas"`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseMutableParams(tc.backend, tc.in)
			if tc.mentions == nil {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				if !maps.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
					t.Fatalf("got %v, want %v", got, tc.want)
				}
				return
			}
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("got %v, %v; want InvalidArgument", got, err)
			}
			for _, m := range tc.mentions {
				if !strings.Contains(status.Convert(err).Message(), m) {
					t.Errorf("message %q does not mention %q", status.Convert(err).Message(), m)
				}
			}
		})
	}
}

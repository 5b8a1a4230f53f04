package driver

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

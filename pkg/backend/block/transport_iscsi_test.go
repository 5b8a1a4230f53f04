// This file holds the tests of the iSCSI transport that run without a
// target: what a node checks before it logs in anywhere. The login and
// everything after it run in VMs (test/vm/lio).

package block

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// A node that reaches volumes over iSCSI does not start without a CHAP
// user its node key can be, and a secret it can read and use.
func TestNewNetworkNodeChecksItsCredentials(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", "a-good-chap-secret\n")
	for _, tc := range []struct {
		name, user, file, want string
	}{
		{"fine", "worker-1", good, ""},
		{"a user CHAP cannot carry", "worker 1", good, "cannot be a CHAP user name"},
		{"no secret file", "worker-1", filepath.Join(dir, "missing"), "reading this node's CHAP secret"},
		{"a short secret", "worker-1", write("short", "short\n"), "not 12 to 255 printable"},
		{"a secret with a blank", "worker-1", write("blank", "has a blank in it\n"), "not 12 to 255 printable"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := NewNetworkNode(nil, ISCSI{User: tc.user, SecretFile: tc.file})
			if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("NewNetworkNode = %v, want %q", err, tc.want)
			}
			if err == nil && (n.network[iscsi.TransportName].(*iscsiTransport).DiskTimeout <= 0 || len(n.loop.pools) != 0) {
				t.Fatalf("node %+v: no default disk timeout, or pools it was not given", n)
			}
		})
	}
}

// What a stage over iSCSI refuses before it logs in anywhere: a volume
// context that names another volume's disk or is not iSCSI's, a node
// without an initiator, a publish context without the volume's size.
// (The login and everything after it run in VMs: test/vm/lio.)
func TestStageOverISCSIRefusesBeforeLoggingIn(t *testing.T) {
	id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "net"))
	if err != nil {
		t.Fatal(err)
	}
	other, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "other"))
	v := iscsi.Volume{Target: "iqn.2026-11.dev.example:mg-1", Portal: netip.MustParseAddrPort("10.0.0.5:3260"), Serial: iscsi.VolumeSerial(id.String())}
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("a-good-chap-secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	network, err := NewNetworkNode(nil, ISCSI{User: "worker-1", SecretFile: secret})
	if err != nil {
		t.Fatal(err)
	}
	plain := newNode(map[string]*pool{}, nil)
	with := func(k, val string) map[string]string {
		c := v.Context()
		c[k] = val
		return c
	}
	req := func(ctx map[string]string, capacity int64) backend.StageRequest {
		return backend.StageRequest{VolumeID: id, Node: nodeid.MustParse("worker-1@zone-a"), StagingPath: "/var/lib/kubelet/staging/x",
			AccessType: accessmode.Mount, FsType: "ext4", CapacityBytes: capacity, VolumeContext: ctx}
	}
	for _, tc := range []struct {
		name string
		node *Node
		req  backend.StageRequest
		code codes.Code
		says string
	}{
		{"another volume's serial", network, req(with(iscsi.ContextSerial, iscsi.VolumeSerial(other.String())), 64<<20), codes.InvalidArgument, "is not volume"},
		{"another transport", network, req(with(iscsi.ContextTransport, "nbd"), 64<<20), codes.InvalidArgument, "the only network transport"},
		{"no initiator here", plain, req(v.Context(), 64<<20), codes.FailedPrecondition, "--iscsi-initiator-name-file"},
		{"no capacity published", network, req(v.Context(), 0), codes.FailedPrecondition, "names no capacity"},
		{"a filesystem the driver does not make", network, func() backend.StageRequest { r := req(v.Context(), 64<<20); r.FsType = "ntfs"; return r }(),
			codes.InvalidArgument, "not supported"},
		{"a relative staging path", network, func() backend.StageRequest { r := req(v.Context(), 64<<20); r.StagingPath = "staging"; return r }(),
			codes.InvalidArgument, "staging path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.node.Stage(context.Background(), tc.req)
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.says) {
				t.Fatalf("Stage = %v, want %s saying %q", err, tc.code, tc.says)
			}
		})
	}
}

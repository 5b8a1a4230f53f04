package nfs

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// These tests stand in for the kernel's NFS client, which this machine's
// kernel lacks: a fake mounter records what would be mounted. The real
// kernel mount is tested inside a VM (test/vm).

func stageRequest(t *testing.T, volCtx map[string]string, flags []string, readOnly bool) backend.StageRequest {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, strings.Repeat("ab", 16))
	if err != nil {
		t.Fatal(err)
	}
	return backend.StageRequest{
		VolumeID: id, Node: nodeid.MustParse("n1@zone-a@10.0.0.11"), StagingPath: filepath.Join(t.TempDir(), "staging"),
		AccessType: accessmode.Mount, MountFlags: flags, ReadOnly: readOnly, VolumeContext: volCtx,
	}
}

// goodShare is the export of the volume stageRequest stages.
var goodShare = "/nfs__vol-" + strings.Repeat("ab", 16)

var goodContext = map[string]string{ContextServer: "10.99.0.1", ContextShare: goodShare, ContextPort: "2049"}

// fakeTable is the mount table of a fake mounter: what it "mounted".
type fakeTable struct{ fake *mount.FakeMounter }

func (t fakeTable) At(path string) (*mounts.Mount, error) {
	var found *mounts.Mount
	for _, mp := range t.fake.MountPoints {
		if mp.Path == path {
			found = &mounts.Mount{Mountpoint: mp.Path, Source: mp.Device, FSType: mp.Type, Root: "/"}
		}
	}
	return found, nil
}

func newFakeNode(fake *mount.FakeMounter) *Node { return NewNode(fake, fakeTable{fake}) }

func TestStageWithFakeKernelMount(t *testing.T) {
	tests := []struct {
		name     string
		volCtx   map[string]string
		flags    []string
		readOnly bool
		source   string
		want     []string // options that must be there
		notWant  []string
		last     string // the option that must come last, if any
		code     codes.Code
	}{
		{name: "defaults", volCtx: goodContext, source: "10.99.0.1:" + goodShare,
			want:    []string{"vers=4.2", "proto=tcp", "hard", "timeo=600", "retrans=2", "nosharecache", "addr=10.99.0.1", "clientaddr=10.0.0.11"},
			notWant: []string{"ro", "port=2049"}},
		{name: "CO sets clientaddr", volCtx: goodContext, flags: []string{"clientaddr=10.0.0.99"}, source: "10.99.0.1:" + goodShare,
			want: []string{"clientaddr=10.0.0.99"}, notWant: []string{"clientaddr=10.0.0.11"}},
		{name: "CO flags override a default", volCtx: goodContext, flags: []string{"vers=4.1", "noatime"}, source: "10.99.0.1:" + goodShare,
			want: []string{"vers=4.1", "noatime", "hard"}, notWant: []string{"vers=4.2"}},
		{name: "nfsvers counts as vers", volCtx: goodContext, flags: []string{"nfsvers=4.0"}, source: "10.99.0.1:" + goodShare,
			want: []string{"nfsvers=4.0"}, notWant: []string{"vers=4.2"}},
		{name: "comma-joined flags", volCtx: goodContext, flags: []string{"soft,timeo=100"}, source: "10.99.0.1:" + goodShare,
			want: []string{"soft", "timeo=100"}, notWant: []string{"timeo=600"}},
		{name: "read-only wins over rw", volCtx: goodContext, flags: []string{"rw"}, readOnly: true, source: "10.99.0.1:" + goodShare,
			want: []string{"ro"}, notWant: []string{"rw"}},
		{name: "read-only last after a flag that means rw", volCtx: goodContext, flags: []string{"ro", "defaults"}, readOnly: true,
			source: "10.99.0.1:" + goodShare, last: "ro"},
		{name: "sharecache refused", volCtx: goodContext, flags: []string{"noatime,sharecache"}, code: codes.InvalidArgument},
		{name: "nosharecache from the CO", volCtx: goodContext, flags: []string{"nosharecache"}, source: "10.99.0.1:" + goodShare,
			want: []string{"nosharecache"}},
		{name: "other port", volCtx: map[string]string{ContextServer: "10.99.0.1", ContextShare: goodShare, ContextPort: "20490"},
			source: "10.99.0.1:" + goodShare, want: []string{"port=20490"}},
		{name: "IPv6 server", volCtx: map[string]string{ContextServer: "fd00::1", ContextShare: goodShare}, source: "[fd00::1]:" + goodShare},
		{name: "another volume's share", volCtx: map[string]string{ContextServer: "10.99.0.1", ContextShare: "/nfs__vol-" + strings.Repeat("cd", 16)}, code: codes.InvalidArgument},
		{name: "the export root", volCtx: map[string]string{ContextServer: "10.99.0.1", ContextShare: "/"}, code: codes.InvalidArgument},
		{name: "server is a name", volCtx: map[string]string{ContextServer: "nfs.example", ContextShare: "/v"}, code: codes.InvalidArgument},
		{name: "server injects options", volCtx: map[string]string{ContextServer: "10.0.0.1,vers=3", ContextShare: "/v"}, code: codes.InvalidArgument},
		{name: "share escapes", volCtx: map[string]string{ContextServer: "10.0.0.1", ContextShare: "/../etc"}, code: codes.InvalidArgument},
		{name: "share with a space", volCtx: map[string]string{ContextServer: "10.0.0.1", ContextShare: "/a b"}, code: codes.InvalidArgument},
		{name: "no context", volCtx: nil, code: codes.InvalidArgument},
		{name: "bad port", volCtx: map[string]string{ContextServer: "10.0.0.1", ContextShare: "/v", ContextPort: "99999"}, code: codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fake := mount.NewFakeMounter(nil)
			n := newFakeNode(fake)
			staged, err := n.Stage(context.Background(), stageRequest(t, tt.volCtx, tt.flags, tt.readOnly))
			if tt.code != codes.OK {
				if status.Code(err) != tt.code {
					t.Fatalf("Stage: got %v, want %s", err, tt.code)
				}
				if len(fake.MountPoints) != 0 {
					t.Fatalf("a refused stage mounted %v", fake.MountPoints)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(fake.MountPoints) != 1 {
				t.Fatalf("want one mount, got %v", fake.MountPoints)
			}
			mp := fake.MountPoints[0]
			if mp.Device != tt.source || mp.Type != "nfs4" || mp.Path != staged.StagingPath {
				t.Errorf("mounted %s (%s) at %s, want %s (nfs4) at %s", mp.Device, mp.Type, mp.Path, tt.source, staged.StagingPath)
			}
			for _, o := range tt.want {
				if !slices.Contains(mp.Opts, o) {
					t.Errorf("options %v lack %q", mp.Opts, o)
				}
			}
			for _, o := range tt.notWant {
				if slices.Contains(mp.Opts, o) {
					t.Errorf("options %v have %q", mp.Opts, o)
				}
			}
			if tt.last != "" && mp.Opts[len(mp.Opts)-1] != tt.last {
				t.Errorf("options %v do not end in %q", mp.Opts, tt.last)
			}
			if staged.ReadOnly != tt.readOnly {
				t.Errorf("staged read-only %v, want %v", staged.ReadOnly, tt.readOnly)
			}
		})
	}
}

func TestStageRetryAndUnstageWithFakeKernelMount(t *testing.T) {
	fake := mount.NewFakeMounter(nil)
	n := newFakeNode(fake)
	req := stageRequest(t, goodContext, nil, false)
	// The controller names the export after the volume.
	req.VolumeContext = map[string]string{ContextServer: "10.99.0.1", ContextShare: "/" + req.VolumeID.FileName()}
	staged, err := n.Stage(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	checkState(t, n, staged, backend.StageIntact)
	if ours, err := n.Owns(context.Background(), req.VolumeID, &mounts.Mount{FSType: "nfs4", Source: staged.Source}); err != nil || !ours {
		t.Errorf("Owns(the volume's own mount) = %v, %v", ours, err)
	}
	if ours, _ := n.Owns(context.Background(), req.VolumeID, &mounts.Mount{FSType: "nfs4", Source: "10.99.0.1:/nfs__other"}); ours {
		t.Error("Owns claims another export's mount")
	}
	if ours, _ := n.Owns(context.Background(), req.VolumeID, &mounts.Mount{FSType: "xfs", Source: "/dev/sda1"}); ours {
		t.Error("Owns claims a local filesystem")
	}
	if _, err := n.Stage(context.Background(), req); err != nil {
		t.Fatalf("a retried stage of the same export must succeed: %v", err)
	}
	if len(fake.MountPoints) != 1 {
		t.Fatalf("a retried stage mounted again: %v", fake.MountPoints)
	}
	other := req
	other.VolumeContext = map[string]string{ContextServer: "10.99.0.2", ContextShare: goodShare}
	if _, err := n.Stage(context.Background(), other); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("staging another export over a mounted staging path: got %v, want AlreadyExists", err)
	}
	if h := n.Health(context.Background(), staged); h.Abnormal {
		t.Errorf("healthy stage reported %+v", h)
	}
	if err := n.Unstage(context.Background(), staged); err != nil {
		t.Fatal(err)
	}
	if len(fake.MountPoints) != 0 {
		t.Fatalf("unstage left %v", fake.MountPoints)
	}
	checkState(t, n, staged, backend.StageGone)
	// Another export where the stage should be: neither this volume's
	// stage nor gone.
	if err := fake.Mount("10.99.0.2:/nfs__other", staged.StagingPath, "nfs4", nil); err != nil {
		t.Fatal(err)
	}
	checkState(t, n, staged, backend.StageBroken)
	if err := n.Unstage(context.Background(), staged); err != nil || len(fake.MountPoints) != 1 {
		t.Fatalf("Unstage removed another export's mount (%v) or failed: %v", fake.MountPoints, err)
	}
	if err := fake.Unmount(staged.StagingPath); err != nil {
		t.Fatal(err)
	}
	if h := n.Health(context.Background(), staged); !h.Abnormal || h.Reason != "NotMounted" {
		t.Errorf("after unstage, health = %+v, want NotMounted", h)
	}
	if err := n.Unstage(context.Background(), staged); err != nil {
		t.Fatalf("a repeated unstage must succeed: %v", err)
	}
}

func TestStageRefusesRawBlock(t *testing.T) {
	n := newFakeNode(mount.NewFakeMounter(nil))
	req := stageRequest(t, goodContext, nil, false)
	req.AccessType = accessmode.Block
	if _, err := n.Stage(context.Background(), req); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("raw block on NFS: got %v, want InvalidArgument", err)
	}
}

func checkState(t *testing.T, n *Node, staged *backend.Staged, want backend.StageState) {
	t.Helper()
	c, err := n.Check(context.Background(), staged)
	if err != nil || c.State != want {
		t.Errorf("Check = %+v, %v; want state %d", c, err, want)
	}
}

package integration

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/test/testenv"
)

func nfsCapability(mode accessmode.Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
}

// startNFSControllerIn starts a controller with the NFS backend, its data
// and its ganesha's files under work, and stops it at the end of the test,
// failing it for every mount left under work.
func startNFSControllerIn(ctx context.Context, t *testing.T, bin string, net *ganeshatest.Network, work string, args ...string) (ctrl *testenv.Controller, gdir string) {
	t.Helper()
	gdir = filepath.Join(work, "ganesha")
	ctrl = testenv.NewController(t, bin, net.Server.Path, work, append([]string{"--roles", "controller", "-v", "2",
		"--nfs-export-root", filepath.Join(work, "nfs"),
		"--nfs-server", net.Server.Addr.String(), "--nfs-ganesha-dir", gdir}, args...)...)
	ctrl.Start(ctx)
	t.Cleanup(func() {
		ctrl.Stop()
		for _, m := range localcluster.MountsUnder(work) {
			t.Errorf("leftover mount %s after the controller stopped", m)
		}
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log:\n%s", testenv.ReadFile(ctrl.Log))
		}
	})
	return ctrl, gdir
}

// TestNFSExportsFollowPublishes checks, with the real ganesha and real NFS
// clients in node namespaces, that an export is open to exactly the nodes
// its volume is published to, as the access mode says.
func TestNFSExportsFollowPublishes(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.xfs", "xfs_quota")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 2, Prefix: "mgi"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	ctrl, gdir := startNFSControllerIn(ctx, t, bin, net, work, "--nfs-pool-size", "1Gi")

	n1, n2 := net.Nodes[0], net.Nodes[1]
	nodeID := func(i int) string {
		n := net.Nodes[i]
		return nodeid.Node{Name: fmt.Sprintf("node-%d", i+1), Zone: "zone-a", Address: n.Addr.String()}.String()
	}
	payload := filepath.Join(work, "payload")
	if err := os.WriteFile(payload, []byte("written over NFS"), 0o644); err != nil {
		t.Fatal(err)
	}

	create := func(t *testing.T, name string, mode accessmode.Mode, bytes int64, src *csi.VolumeContentSource) *csi.Volume {
		t.Helper()
		resp, err := ctrl.CSI.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: bytes},
			VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(mode)},
			Parameters:         map[string]string{"backend": "nfs"}, VolumeContentSource: src,
		})
		if err != nil {
			t.Fatalf("CreateVolume %s: %v", name, err)
		}
		if len(resp.GetVolume().GetAccessibleTopology()) != 0 {
			t.Errorf("an NFS volume must be reachable from every zone, got topology %v", resp.GetVolume().GetAccessibleTopology())
		}
		return resp.GetVolume()
	}
	publish := func(vol *csi.Volume, mode accessmode.Mode, node int, readOnly bool) error {
		_, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: vol.GetVolumeId(), NodeId: nodeID(node), VolumeCapability: nfsCapability(mode), Readonly: readOnly,
		})
		return err
	}
	unpublish := func(t *testing.T, vol *csi.Volume, node int) {
		t.Helper()
		if _, err := ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
			VolumeId: vol.GetVolumeId(), NodeId: nodeID(node)}); err != nil {
			t.Fatal(err)
		}
	}
	deleteVol := func(t *testing.T, vol *csi.Volume) {
		t.Helper()
		if _, err := ctrl.CSI.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
	}
	share := func(vol *csi.Volume) string { return vol.GetVolumeContext()[nfs.ContextShare] }
	canWrite := func(ns ganeshatest.Namespace, vol *csi.Volume, file string) error {
		return ns.NFSCopy(ctx, payload, net.NFSURL(share(vol), file))
	}
	mustWrite := func(t *testing.T, ns ganeshatest.Namespace, vol *csi.Volume, file string) {
		t.Helper()
		if err := canWrite(ns, vol, file); err != nil {
			t.Fatalf("%s could not write %s: %v", ns.Name, file, err)
		}
	}
	mustNotWrite := func(t *testing.T, ns ganeshatest.Namespace, vol *csi.Volume, file string) {
		t.Helper()
		if err := canWrite(ns, vol, file); err == nil {
			t.Fatalf("%s wrote %s, but the volume is not published read/write to it", ns.Name, file)
		}
	}
	mustRead := func(t *testing.T, ns ganeshatest.Namespace, vol *csi.Volume, file string) {
		t.Helper()
		got, err := ns.NFSCat(ctx, net.NFSURL(share(vol), file))
		if err != nil || !bytes.Equal(got, []byte("written over NFS")) {
			t.Fatalf("%s reading %s: %q, %v", ns.Name, file, got, err)
		}
	}
	mustNotRead := func(t *testing.T, ns ganeshatest.Namespace, vol *csi.Volume, file string) {
		t.Helper()
		if got, err := ns.NFSCat(ctx, net.NFSURL(share(vol), file)); err == nil {
			t.Fatalf("%s read %s (%q), but the volume is not published to it", ns.Name, file, got)
		}
	}
	wantCode := func(t *testing.T, what string, err error, code codes.Code) {
		t.Helper()
		if status.Code(err) != code {
			t.Fatalf("%s: got %v, want %s", what, err, code)
		}
	}

	t.Run("single node writer: one node, and unpublish takes access away at once", func(t *testing.T) {
		vol := create(t, "rwo", accessmode.SingleNodeMultiWriter, 32<<20, nil)
		mustNotWrite(t, n1, vol, "before-publish")
		wantCode(t, "publish to node-1", publish(vol, accessmode.SingleNodeMultiWriter, 0, false), codes.OK)
		mustWrite(t, n1, vol, "f")
		mustNotRead(t, n2, vol, "f")
		err := publish(vol, accessmode.SingleNodeMultiWriter, 1, false)
		wantCode(t, "publish to a second node", err, codes.FailedPrecondition)
		if !strings.Contains(status.Convert(err).Message(), nodeID(0)) {
			t.Errorf("the refusal should name the node holding the volume: %v", err)
		}
		unpublish(t, vol, 0)
		mustNotRead(t, n1, vol, "f")
		wantCode(t, "publish to node-2 after unpublish", publish(vol, accessmode.SingleNodeMultiWriter, 1, false), codes.OK)
		mustRead(t, n2, vol, "f")
		unpublish(t, vol, 1)
		deleteVol(t, vol)
	})

	t.Run("read only many: every node reads, none writes", func(t *testing.T) {
		src := create(t, "rox-src", accessmode.SingleNodeMultiWriter, 32<<20, nil)
		wantCode(t, "publish source", publish(src, accessmode.SingleNodeMultiWriter, 0, false), codes.OK)
		mustWrite(t, n1, src, "data")
		unpublish(t, src, 0)
		snap, err := ctrl.CSI.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "rox-snap", SourceVolumeId: src.GetVolumeId()})
		if err != nil {
			t.Fatal(err)
		}
		vol := create(t, "rox", accessmode.MultiNodeReaderOnly, 32<<20, &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}})
		for i, ns := range net.Nodes {
			wantCode(t, "publish ROX asking for read/write", publish(vol, accessmode.MultiNodeReaderOnly, i, false), codes.OK)
			mustRead(t, ns, vol, "data")
			mustNotWrite(t, ns, vol, "data")
		}
		unpublish(t, vol, 0)
		unpublish(t, vol, 1)
		deleteVol(t, vol)
		if _, err := ctrl.CSI.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
			t.Fatal(err)
		}
		deleteVol(t, src)
	})

	t.Run("multi node single writer: exactly one writer", func(t *testing.T) {
		vol := create(t, "mnsw", accessmode.MultiNodeSingleWriter, 32<<20, nil)
		wantCode(t, "writer on node-1", publish(vol, accessmode.MultiNodeSingleWriter, 0, false), codes.OK)
		wantCode(t, "second writer on node-2", publish(vol, accessmode.MultiNodeSingleWriter, 1, false), codes.FailedPrecondition)
		wantCode(t, "reader on node-2", publish(vol, accessmode.MultiNodeSingleWriter, 1, true), codes.OK)
		mustWrite(t, n1, vol, "log")
		mustRead(t, n2, vol, "log")
		mustNotWrite(t, n2, vol, "log")
		unpublish(t, vol, 0)
		unpublish(t, vol, 1)
		deleteVol(t, vol)
	})

	t.Run("read write many: both nodes write", func(t *testing.T) {
		vol := create(t, "rwx", accessmode.MultiNodeMultiWriter, 32<<20, nil)
		for i, ns := range net.Nodes {
			wantCode(t, "publish RWX", publish(vol, accessmode.MultiNodeMultiWriter, i, false), codes.OK)
			mustWrite(t, ns, vol, ns.Name)
		}
		mustRead(t, n1, vol, n2.Name)
		mustRead(t, n2, vol, n1.Name)
		unpublish(t, vol, 0)
		unpublish(t, vol, 1)
		deleteVol(t, vol)
	})

	t.Run("a full volume refuses more data, and expansion makes room online", func(t *testing.T) {
		vol := create(t, "small", accessmode.SingleNodeMultiWriter, 8<<20, nil)
		wantCode(t, "publish", publish(vol, accessmode.SingleNodeMultiWriter, 0, false), codes.OK)
		// libnfs-utils (Debian 12) cannot encode a WRITE larger than about
		// 4 KiB, so the volume is filled on the server, as an administrator
		// would, leaving less room than the client's next write needs.
		serverDir := filepath.Join(work, "nfs", "volumes", strings.TrimPrefix(share(vol), "/"))
		filler, err := os.Create(filepath.Join(serverDir, "filler"))
		if err != nil {
			t.Fatal(err)
		}
		// Fill in ever smaller pieces until not one block is free.
		var offset int64
		for _, piece := range []int64{16 << 20, 1 << 20, 64 << 10, 4 << 10} {
			for unix.Fallocate(int(filler.Fd()), 0, offset, piece) == nil {
				offset += piece
			}
		}
		filler.Close()
		if offset < 100<<20 {
			t.Fatalf("filled only %d bytes of a %d-byte volume", offset, vol.GetCapacityBytes())
		}
		chunk := filepath.Join(work, "chunk")
		if err := os.WriteFile(chunk, bytes.Repeat([]byte("z"), 2000), 0o644); err != nil {
			t.Fatal(err)
		}
		err = n1.NFSCopy(ctx, chunk, net.NFSURL(share(vol), "one-more")+"&debug=1")
		if err == nil {
			t.Fatal("a write into a full volume went through")
		}
		if !strings.Contains(err.Error(), "NOSPC") && !strings.Contains(err.Error(), "DQUOT") {
			t.Fatalf("the write failed, but not for want of space: %v", err)
		}
		resp, err := ctrl.CSI.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
			VolumeId: vol.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: vol.GetCapacityBytes() + 64<<20}})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetNodeExpansionRequired() {
			t.Error("an NFS volume needs no node expansion: the server's limit is what clients see")
		}
		if err := n1.NFSCopy(ctx, chunk, net.NFSURL(share(vol), "after-expansion")); err != nil {
			t.Fatalf("after expansion by 64 MiB, a 2000-byte write still failed: %v", err)
		}
		unpublish(t, vol, 0)
		deleteVol(t, vol)
	})

	t.Run("rootSquash changed by ControllerModifyVolume holds for the next write at once", func(t *testing.T) {
		vol := create(t, "squash", accessmode.SingleNodeMultiWriter, 16<<20, nil)
		wantCode(t, "publish to node-1", publish(vol, accessmode.SingleNodeMultiWriter, 0, false), codes.OK)
		// ownerOf is the owner of a file the node wrote as root, read on
		// the server from the directory ganesha exports.
		ownerOf := func(t *testing.T, file string) uint32 {
			t.Helper()
			exports, err := testenv.NFSControl(t, gdir).Exports(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range exports {
				if e.Pseudo == share(vol) {
					var st syscall.Stat_t
					if err := syscall.Stat(filepath.Join(e.Path, file), &st); err != nil {
						t.Fatal(err)
					}
					return st.Uid
				}
			}
			t.Fatalf("ganesha does not export %s", share(vol))
			return 0
		}
		modify := func(t *testing.T, squash string) {
			t.Helper()
			if _, err := ctrl.CSI.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{
				VolumeId: vol.GetVolumeId(), MutableParameters: map[string]string{"rootSquash": squash}}); err != nil {
				t.Fatalf("ControllerModifyVolume rootSquash=%s: %v", squash, err)
			}
		}
		const anonymous = 1<<32 - 2 // ganesha's default Anonymous_Uid, -2
		mustWrite(t, n1, vol, "squashed")
		if uid := ownerOf(t, "squashed"); uid != anonymous {
			t.Fatalf("a file root wrote with root squashed belongs to uid %d, want %d", uid, anonymous)
		}
		modify(t, "false")
		mustWrite(t, n1, vol, "as-root")
		if uid := ownerOf(t, "as-root"); uid != 0 {
			t.Fatalf("a file root wrote after rootSquash=false belongs to uid %d, want 0", uid)
		}
		modify(t, "true")
		mustWrite(t, n1, vol, "squashed-again")
		if uid := ownerOf(t, "squashed-again"); uid != anonymous {
			t.Fatalf("a file root wrote after rootSquash=true again belongs to uid %d, want %d", uid, anonymous)
		}
		_, err := ctrl.CSI.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{
			VolumeId: vol.GetVolumeId(), MutableParameters: map[string]string{"readAheadKiB": "256"}})
		wantCode(t, "a block attribute on an NFS volume", err, codes.InvalidArgument)
		unpublish(t, vol, 0)
		deleteVol(t, vol)
	})

	t.Run("restart restores every export exactly and removes stale ones", func(t *testing.T) {
		kept := create(t, "kept", accessmode.SingleNodeMultiWriter, 16<<20, nil)
		wantCode(t, "publish kept to node-2", publish(kept, accessmode.SingleNodeMultiWriter, 1, false), codes.OK)
		mustWrite(t, n2, kept, "before-crash")
		gone := create(t, "gone", accessmode.MultiNodeMultiWriter, 16<<20, nil)
		wantCode(t, "publish gone to node-1", publish(gone, accessmode.MultiNodeMultiWriter, 0, false), codes.OK)
		mustWrite(t, n1, gone, "f")

		// The controller alone is killed; its ganesha and bus die with it.
		oldG, oldB := testenv.NFSServerPIDs(t, gdir)
		ctrl.Kill()
		testenv.WaitNFSServerGone(t, gdir, oldG, oldB)
		// While the controller is down, the record of "gone" disappears,
		// as after a crash in the middle of deleting it.
		// The records live in the storage's root: the export root itself
		// (images) or the pool mounted in it (quota).
		records, _ := filepath.Glob(filepath.Join(work, "nfs", "meta", "volumes", "*.json"))
		quotaRecords, _ := filepath.Glob(filepath.Join(work, "nfs", "pool", "meta", "volumes", "*.json"))
		records = append(records, quotaRecords...)
		removed := false
		for _, r := range records {
			if strings.Contains(testenv.ReadFile(r), gone.GetVolumeId()) {
				if err := os.Remove(r); err != nil {
					t.Fatal(err)
				}
				removed = true
			}
		}
		if !removed {
			t.Fatalf("no record of %s among %v", gone.GetVolumeId(), records)
		}
		ctrl.Start(ctx)

		// The nodes' clients are in the recovery database the new ganesha
		// read from the same directory: it is in grace, and a new open
		// (libnfs does not reclaim) waits for its end.
		control := testenv.NFSControl(t, gdir)
		if in, err := control.InGrace(ctx); err != nil || !in {
			t.Fatalf("after a restart with known clients ganesha is not in grace (%v, %v): the recovery database was lost", in, err)
		}
		if err := canWrite(n2, kept, "during-grace"); err == nil || !strings.Contains(err.Error(), "NFS4ERR_GRACE") {
			t.Fatalf("a new open during grace: %v, want NFS4ERR_GRACE", err)
		}
		testenv.WaitGraceEnded(ctx, t, gdir)
		mustRead(t, n2, kept, "before-crash")
		mustWrite(t, n2, kept, "after-restart")
		mustNotRead(t, n1, kept, "before-crash")
		mustNotRead(t, n1, gone, "f")
		unpublish(t, kept, 1)
		deleteVol(t, kept)
	})

	t.Run("a volume published nowhere at a restart is served again at its next publish", func(t *testing.T) {
		idle := create(t, "idle-at-restart", accessmode.SingleNodeMultiWriter, 16<<20, nil)
		wantCode(t, "publish idle to node-1", publish(idle, accessmode.SingleNodeMultiWriter, 0, false), codes.OK)
		mustWrite(t, n1, idle, "f")
		unpublish(t, idle, 0)

		ctrl.Stop() // graceful: the image storage unmounts every image
		ctrl.Start(ctx)
		testenv.WaitGraceEnded(ctx, t, gdir)
		// Not published: neither exported nor (image storage) mounted.
		for _, m := range localcluster.MountsUnder(work) {
			if strings.HasSuffix(m, "/"+strings.TrimPrefix(share(idle), "/")) {
				t.Errorf("%s is mounted after a restart although no node holds it", m)
			}
		}
		if _, err := os.Stat(filepath.Join(gdir, "exports", strings.TrimPrefix(share(idle), "/")+".conf")); !os.IsNotExist(err) {
			t.Errorf("the export file of a volume no node holds is there after a restart: %v", err)
		}
		mustNotRead(t, n2, idle, "f")
		wantCode(t, "publish idle to node-2", publish(idle, accessmode.SingleNodeMultiWriter, 1, false), codes.OK)
		mustRead(t, n2, idle, "f")
		mustWrite(t, n2, idle, "g")
		mustNotRead(t, n1, idle, "f")
		unpublish(t, idle, 1)
		deleteVol(t, idle)
	})

	t.Run("controller, ganesha and its bus killed together restore every export", func(t *testing.T) {
		vol := create(t, "together", accessmode.SingleNodeMultiWriter, 16<<20, nil)
		wantCode(t, "publish to node-2", publish(vol, accessmode.SingleNodeMultiWriter, 1, false), codes.OK)
		mustWrite(t, n2, vol, "before-crash")
		// As when the controller's container is killed: every process of
		// it dies at once, by SIGKILL, with nothing cleaned up.
		g, b := testenv.NFSServerPIDs(t, gdir)
		for _, pid := range []int{g, b} {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatalf("killing %d: %v", pid, err)
			}
		}
		ctrl.Kill()
		ctrl.Start(ctx)

		testenv.WaitGraceEnded(ctx, t, gdir)
		mustRead(t, n2, vol, "before-crash")
		mustWrite(t, n2, vol, "after-restart")
		mustNotRead(t, n1, vol, "before-crash")
		unpublish(t, vol, 1)
		deleteVol(t, vol)
	})
}

// TestNFSExt4ImageVolumes serves volumes of ext4 images through the real
// ganesha to a real client: written, snapshotted into a new volume, served
// again after a restart that mounted neither until their publish.
func TestNFSExt4ImageVolumes(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nsenter", "mkfs.ext4")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1, Prefix: "mge"})
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ctrl, gdir := startNFSControllerIn(ctx, t, bin, net, work, "--nfs-storage", "images", "--nfs-image-filesystem", "ext4")
	node := nodeid.Node{Name: "node-1", Zone: "zone-a", Address: net.Nodes[0].Addr.String()}.String()
	mode := accessmode.SingleNodeMultiWriter
	payload := filepath.Join(work, "payload")
	if err := os.WriteFile(payload, []byte("on ext4"), 0o644); err != nil {
		t.Fatal(err)
	}
	create := func(name string, src *csi.VolumeContentSource) *csi.Volume {
		t.Helper()
		resp, err := ctrl.CSI.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{nfsCapability(mode)},
			Parameters:         map[string]string{"backend": "nfs"}, VolumeContentSource: src,
		})
		if err != nil {
			t.Fatalf("CreateVolume %s: %v", name, err)
		}
		return resp.GetVolume()
	}
	publish := func(vol *csi.Volume) {
		t.Helper()
		if _, err := ctrl.CSI.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: vol.GetVolumeId(), NodeId: node, VolumeCapability: nfsCapability(mode)}); err != nil {
			t.Fatal(err)
		}
	}
	url := func(vol *csi.Volume, file string) string {
		return net.NFSURL(vol.GetVolumeContext()[nfs.ContextShare], file)
	}
	read := func(vol *csi.Volume, file string) {
		t.Helper()
		if got, err := net.Nodes[0].NFSCat(ctx, url(vol, file)); err != nil || string(got) != "on ext4" {
			t.Fatalf("reading %s of %s: %q, %v", file, vol.GetVolumeId(), got, err)
		}
	}

	vol := create("ext4-vol", nil)
	if vol.GetCapacityBytes() != 16<<20 {
		t.Errorf("capacity %d, want the 16 MiB asked for (the ext4 minimum)", vol.GetCapacityBytes())
	}
	publish(vol)
	if err := net.Nodes[0].NFSCopy(ctx, payload, url(vol, "f")); err != nil {
		t.Fatal(err)
	}
	snap, err := ctrl.CSI.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "ext4-snap", SourceVolumeId: vol.GetVolumeId()})
	if err != nil {
		t.Fatal(err)
	}
	restored := create("ext4-restored", &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}})

	ctrl.Stop()
	ctrl.Start(ctx)
	testenv.WaitGraceEnded(ctx, t, gdir)
	read(vol, "f")
	publish(restored)
	read(restored, "f")
	for _, v := range []*csi.Volume{vol, restored} {
		if _, err := ctrl.CSI.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: node}); err != nil {
			t.Fatal(err)
		}
		if _, err := ctrl.CSI.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ctrl.CSI.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
		t.Fatal(err)
	}
}

package driver_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/nodestate"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// TestNodePublishAccessModes walks the spec's NodePublishVolume table on one
// node with real mounts: a second target, a repeat, and a repeat with the
// other readonly flag, for every mode the block backend serves.
func TestNodePublishAccessModes(t *testing.T) {
	e := newEnv(t, 0)
	tests := []struct {
		mode   accessmode.Mode
		block  bool
		second codes.Code // outcome of a publish at a second target
	}{
		{accessmode.SingleNodeSingleWriter, false, codes.FailedPrecondition},
		{accessmode.SingleNodeWriter, false, codes.FailedPrecondition},
		{accessmode.SingleNodeMultiWriter, false, codes.OK},
		{accessmode.SingleNodeReaderOnly, false, codes.FailedPrecondition},
		{accessmode.MultiNodeReaderOnly, false, codes.OK},
		{accessmode.SingleNodeSingleWriter, true, codes.FailedPrecondition},
		{accessmode.SingleNodeMultiWriter, true, codes.OK},
	}
	for i, tt := range tests {
		kind, c := "mount", mountCap(tt.mode)
		if tt.block {
			kind, c = "block", blockCap(tt.mode)
		}
		t.Run(fmt.Sprintf("%s/%s", kind, accessmode.Name(tt.mode)), func(t *testing.T) {
			name := fmt.Sprintf("modes-%d", i)
			volID, staging, pc := e.setup(t, name, c)
			t1, t2 := e.targetPath(name+"-1"), e.targetPath(name+"-2")

			if err := e.publish(t, volID, staging, t1, c, pc, false); err != nil {
				t.Fatalf("first publish: %v", err)
			}
			if n := e.mountsAt(t, t1); n != 1 {
				t.Fatalf("%d mounts at the first target, want 1", n)
			}
			if !tt.block && !accessmode.IsReadOnly(tt.mode) {
				if err := writeProbe(t1, "probe", "written at target 1"); err != nil {
					t.Fatalf("writing at a read/write target: %v", err)
				}
			}

			// T1=T2, P1=P2: idempotent, and nothing stacked on the mount.
			if err := e.publish(t, volID, staging, t1, c, pc, false); err != nil {
				t.Errorf("repeated publish: %v, want OK", err)
			}
			if n := e.mountsAt(t, t1); n != 1 {
				t.Errorf("%d mounts at the first target after a repeat, want 1", n)
			}

			// T1=T2, P1!=P2: ALREADY_EXISTS, and the mount stays as it was.
			err := e.publish(t, volID, staging, t1, c, pc, true)
			wantCode(t, "same target, readonly=true", err, codes.AlreadyExists)
			if n := e.mountsAt(t, t1); n != 1 {
				t.Errorf("%d mounts at the first target after a refused change, want 1", n)
			}
			if !tt.block && !accessmode.IsReadOnly(tt.mode) {
				if err := writeProbe(t1, "probe2", "still writable"); err != nil {
					t.Errorf("the first target is no longer writable after a refused readonly publish: %v", err)
				}
			}

			// T1!=T2.
			err = e.publish(t, volID, staging, t2, c, pc, false)
			if tt.second == codes.OK {
				if err != nil {
					t.Fatalf("second target: %v, want OK", err)
				}
				if n := e.mountsAt(t, t2); n != 1 {
					t.Errorf("%d mounts at the second target, want 1", n)
				}
			} else {
				wantCode(t, "second target", err, tt.second)
				if n := e.mountsAt(t, t2); n != 0 {
					t.Errorf("a refused publish left %d mounts at %s", n, t2)
				}
				if _, serr := os.Lstat(t2); !os.IsNotExist(serr) {
					t.Errorf("a refused publish created %s (%v)", t2, serr)
				}
				if m := status.Convert(err).Message(); !strings.Contains(m, t1) {
					t.Errorf("refusal %q does not say where the volume is in use (%s)", m, t1)
				}
			}

			if tt.block {
				fi, err := os.Stat(t1)
				if err != nil || fi.Mode()&os.ModeDevice == 0 {
					t.Errorf("block target %s is not a device: %v, %v", t1, fi, err)
				}
				return
			}
			if accessmode.IsReadOnly(tt.mode) {
				// A read-only mode publishes read-only whatever the CO's flag said.
				if err := writeProbe(t1, "probe", "x"); !isEROFS(err) {
					t.Errorf("writing at a %s target: %v, want EROFS", accessmode.Name(tt.mode), err)
				}
				if tt.second == codes.OK {
					if err := writeProbe(t2, "probe", "x"); !isEROFS(err) {
						t.Errorf("writing at the second %s target: %v, want EROFS", accessmode.Name(tt.mode), err)
					}
				}
				return
			}
			if tt.second == codes.OK {
				// Both targets show the same filesystem.
				data, err := os.ReadFile(filepath.Join(t2, "probe"))
				if err != nil || string(data) != "written at target 1" {
					t.Errorf("reading at the second target what the first wrote: %q, %v", data, err)
				}
				// T1!=T2, P1!=P2 is allowed too, and the readonly flag holds.
				t3 := e.targetPath(name + "-3")
				if err := e.publish(t, volID, staging, t3, c, pc, true); err != nil {
					t.Fatalf("read-only publish at a third target: %v", err)
				}
				if err := writeProbe(t3, "probe3", "x"); !isEROFS(err) {
					t.Errorf("writing at a readonly=true target: %v, want EROFS", err)
				}
				if err := writeProbe(t1, "probe3", "x"); err != nil {
					t.Errorf("a read-only publish elsewhere made the first target read-only: %v", err)
				}
			}
		})
	}
}

func publishedNodes(t *testing.T, e *env, volID string) []string {
	t.Helper()
	resp, err := e.ctrl.ControllerGetVolume(ctx(t), &csi.ControllerGetVolumeRequest{VolumeId: volID})
	if err != nil {
		t.Fatalf("ControllerGetVolume: %v", err)
	}
	return resp.GetStatus().GetPublishedNodeIds()
}

func TestControllerPublishNodeChecks(t *testing.T) {
	e := newMemoryEnv(t, 0)
	c := blockCap(accessmode.SingleNodeWriter)
	volID := e.createVolume(t, "node-checks", c)

	t.Run("node in another zone", func(t *testing.T) {
		_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
			VolumeId: volID, NodeId: "node-9@zone-b", VolumeCapability: c,
		})
		wantCode(t, "publish to zone-b", err, codes.FailedPrecondition)
		if m := status.Convert(err).Message(); !strings.Contains(m, "zone-a") || !strings.Contains(m, "zone-b") {
			t.Errorf("message %q should name both zones", m)
		}
		// With an NFS address as well.
		_, err = e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
			VolumeId: volID, NodeId: "node-9@zone-b@10.0.0.9", VolumeCapability: c,
		})
		wantCode(t, "publish to zone-b with address", err, codes.FailedPrecondition)
	})

	t.Run("unparsable node id", func(t *testing.T) {
		for _, node := range []string{
			"node-1", "node-1@", "@zone-a", "node-1@zone-a@", "node-1@zone-a@10.0.0.1@x",
			"../../etc@zone-a", "node-1@zone-a@fe80::1%eth0", "node 1@zone-a", "node-1@zone-a\x00",
			strings.Repeat("n", 70000) + "@zone-a",
		} {
			_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
				VolumeId: volID, NodeId: node, VolumeCapability: c,
			})
			wantCode(t, fmt.Sprintf("node id %.40q", node), err, codes.NotFound)
			if m := status.Convert(err).Message(); !strings.Contains(m, nodeid.Format) {
				t.Errorf("node id %.40q: message %.200q does not say what a node id reads", node, m)
			}
		}
	})

	if nodes := publishedNodes(t, e, volID); len(nodes) != 0 {
		t.Errorf("refused publishes recorded attachments: %v", nodes)
	}

	t.Run("empty node id", func(t *testing.T) {
		_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: volID, VolumeCapability: c})
		wantCode(t, "empty node id", err, codes.InvalidArgument)
	})

	t.Run("second node of a single-node mode", func(t *testing.T) {
		e.controllerPublish(t, volID, c)
		other := "node-2@zone-a"
		_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
			VolumeId: volID, NodeId: other, VolumeCapability: c,
		})
		wantCode(t, "second node", err, codes.FailedPrecondition)
		if m := status.Convert(err).Message(); !strings.Contains(m, e.nodeID()) {
			t.Errorf("message %q should name the node holding the volume (%s), as the spec asks", m, e.nodeID())
		}
	})
}

func TestControllerPublishAttachLimit(t *testing.T) {
	const limit = 2
	m := metrics.New("test", []string{"controller", "node"})
	e := newMemoryEnv(t, limit, func(e *env) { e.metrics = m })
	c := blockCap(accessmode.SingleNodeWriter)
	var vols []string
	for i := 0; i < limit+1; i++ {
		vols = append(vols, e.createVolume(t, fmt.Sprintf("limit-%d", i), c))
	}
	resp, err := e.node.NodeGetInfo(ctx(t), &csi.NodeGetInfoRequest{})
	if err != nil || resp.GetMaxVolumesPerNode() != limit {
		t.Fatalf("NodeGetInfo = %v, %v; want MaxVolumesPerNode %d", resp, err, limit)
	}
	for _, v := range vols[:limit] {
		e.controllerPublish(t, v, c)
	}
	publish := func(vol, node string) error {
		_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: node, VolumeCapability: c})
		return err
	}
	err = publish(vols[limit], e.nodeID())
	wantCode(t, "one volume over the limit", err, codes.ResourceExhausted)
	if nodes := publishedNodes(t, e, vols[limit]); len(nodes) != 0 {
		t.Errorf("the refused volume is recorded as published to %v", nodes)
	}
	// A repeat of a publish in force is no new volume on the node.
	if err := publish(vols[0], e.nodeID()); err != nil {
		t.Errorf("idempotent repeat at the limit: %v, want OK", err)
	}
	// The limit is per node.
	other := "node-2@" + testZone
	if err := publish(vols[limit], other); err != nil {
		t.Fatalf("publish to another node: %v", err)
	}
	e.cleanupControllerUnpublish(t, vols[limit], other)
	// Unpublishing one frees a slot.
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: vols[0], NodeId: e.nodeID()}); err != nil {
		t.Fatal(err)
	}
	other2 := e.createVolume(t, "limit-extra", c)
	if err := publish(other2, e.nodeID()); err != nil {
		t.Errorf("publish after freeing a slot: %v", err)
	} else {
		e.cleanupControllerUnpublish(t, other2, e.nodeID())
	}
	wantCode(t, "full again", publish(vols[0], e.nodeID()), codes.ResourceExhausted)
	want(t, gathered(t, m), "modeguard_publish_refused_total",
		map[string]string{"stage": "attach", "mode": "SINGLE_NODE_WRITER", "reason": "AttachLimit"}, 2)
}

func readLockFile(t *testing.T, e *env, volID string) *nodestate.Record {
	t.Helper()
	id, err := volumeid.Parse(volID)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(e.stateDir, nodestate.DirName, id.FileName()+".json"))
	if err != nil {
		t.Fatalf("reading the lock file of %s: %v", volID, err)
	}
	rec := &nodestate.Record{}
	if err := json.Unmarshal(data, rec); err != nil {
		t.Fatal(err)
	}
	return rec
}

// TestRestartKeepsSingleWriterLock: the RWOP rule lives in the node's lock
// files, so a restarted plugin still refuses a second workload, and forgets
// a workload whose mount vanished while it was down once it reconciles.
func TestRestartKeepsSingleWriterLock(t *testing.T) {
	e := newEnv(t, 0)
	c := mountCap(accessmode.SingleNodeSingleWriter)
	volID, staging, pc := e.setup(t, "rwop", c)
	t1, t2 := e.targetPath("rwop-1"), e.targetPath("rwop-2")
	if err := e.publish(t, volID, staging, t1, c, pc, false); err != nil {
		t.Fatalf("first publish: %v", err)
	}
	if err := writeProbe(t1, "data", "from the first workload"); err != nil {
		t.Fatal(err)
	}

	e.restart(t) // a new driver instance on the same state dir; Reconcile ran
	if _, held := readLockFile(t, e, volID).Holder(t1); !held {
		t.Fatalf("after the restart the lock file no longer names %s", t1)
	}
	err := e.publish(t, volID, staging, t2, c, pc, false)
	wantCode(t, "second target after restart", err, codes.FailedPrecondition)
	if n := e.mountsAt(t, t2); n != 0 {
		t.Errorf("refused publish mounted %s", t2)
	}
	// The first workload's repeat is still recognised as the same publish.
	if err := e.publish(t, volID, staging, t1, c, pc, false); err != nil {
		t.Errorf("repeat of the first publish after restart: %v", err)
	}
	if n := e.mountsAt(t, t1); n != 1 {
		t.Errorf("%d mounts at %s, want 1", n, t1)
	}

	// The first workload goes away behind the plugin's back.
	if err := unix.Unmount(t1, 0); err != nil {
		t.Fatalf("unmounting %s by hand: %v", t1, err)
	}
	if _, held := readLockFile(t, e, volID).Holder(t1); !held {
		t.Fatalf("the lock file lost %s before Reconcile", t1)
	}
	if err := e.d.Reconcile(context.Background()); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	rec := readLockFile(t, e, volID)
	if _, held := rec.Holder(t1); held || len(rec.Holders) != 0 {
		t.Errorf("after Reconcile the lock file still holds %+v", rec.Holders)
	}
	if rec.Staged == nil || rec.Staged.StagingPath != staging {
		t.Errorf("Reconcile dropped the stage: %+v", rec.Staged)
	}

	if err := e.publish(t, volID, staging, t2, c, pc, false); err != nil {
		t.Fatalf("second target after the first went away: %v", err)
	}
	data, err := os.ReadFile(filepath.Join(t2, "data"))
	if err != nil || string(data) != "from the first workload" {
		t.Errorf("the second workload sees %q, %v; want the first workload's data", data, err)
	}
	if _, held := readLockFile(t, e, volID).Holder(t2); !held {
		t.Error("the lock file does not name the new holder")
	}
}

// hostileIDs are volume ids no volume can have.
func hostileIDs() []string {
	key := "0123456789abcdef0123456789abcdef"
	return []string{
		"../../etc",
		"block:zone-a:vol-../../x",
		"block:zone-a:vol-" + key + "/../../../etc",
		"block:../..:vol-" + key,
		"block:zone-a/..:vol-" + key,
		"block:zone-a:snap-" + key, // a snapshot id is no volume id
		"block:zone-a:vol-" + strings.ToUpper(key),
		"block:zone-a:vol-" + key + "\x00",
		"block:zone-a\x00:vol-" + key,
		"\x00",
		"/etc/passwd",
		" block:zone-a:vol-" + key,
		"block:zone-a:vol-" + key + "\n",
		"block:zone-a:vol-" + strings.Repeat("0", 64<<10),
		strings.Repeat("../", 100<<10),
	}
}

// TestHostileVolumeIDs sends ids no volume can have to every RPC taking a
// volume id: each is answered NotFound or InvalidArgument (or OK where the
// spec makes an absent volume a success), and nothing is created or
// removed in the pools, the state dir, or outside them.
func TestHostileVolumeIDs(t *testing.T) {
	e := newEnv(t, 0)
	// A real volume, attached and staged, that must come through untouched.
	c := mountCap(accessmode.SingleNodeWriter)
	legit, legitStaging, _ := e.setup(t, "legit", c)

	outside := t.TempDir()
	canary := filepath.Join(outside, "canary")
	if err := os.WriteFile(canary, []byte("canary"), 0o600); err != nil {
		t.Fatal(err)
	}
	outTarget, outStaging := filepath.Join(outside, "target"), filepath.Join(outside, "staging")
	before, outBefore := treeState(t, e.root), treeState(t, outside)

	type rpc struct {
		name string
		call func(id string) error
		// okAllowed: the spec answers OK for a volume that does not exist.
		okAllowed bool
	}
	cc, nc := e.ctrl, e.node
	rpcs := []rpc{
		{"CreateVolume from volume", func(id string) error {
			_, err := cc.CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "hostile-clone", VolumeCapabilities: []*csi.VolumeCapability{c},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}})
			return err
		}, false},
		{"CreateVolume from snapshot", func(id string) error {
			_, err := cc.CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "hostile-restore", VolumeCapabilities: []*csi.VolumeCapability{c},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}})
			return err
		}, false},
		{"DeleteVolume", func(id string) error {
			_, err := cc.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		}, true},
		{"ControllerPublishVolume", func(id string) error {
			_, err := cc.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: e.nodeID(), VolumeCapability: c})
			return err
		}, false},
		{"ControllerUnpublishVolume", func(id string) error {
			_, err := cc.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: e.nodeID()})
			return err
		}, true},
		{"ValidateVolumeCapabilities", func(id string) error {
			_, err := cc.ValidateVolumeCapabilities(ctx(t), &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{c}})
			return err
		}, false},
		{"ControllerGetVolume", func(id string) error {
			_, err := cc.ControllerGetVolume(ctx(t), &csi.ControllerGetVolumeRequest{VolumeId: id})
			return err
		}, false},
		{"ControllerGetVolumeHealth", func(id string) error {
			_, err := cc.ControllerGetVolumeHealth(ctx(t), &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
			return err
		}, false},
		{"ControllerExpandVolume", func(id string) error {
			_, err := cc.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * volumeSize}})
			return err
		}, false},
		{"CreateSnapshot", func(id string) error {
			_, err := cc.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "hostile-snap", SourceVolumeId: id})
			return err
		}, false},
		{"GetSnapshot", func(id string) error {
			_, err := cc.GetSnapshot(ctx(t), &csi.GetSnapshotRequest{SnapshotId: id})
			return err
		}, false},
		{"DeleteSnapshot", func(id string) error {
			_, err := cc.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: id})
			return err
		}, true},
		{"NodeStageVolume", func(id string) error {
			_, err := nc.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: outStaging, VolumeCapability: c})
			return err
		}, false},
		{"NodeUnstageVolume", func(id string) error {
			_, err := nc.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: outStaging})
			return err
		}, false},
		{"NodePublishVolume", func(id string) error {
			_, err := nc.NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: legitStaging,
				TargetPath: outTarget, VolumeCapability: c})
			return err
		}, false},
		{"NodeUnpublishVolume", func(id string) error {
			_, err := nc.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: outTarget})
			return err
		}, false},
		{"NodeGetVolumeStats", func(id string) error {
			_, err := nc.NodeGetVolumeStats(ctx(t), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: outside})
			return err
		}, false},
		{"NodeExpandVolume", func(id string) error {
			_, err := nc.NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: legitStaging})
			return err
		}, false},
		{"NodeGetVolumeHealth", func(id string) error {
			_, err := nc.NodeGetVolumeHealth(ctx(t), &csi.NodeGetVolumeHealthRequest{VolumeId: id, VolumePublishPath: outTarget})
			return err
		}, false},
	}
	for _, r := range rpcs {
		t.Run(r.name, func(t *testing.T) {
			for i, id := range hostileIDs() {
				err := r.call(id)
				if err == nil && r.okAllowed {
					continue
				}
				wantCode(t, fmt.Sprintf("id #%d %.50q", i, id), err, codes.NotFound, codes.InvalidArgument)
			}
			// The empty id is a missing argument everywhere.
			wantCode(t, "empty id", r.call(""), codes.InvalidArgument)
		})
	}
	t.Run("ListSnapshots", func(t *testing.T) {
		for i, id := range hostileIDs() {
			for _, req := range []*csi.ListSnapshotsRequest{{SnapshotId: id}, {SourceVolumeId: id}} {
				resp, err := cc.ListSnapshots(ctx(t), req)
				if err != nil || len(resp.GetEntries()) != 0 {
					t.Errorf("id #%d: ListSnapshots(%.50v) = %v, %v; want no entries", i, req, resp.GetEntries(), err)
				}
			}
		}
	})
	t.Run("starting tokens", func(t *testing.T) {
		for i, id := range hostileIDs() {
			_, err := cc.ListVolumes(ctx(t), &csi.ListVolumesRequest{StartingToken: id})
			wantCode(t, fmt.Sprintf("ListVolumes token #%d", i), err, codes.Aborted)
			if _, perr := volumeid.ParseKind(id, volumeid.Snapshot); perr == nil {
				continue // a well-formed snapshot id is a fine snapshot token
			}
			_, err = cc.ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{StartingToken: id})
			wantCode(t, fmt.Sprintf("ListSnapshots token #%d", i), err, codes.Aborted)
		}
	})

	if d := diffTrees(before, treeState(t, e.root)); len(d) > 0 {
		t.Errorf("hostile ids changed the pools or the state:\n%s", strings.Join(d, "\n"))
	}
	if d := diffTrees(outBefore, treeState(t, outside)); len(d) > 0 {
		t.Errorf("hostile ids changed files outside the driver's directories:\n%s", strings.Join(d, "\n"))
	}
	if data, err := os.ReadFile(canary); err != nil || string(data) != "canary" {
		t.Errorf("canary = %q, %v", data, err)
	}
	if nodes := publishedNodes(t, e, legit); len(nodes) != 1 || nodes[0] != e.nodeID() {
		t.Errorf("the real volume's attachments became %v", nodes)
	}
	if _, err := os.Stat(filepath.Join(legitStaging, "lost+found")); err != nil {
		t.Errorf("the real volume is no longer staged: %v", err)
	}
}

// Paths a CO must never send. Those in uncleanPaths resolve inside root;
// escapingPaths do not, so they are only ever sent for a volume that is not
// attached to this node: even a driver that failed to check them could then
// mount nothing there (a regression must not bind-mount over / or the
// test's working directory).
func uncleanPaths(root string) []string {
	return []string{
		root + "/targets/../targets/bad",
		root + "/targets/./bad",
		root + "/targets//bad",
		root + "/targets/bad/",
		root + "/targets/bad/..",
		root + "/targets/bad\x00/../../../etc",
	}
}

func escapingPaths() []string {
	return []string{"", "relative/target", "target", ".", "..", "/", "//", "/..", "/tmp/../", "../../etc"}
}

// nodePathCalls sends every node RPC taking a path with p in that place and
// checks each answers InvalidArgument.
func nodePathCalls(t *testing.T, e *env, volID, staging, good, p string, c *csi.VolumeCapability, pc map[string]string) {
	t.Helper()
	what := func(rpc string) string { return fmt.Sprintf("%s with path %q", rpc, p) }
	_, err := e.node.NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, TargetPath: p, VolumeCapability: c, PublishContext: pc})
	wantCode(t, what("NodePublishVolume target"), err, codes.InvalidArgument)
	_, err = e.node.NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: p, TargetPath: good, VolumeCapability: c, PublishContext: pc})
	wantCode(t, what("NodePublishVolume staging"), err, codes.InvalidArgument)
	_, err = e.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: p})
	wantCode(t, what("NodeUnpublishVolume"), err, codes.InvalidArgument)
	_, err = e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: p, VolumeCapability: c, PublishContext: pc})
	wantCode(t, what("NodeStageVolume"), err, codes.InvalidArgument)
	_, err = e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: p})
	wantCode(t, what("NodeUnstageVolume"), err, codes.InvalidArgument)
}

func TestBadPathsRefused(t *testing.T) {
	e := newEnv(t, 0)
	c := mountCap(accessmode.SingleNodeMultiWriter) // a second target would be allowed
	volID, staging, pc := e.setup(t, "paths", c)
	// Created but never attached here: nothing can be staged or mounted.
	unattached := e.createVolume(t, "paths-unattached", c)
	good := e.targetPath("good")
	cwd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	before, cwdBefore := treeState(t, e.root), treeState(t, cwd)

	for _, p := range uncleanPaths(e.root) {
		nodePathCalls(t, e, volID, staging, good, p, c, pc)
	}
	for _, p := range append(escapingPaths(), uncleanPaths(e.root)...) {
		nodePathCalls(t, e, unattached, e.stagingPath("paths-unattached"), e.targetPath("unattached"), p, c, nil)
	}
	if d := diffTrees(before, treeState(t, e.root)); len(d) > 0 {
		t.Errorf("refused calls changed files:\n%s", strings.Join(d, "\n"))
	}
	if d := diffTrees(cwdBefore, treeState(t, cwd)); len(d) > 0 {
		t.Errorf("refused calls changed the working directory:\n%s", strings.Join(d, "\n"))
	}
	if n := e.mountsAt(t, good); n != 0 {
		t.Errorf("a refused publish mounted %s", good)
	}
	// The volume is as usable as before.
	if err := e.publish(t, volID, staging, good, c, pc, false); err != nil {
		t.Errorf("publish at a good path after the refusals: %v", err)
	}
}

func TestUnknownParameterRefused(t *testing.T) {
	e := newEnv(t, 0)
	c := mountCap(accessmode.SingleNodeWriter)
	params := map[string]string{"backend": "block", "replication": "3"}
	_, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
		Name: "unknown-param", VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: params,
		CapacityRange: &csi.CapacityRange{RequiredBytes: volumeSize},
	})
	wantCode(t, "CreateVolume", err, codes.InvalidArgument)
	msg := status.Convert(err).Message()
	for _, m := range []string{"replication", "backend", "fsType", "csi.storage.k8s.io/"} {
		if !strings.Contains(msg, m) {
			t.Errorf("message %q does not mention %q", msg, m)
		}
	}
	_, err = e.ctrl.GetCapacity(ctx(t), &csi.GetCapacityRequest{Parameters: params, VolumeCapabilities: []*csi.VolumeCapability{c}})
	wantCode(t, "GetCapacity", err, codes.InvalidArgument)

	// Kubernetes' own keys are accepted, so the same class without the
	// unknown key provisions.
	id := e.createVolume(t, "k8s-params", c)
	_, err = e.ctrl.ValidateVolumeCapabilities(ctx(t), &csi.ValidateVolumeCapabilitiesRequest{
		VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: params})
	wantCode(t, "ValidateVolumeCapabilities", err, codes.InvalidArgument)

	resp, err := e.ctrl.ListVolumes(ctx(t), &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(resp.GetEntries()); n != 1 {
		t.Errorf("%d volumes exist, want only the one created with good parameters", n)
	}
	entries, err := os.ReadDir(filepath.Join(e.pool, "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 2 { // its metadata and its image
		var names []string
		for _, en := range entries {
			names = append(names, en.Name())
		}
		t.Errorf("pool holds %v, want one volume's .json and .img", names)
	}
}

// syncBuffer collects klog output written from the server's goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

var klogFlags = func() *flag.FlagSet {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	return fs
}()

// captureKlog sends klog's output, at verbosity 5, to a buffer until the
// test ends.
func captureKlog(t *testing.T) *syncBuffer {
	t.Helper()
	buf := &syncBuffer{}
	for k, v := range map[string]string{"v": "5", "logtostderr": "false", "alsologtostderr": "false"} {
		if err := klogFlags.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	klog.SetOutput(buf)
	t.Cleanup(func() {
		klog.Flush()
		klog.SetOutput(os.Stderr)
		_ = klogFlags.Set("v", "0")
		_ = klogFlags.Set("logtostderr", "true")
	})
	return buf
}

func TestSecretsNeverLogged(t *testing.T) {
	e := newMemoryEnv(t, 0, withFenceFile)
	logs := captureKlog(t)
	const canary = "s3cr3t-canary"
	secrets := map[string]string{"password": canary, "token": "x-" + canary + "-y"}
	c := mountCap(accessmode.SingleNodeWriter)

	cv, err := e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
		Name: "secret-vol", VolumeCapabilities: []*csi.VolumeCapability{c}, Secrets: secrets,
		CapacityRange: &csi.CapacityRange{RequiredBytes: volumeSize},
	})
	if err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	volID := cv.GetVolume().GetVolumeId()
	t.Cleanup(func() {
		if _, err := e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: volID, Secrets: secrets}); err != nil {
			t.Errorf("cleanup: DeleteVolume: %v", err)
		}
	})
	// A failing call is logged too (with its error): still no secret.
	_, err = e.ctrl.CreateVolume(ctx(t), &csi.CreateVolumeRequest{
		Name: "secret-bad", VolumeCapabilities: []*csi.VolumeCapability{c}, Secrets: secrets,
		Parameters: map[string]string{"replication": "3"},
	})
	wantCode(t, "CreateVolume with an unknown parameter", err, codes.InvalidArgument)

	pub, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: e.nodeID(), VolumeCapability: c, Secrets: secrets})
	if err != nil {
		t.Fatalf("ControllerPublishVolume: %v", err)
	}
	e.cleanupControllerUnpublish(t, volID, e.nodeID())
	staging := e.stagingPath("secret-vol")
	if _, err := e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pub.GetPublishContext(), Secrets: secrets,
	}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	t.Cleanup(func() {
		if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
			t.Errorf("cleanup: NodeUnstageVolume: %v", err)
		}
	})
	// A repeat with other arguments fails: its error is logged as well.
	_, err = e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging + "-other", VolumeCapability: c, PublishContext: pub.GetPublishContext(), Secrets: secrets,
	})
	wantCode(t, "NodeStageVolume elsewhere", err, codes.AlreadyExists)
	target := e.targetPath("secret-vol")
	if _, err := e.node.NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c,
		PublishContext: pub.GetPublishContext(), Secrets: secrets,
	}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	if _, err := e.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := e.ctrl.ControllerExpandVolume(ctx(t), &csi.ControllerExpandVolumeRequest{
		VolumeId: volID, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * volumeSize}, Secrets: secrets}); err != nil {
		t.Fatalf("ControllerExpandVolume: %v", err)
	}
	// csi-addons' fence requests carry secrets too. The fence is lifted
	// at once: this node states no address, so no publish could follow.
	fc := fence.NewFenceControllerClient(e.conn)
	if _, err := fc.FenceClusterNetwork(ctx(t), &fence.FenceClusterNetworkRequest{Cidrs: cidrs("192.0.2.0/24"), Secrets: secrets}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("FenceClusterNetwork with a node without address attached: %v, want FAILED_PRECONDITION", err)
	}
	if _, err := fc.UnfenceClusterNetwork(ctx(t), &fence.UnfenceClusterNetworkRequest{Cidrs: cidrs("192.0.2.0/24"), Secrets: secrets}); err != nil {
		t.Fatalf("UnfenceClusterNetwork: %v", err)
	}

	klog.Flush()
	out := logs.String()
	if strings.Contains(out, canary) {
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, canary) {
				t.Errorf("a secret reached the log: %s", line)
			}
		}
	}
	for _, m := range []string{
		"/csi.v1.Controller/CreateVolume", "/csi.v1.Controller/ControllerPublishVolume", "/csi.v1.Controller/ControllerExpandVolume",
		"/csi.v1.Node/NodeStageVolume", "/csi.v1.Node/NodePublishVolume",
		"/fence.FenceController/FenceClusterNetwork", "/fence.FenceController/UnfenceClusterNetwork",
		"***stripped***", // the secrets were in the logged requests, replaced
		"secret-vol",     // and the requests were logged with their other fields
	} {
		if !strings.Contains(out, m) {
			t.Errorf("the log does not contain %q; logging did not run as expected:\n%.3000s", m, out)
		}
	}
}

// A target or staging path whose last element is a symbolic link is refused:
// mount(2) would follow it and put the volume over whatever it points to.
func TestSymlinkPathsRefused(t *testing.T) {
	e := newEnv(t, 0)
	c := mountCap(accessmode.SingleNodeMultiWriter)
	volID, staging, pc := e.setup(t, "links", c)
	victim := filepath.Join(e.root, "victim")
	if err := os.MkdirAll(victim, 0o700); err != nil {
		t.Fatal(err)
	}
	link := e.targetPath("link")
	if err := os.MkdirAll(filepath.Dir(link), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, link); err != nil {
		t.Fatal(err)
	}
	if err := e.publish(t, volID, staging, link, c, pc, false); status.Code(err) != codes.InvalidArgument {
		t.Errorf("NodePublishVolume at a symlink: %v, want InvalidArgument", err)
	}
	if n := e.mountsAt(t, victim); n != 0 {
		t.Errorf("a refused publish mounted over the symlink's target %s", victim)
	}

	other := e.createVolume(t, "links-staging", c)
	opc := e.controllerPublish(t, other, c)
	stagingLink := e.stagingPath("links-staging")
	if err := os.MkdirAll(filepath.Dir(stagingLink), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, stagingLink); err != nil {
		t.Fatal(err)
	}
	_, err := e.node.NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{VolumeId: other, StagingTargetPath: stagingLink, VolumeCapability: c, PublishContext: opc})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("NodeStageVolume at a symlink: %v, want InvalidArgument", err)
	}
	if n := e.mountsAt(t, victim); n != 0 {
		t.Errorf("a refused stage mounted over the symlink's target %s", victim)
	}
	// The volume is as usable as before at a plain path.
	if err := e.publish(t, volID, staging, e.targetPath("plain"), c, pc, false); err != nil {
		t.Errorf("publish at a plain path after the refusals: %v", err)
	}
}

// A read-only publish of a raw block volume staged read/write gets a device
// that is itself read-only: the kernel ignores the read-only flag of a bind
// mount of a device node, so the bind alone would let the workload write.
// The read/write publish next to it still writes; unpublishing detaches the
// read-only device.
func TestReadOnlyRawBlockPublishCannotWrite(t *testing.T) {
	e := newEnv(t, 0)
	c := blockCap(accessmode.SingleNodeMultiWriter)
	volID, staging, pc := e.setup(t, "ro-raw", c)
	rw, ro := e.targetPath("rw"), e.targetPath("ro")
	if err := e.publish(t, volID, staging, rw, c, pc, false); err != nil {
		t.Fatal(err)
	}
	if err := e.publish(t, volID, staging, ro, c, pc, true); err != nil {
		t.Fatal(err)
	}
	if err := writeDevice(rw); err != nil {
		t.Fatalf("the read/write publish cannot write: %v", err)
	}
	if err := writeDevice(ro); err == nil {
		t.Fatalf("a write through the read-only publish at %s succeeded", ro)
	}
	// This test's own loop devices: other tests of the machine attach and
	// detach theirs meanwhile.
	localLoops := func() []string { return localcluster.LoopsUnder(e.root) }
	loopsBefore := len(localLoops())
	if _, err := e.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: ro}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for len(localLoops()) != loopsBefore-1 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := len(localLoops()); n != loopsBefore-1 {
		t.Fatalf("unpublishing the read-only target left %d loop devices bound, want %d", n, loopsBefore-1)
	}
}

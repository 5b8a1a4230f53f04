package lio

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// transport is one way of reaching block volumes from the node VM, driven
// through CSI.
type transport struct {
	name   string
	ctrl   csi.ControllerClient
	node   csi.NodeClient
	nodeID string
}

// BenchmarkTransportsInVM compares the two block transports on one node
// VM: iSCSI from the storage target in the target VM (controller on the
// host, as in the tests) and loop devices over a pool on the node VM's own
// disk (a driver with both roles in the node VM). Both run under the same
// emulation, so their ratios say what the network transport costs; the
// absolute numbers say little. It reports the median raw block lifecycle
// (CreateVolume to DeleteVolume, every call of a pod's life) and fio's
// sequential write and random read on the published device.
//
//	go test -run '^$' -bench TransportsInVM -benchtime 1x -timeout 40m ./test/vm/lio/
func BenchmarkTransportsInVM(b *testing.B) {
	if _, err := exec.LookPath("fio"); err != nil {
		b.Skip("fio is not installed (Debian: fio); the VMs run the host's")
	}
	e := setupCSI(b, 1, "30s")
	vm := e.env.nodes[0]
	iscsiT := transport{name: "iscsi", ctrl: e.ctrl.CSI, node: e.plugins[vm.Name], nodeID: e.nodeID[vm.Name]}
	loopT := e.loopTransport(vm)
	const runs = 5
	lifecycles := map[string][]time.Duration{}
	for i := 0; i < runs; i++ {
		for _, tr := range []transport{loopT, iscsiT} {
			lifecycles[tr.name] = append(lifecycles[tr.name], e.lifecycle(tr, vm, fmt.Sprintf("life-%s-%d", tr.name, i), nil))
		}
	}
	fio := map[string]fioResult{}
	for _, tr := range []transport{loopT, iscsiT} {
		e.lifecycle(tr, vm, "fio-"+tr.name, func(dev string) { fio[tr.name] = runFio(e, vm, dev) })
	}
	loopLife, iscsiLife := median(lifecycles["loop"]), median(lifecycles["iscsi"])
	b.ReportMetric(float64(loopLife.Milliseconds()), "loop-lifecycle-ms")
	b.ReportMetric(float64(iscsiLife.Milliseconds()), "iscsi-lifecycle-ms")
	b.ReportMetric(float64(iscsiLife)/float64(loopLife), "iscsi/loop-lifecycle")
	b.ReportMetric(fio["loop"].writeMiBps, "loop-seqwrite-MiB/s")
	b.ReportMetric(fio["iscsi"].writeMiBps, "iscsi-seqwrite-MiB/s")
	b.ReportMetric(fio["iscsi"].writeMiBps/fio["loop"].writeMiBps, "iscsi/loop-seqwrite")
	b.ReportMetric(fio["loop"].readIOPS, "loop-randread-IOPS")
	b.ReportMetric(fio["iscsi"].readIOPS, "iscsi-randread-IOPS")
	b.ReportMetric(fio["iscsi"].readIOPS/fio["loop"].readIOPS, "iscsi/loop-randread")
	b.Logf("lifecycles (ms): loop %v, iscsi %v", lifecycles["loop"], lifecycles["iscsi"])
}

// loopTransport starts a driver with both roles in vm, its pool on the
// VM's own disk, reached on port 10002.
func (e *csiEnv) loopTransport(vm *vmtest.VM) transport {
	e.t.Helper()
	pool := vm.Path("loop-pool")
	if out, code, err := vm.Run(e.ctx, "mkdir", "-p", pool); err != nil || code != 0 {
		e.t.Fatalf("mkdir %s: exit %d, %v: %s", pool, code, err, out)
	}
	log := filepath.Join(e.t.TempDir(), "loop-driver.log")
	runInVM(e.t, e.ctx, vm, log, e.bin, "--roles", "controller,node", "--endpoint", "tcp://0.0.0.0:10002",
		"--node-id", vm.Name, "--zone", "zone-a", "--block-pool", "zone-a="+pool, "--block-pool-filesystem=direct", "--state-dir", vm.Path("loop-state"), "-v", "1")
	e.t.Cleanup(func() { killInVM(e.t, context.Background(), vm, log) })
	conn, err := grpc.NewClient("passthrough:///"+vm.Addr.String()+":10002",
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(e.c.Dialer()))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { conn.Close() })
	node := csi.NewNodeClient(conn)
	for deadline := time.Now().Add(time.Minute); ; {
		info, err := node.NodeGetInfo(e.ctx, &csi.NodeGetInfoRequest{})
		if err == nil {
			return transport{name: "loop", ctrl: csi.NewControllerClient(conn), node: node, nodeID: info.GetNodeId()}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("the loop transport's driver in %s does not answer: %v", vm.Name, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// lifecycle runs a raw block volume's life through tr and returns how
// long it took; use, when set, runs on the published device (not timed
// apart: the fio runs are measured by fio).
func (e *csiEnv) lifecycle(tr transport, vm *vmtest.VM, name string, use func(dev string)) time.Duration {
	e.t.Helper()
	ctx, c := e.ctx, blockCapability(accessmode.SingleNodeWriter)
	must := func(what string, err error) {
		if err != nil {
			e.t.Fatalf("%s through %s: %s: %v", name, tr.name, what, err)
		}
	}
	staging, target := vm.Path("bench", name, "staging"), vm.Path("bench", name, "pod")
	start := time.Now()
	created, err := tr.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{c},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, Parameters: map[string]string{"backend": "block"}})
	must("CreateVolume", err)
	v := created.GetVolume()
	pub, err := tr.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: tr.nodeID, VolumeCapability: c})
	must("ControllerPublishVolume", err)
	_, err = tr.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging,
		VolumeCapability: c, PublishContext: pub.GetPublishContext(), VolumeContext: v.GetVolumeContext()})
	must("NodeStageVolume", err)
	_, err = tr.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: c, PublishContext: pub.GetPublishContext()})
	must("NodePublishVolume", err)
	took := time.Since(start)
	if use != nil {
		use(target)
	}
	start = time.Now()
	_, err = tr.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), TargetPath: target})
	must("NodeUnpublishVolume", err)
	_, err = tr.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging})
	must("NodeUnstageVolume", err)
	_, err = tr.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: tr.nodeID})
	must("ControllerUnpublishVolume", err)
	_, err = tr.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()})
	must("DeleteVolume", err)
	return took + time.Since(start)
}

type fioResult struct{ writeMiBps, readIOPS float64 }

// runFio measures a sequential 1 MiB direct write of 48 MiB (queue depth
// 4) and 10 s of 4 KiB direct random reads (queue depth 16) on dev, in the
// VM.
func runFio(e *csiEnv, vm *vmtest.VM, dev string) fioResult {
	e.t.Helper()
	job := func(args ...string) map[string]any {
		e.t.Helper()
		out, code, err := vm.Run(e.ctx, "fio", append([]string{"--name=bench", "--filename=" + dev, "--direct=1",
			"--ioengine=libaio", "--output-format=json"}, args...)...)
		if err != nil || code != 0 {
			e.t.Fatalf("fio %v on %s: exit %d, %v: %s", args, dev, code, err, out)
		}
		var r struct {
			Jobs []map[string]any `json:"jobs"`
		}
		// fio may print notes before its JSON.
		if err := json.Unmarshal([]byte(out[max(0, strings.IndexByte(out, '{')):]), &r); err != nil || len(r.Jobs) != 1 {
			e.t.Fatalf("fio's output: %v: %s", err, out)
		}
		return r.Jobs[0]
	}
	number := func(job map[string]any, dir, key string) float64 {
		v, _ := job[dir].(map[string]any)[key].(float64)
		return v
	}
	w := job("--rw=write", "--bs=1M", "--size=48M", "--iodepth=4")
	r := job("--rw=randread", "--bs=4k", "--iodepth=16", "--time_based", "--runtime=10s")
	return fioResult{writeMiBps: number(w, "write", "bw_bytes") / (1 << 20), readIOPS: number(r, "read", "iops")}
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

const (
	gib      = int64(1) << 30
	zone     = "zone-a"
	zoneKey  = "topology.modeguard.csi.dev/zone"
	nodeName = "bench-a1"
)

func capability(mode csi.VolumeCapability_AccessMode_Mode, fsType string) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if fsType == "" {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}
	}
	return c
}

var singleWriter = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

func createReq(name string, size int64, c *csi.VolumeCapability, params map[string]string) *csi.CreateVolumeRequest {
	seg := &csi.Topology{Segments: map[string]string{zoneKey: zone}}
	return &csi.CreateVolumeRequest{
		Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: params,
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{seg}, Preferred: []*csi.Topology{seg}},
	}
}

// blockPair is a controller and a node plugin sharing one zone-a pool.
type blockPair struct {
	ctrl, node *plugin
	nodeID     string
	kubelet    string // where staging and target paths go
	pool       string
	// steps, when set, collects the time of each CSI call by method.
	steps map[string][]time.Duration
}

// step runs one call and, when steps are collected, records its time.
func (p *blockPair) step(name string, f func() error) error {
	began := time.Now()
	err := f()
	if p.steps != nil {
		p.steps[name] = append(p.steps[name], time.Since(began))
	}
	return err
}

func (b *bench) startBlockPair(ctx context.Context, name string) (*blockPair, error) {
	return b.startBlockPairVia(ctx, name, false)
}

// startDefaultBlockPair is startBlockPair with the pool as a default
// install has it (--block-pool-filesystem=auto): in the work directory,
// whose filesystem has no reflinks, the driver keeps a btrfs (an xfs with
// reflinks on a machine without btrfs).
func (b *bench) startDefaultBlockPair(ctx context.Context, name string) (*blockPair, error) {
	return b.startKeptBlockPair(ctx, name)
}

// startKeptBlockPair is startBlockPair with the pool in the work directory
// and the driver's --block-pool-filesystem given by extra (none: the
// default).
func (b *bench) startKeptBlockPair(ctx context.Context, name string, extra ...string) (*blockPair, error) {
	dir := b.dir(name)
	pool := filepath.Join(dir, "pool")
	if err := os.MkdirAll(pool, 0o700); err != nil {
		return nil, err
	}
	return b.startBlockPairIn(ctx, dir, pool, extra...)
}

// startBlockPairVia is startBlockPair with, when viaTarget, the pool owned
// by a storage target that the controller reaches over a unix socket.
func (b *bench) startBlockPairVia(ctx context.Context, name string, viaTarget bool) (*blockPair, error) {
	dir := b.dir(name)
	pool := filepath.Join(dir, "pool")
	if err := os.MkdirAll(pool, 0o700); err != nil {
		return nil, err
	}
	poolArg := "--block-pool=" + zone + "=" + pool
	ctrlBlockArg := poolArg
	if viaTarget {
		t, err := newTarget(b.opts.binary, filepath.Join(dir, "target"), pool)
		if err != nil {
			return nil, err
		}
		b.plugins = append(b.plugins, t)
		if _, err := t.start(ctx); err != nil {
			return nil, err
		}
		ctrlBlockArg = "--block-target=" + zone + "=unix://" + t.socket
	}
	ctrl, err := b.plugin(ctx, "controller", filepath.Join(dir, "controller"),
		"--roles", "controller", ctrlBlockArg, "--block-pool-filesystem=direct", "--max-volumes-per-node", "100000")
	if err != nil {
		return nil, err
	}
	node, err := b.plugin(ctx, "node", filepath.Join(dir, "node"),
		"--roles", "node", "--node-id", nodeName, "--zone", zone, poolArg, "--block-pool-filesystem=direct",
		"--state-dir", filepath.Join(dir, "node", "state"), "--max-volumes-per-node", "100000")
	if err != nil {
		return nil, err
	}
	info, err := node.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, err
	}
	return &blockPair{ctrl: ctrl, node: node, nodeID: info.GetNodeId(), kubelet: filepath.Join(dir, "kubelet"), pool: pool}, nil
}

// publish takes a new volume through create, attach, stage and publish, and
// returns its id and target path.
func (p *blockPair) publish(ctx context.Context, name string, size int64, c *csi.VolumeCapability) (string, string, error) {
	var vol *csi.CreateVolumeResponse
	var pub *csi.ControllerPublishVolumeResponse
	var err error
	if err := p.step("CreateVolume", func() error {
		vol, err = p.ctrl.ctrl.CreateVolume(ctx, createReq(name, size, c, nil))
		return err
	}); err != nil {
		return "", "", fmt.Errorf("CreateVolume: %w", err)
	}
	id := vol.GetVolume().GetVolumeId()
	if err := p.step("ControllerPublishVolume", func() error {
		pub, err = p.ctrl.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: p.nodeID, VolumeCapability: c})
		return err
	}); err != nil {
		return id, "", fmt.Errorf("ControllerPublishVolume: %w", err)
	}
	staging, target := filepath.Join(p.kubelet, "staging", name), filepath.Join(p.kubelet, "pods", name, "vol")
	if err := p.step("NodeStageVolume", func() error {
		_, err := p.node.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging,
			VolumeCapability: c, PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolume().GetVolumeContext()})
		return err
	}); err != nil {
		return id, "", fmt.Errorf("NodeStageVolume: %w", err)
	}
	if err := p.step("NodePublishVolume", func() error {
		_, err := p.node.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
			VolumeCapability: c, PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolume().GetVolumeContext()})
		return err
	}); err != nil {
		return id, "", fmt.Errorf("NodePublishVolume: %w", err)
	}
	return id, target, nil
}

// unpublish takes a published volume back through every step to deletion.
func (p *blockPair) unpublish(ctx context.Context, name, id string) error {
	staging, target := filepath.Join(p.kubelet, "staging", name), filepath.Join(p.kubelet, "pods", name, "vol")
	for _, s := range []struct {
		name string
		call func() error
	}{
		{"NodeUnpublishVolume", func() error {
			_, err := p.node.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			return err
		}},
		{"NodeUnstageVolume", func() error {
			_, err := p.node.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}},
		{"ControllerUnpublishVolume", func() error {
			_, err := p.ctrl.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: p.nodeID})
			return err
		}},
		{"DeleteVolume", func() error {
			_, err := p.ctrl.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		}},
	} {
		if err := p.step(s.name, s.call); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// throughTarget: the raw block lifecycle with the controller reaching the
// pool through a storage target (its API on a unix socket), against the
// same with the pool the controller's own, alternating, as a ratio; and
// the controller calls that cross to the target.
func throughTarget(ctx context.Context, b *bench) ([]row, error) {
	direct, err := b.startBlockPairVia(ctx, "target-direct", false)
	if err != nil {
		return nil, err
	}
	remote, err := b.startBlockPairVia(ctx, "target-remote", true)
	if err != nil {
		return nil, err
	}
	c := capability(singleWriter, "")
	n := 10 * b.opts.runs
	var viaDirect, viaTarget []time.Duration
	for i := -2; i < n; i++ { // two warm-up rounds
		if i == 0 {
			remote.steps = map[string][]time.Duration{}
		}
		for _, p := range []*blockPair{direct, remote} {
			name := fmt.Sprintf("life-%d", i+2)
			began := time.Now()
			id, _, err := p.publish(ctx, name, gib, c)
			if err == nil {
				err = p.unpublish(ctx, name, id)
			}
			if err != nil {
				return nil, err
			}
			if i >= 0 && p == direct {
				viaDirect = append(viaDirect, time.Since(began))
			} else if i >= 0 {
				viaTarget = append(viaTarget, time.Since(began))
			}
		}
	}
	dm, _ := stats(viaDirect)
	tm, _ := stats(viaTarget)
	rows := []row{
		durationRow("lifecycle 1 GiB raw block, pool behind a target", viaTarget, "", fmt.Sprintf("%d lifecycles, the target's API on a unix socket", n)),
		durationRow("  the same, the pool the controller's own", viaDirect, "", "alternating with the above"),
		{name: "  target / own pool", value: fmt.Sprintf("%.2fx", float64(tm)/float64(dm)), note: "median over median"},
	}
	for _, call := range []string{"CreateVolume", "ControllerPublishVolume", "ControllerUnpublishVolume", "DeleteVolume"} {
		rows = append(rows, durationRow("    "+call+" via the target", remote.steps[call], "", ""))
	}
	return rows, nil
}

// lifecycle: the full life of a 1 GiB volume, raw block and ext4, against
// the bare commands underneath (the floor), on each pool onEachPool
// compares.
func lifecycle(ctx context.Context, b *bench) ([]row, error) {
	return b.onEachPool(ctx, "lifecycle", func(p *blockPair, pool string) ([]row, error) {
		suffix := ""
		if pool != blockPoolOnDisk {
			suffix = ", " + pool
		}
		return lifecycleOn(ctx, b, p, suffix)
	})
}

// blockPoolOnDisk names the pool directory on the machine's disk, used as
// it is; the other pools onEachPool measures are kept in such a directory.
const blockPoolOnDisk = "pool directory on the disk"

// onEachPool starts a controller and node plugin on each pool the block
// measurements compare (the directory on the disk, the pool a default
// install keeps there, a kept xfs), runs measure on it and stops them.
func (b *bench) onEachPool(ctx context.Context, name string, measure func(p *blockPair, pool string) ([]row, error)) ([]row, error) {
	var rows []row
	for _, pool := range []struct {
		name  string
		start func(context.Context, string) (*blockPair, error)
	}{
		{blockPoolOnDisk, b.startBlockPair},
		{"default pool (kept btrfs)", b.startDefaultBlockPair},
		{"kept xfs", func(ctx context.Context, name string) (*blockPair, error) {
			return b.startKeptBlockPair(ctx, name, "--block-pool-filesystem=xfs")
		}},
	} {
		p, err := pool.start(ctx, name)
		if err != nil {
			return rows, err
		}
		r, err := measure(p, pool.name)
		rows = append(rows, r...)
		if err != nil {
			return rows, err
		}
		b.cleanup()
	}
	return rows, nil
}

func lifecycleOn(ctx context.Context, b *bench, p *blockPair, suffix string) ([]row, error) {
	n := 10 * b.opts.runs
	var rows []row
	for _, kind := range []struct {
		name, fs, target string
		floor            func(dir string, i int) error
	}{
		{"raw block", "", "<= 20ms", floorRaw},
		{"ext4", "ext4", "<= 50ms", floorExt4},
	} {
		c := capability(singleWriter, kind.fs)
		var driver, floor []time.Duration
		p.steps = nil
		for i := -2; i < n; i++ { // two warm-up rounds
			if i == 0 {
				p.steps = map[string][]time.Duration{}
			}
			name := fmt.Sprintf("life-%s-%d", strings.ReplaceAll(kind.name, " ", ""), i+2)
			began := time.Now()
			id, _, err := p.publish(ctx, name, gib, c)
			if err == nil {
				err = p.unpublish(ctx, name, id)
			}
			if err != nil {
				return rows, fmt.Errorf("%s lifecycle: %w", kind.name, err)
			}
			if i >= 0 {
				driver = append(driver, time.Since(began))
			}
			began = time.Now()
			if err := kind.floor(p.pool, i+2); err != nil {
				return rows, fmt.Errorf("%s floor: %w", kind.name, err)
			}
			if i >= 0 {
				floor = append(floor, time.Since(began))
			}
		}
		dm, _ := stats(driver)
		fm, _ := stats(floor)
		rows = append(rows,
			durationRow("lifecycle 1 GiB "+kind.name+suffix, driver, kind.target, fmt.Sprintf("%d lifecycles: create, attach, stage, publish and back", n)),
			durationRow("  floor: the bare commands", floor, "", "truncate, losetup --direct-io, "+map[string]string{"": "bind mount", "ext4": "mkfs.ext4, mount, bind mount"}[kind.fs]+", umount, detach, rm"),
			row{name: "  driver overhead", value: ms(dm - fm), note: "median minus floor median"})
		for _, call := range []string{"CreateVolume", "ControllerPublishVolume", "NodeStageVolume", "NodePublishVolume",
			"NodeUnpublishVolume", "NodeUnstageVolume", "ControllerUnpublishVolume", "DeleteVolume"} {
			rows = append(rows, durationRow("    "+call, p.steps[call], "", ""))
		}
		p.steps = nil
	}
	return rows, nil
}

func sh(args ...string) (string, error) {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

// floorRaw: what a raw block lifecycle must do at least.
func floorRaw(dir string, i int) error {
	img, target := filepath.Join(dir, fmt.Sprintf("floor-%d.img", i)), filepath.Join(dir, fmt.Sprintf("floor-%d.dev", i))
	if _, err := sh("truncate", "-s", "1G", img); err != nil {
		return err
	}
	dev, err := sh("losetup", "--direct-io=on", "-f", "--show", img)
	if err != nil {
		return err
	}
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		return err
	}
	steps := [][]string{{"mount", "--bind", dev, target}, {"umount", target}, {"losetup", "-d", dev}, {"rm", "-f", img, target}}
	for _, s := range steps {
		if _, err := sh(s...); err != nil {
			return err
		}
	}
	return nil
}

// floorExt4: what an ext4 lifecycle must do at least.
func floorExt4(dir string, i int) error {
	img := filepath.Join(dir, fmt.Sprintf("floor-%d.img", i))
	staging, target := filepath.Join(dir, fmt.Sprintf("floor-%d.stage", i)), filepath.Join(dir, fmt.Sprintf("floor-%d.target", i))
	for _, d := range []string{staging, target} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return err
		}
	}
	for _, s := range [][]string{{"truncate", "-s", "1G", img}, {"mkfs.ext4", "-F", "-q", "-m0", img}} {
		if _, err := sh(s...); err != nil {
			return err
		}
	}
	dev, err := sh("losetup", "--direct-io=on", "-f", "--show", img)
	if err != nil {
		return err
	}
	steps := [][]string{{"mount", dev, staging}, {"mount", "--bind", staging, target}, {"umount", target}, {"umount", staging},
		{"losetup", "-d", dev}, {"rm", "-rf", img, staging, target}}
	for _, s := range steps {
		if _, err := sh(s...); err != nil {
			return err
		}
	}
	return nil
}

// concurrencyVolumeSize: 64 volumes of it must fit the pool at once (a
// pool reserves every volume's full size, sparse images or not).
const concurrencyVolumeSize = 256 << 20

// scaleVolumeSize is the size of the volumes that only have to exist in
// numbers (controller start-up, ListVolumes, memory): thousands of them must
// fit the pool's disk.
const scaleVolumeSize = 1 << 20

// concurrency: -concurrent CreateVolume calls at once, then as many
// DeleteVolume calls, against the same calls one at a time, on each of
// the pools onEachPool compares.
func concurrency(ctx context.Context, b *bench) ([]row, error) {
	return b.onEachPool(ctx, "concurrency", func(p *blockPair, pool string) ([]row, error) {
		return concurrencyOn(ctx, b, p, pool)
	})
}

func concurrencyOn(ctx context.Context, b *bench, p *blockPair, where string) ([]row, error) {
	n := b.opts.concurrent
	var rows []row
	for _, kind := range []struct{ name, fs string }{{"raw block", ""}, {"ext4", "ext4"}} {
		c := capability(singleWriter, kind.fs)
		var ratios []float64
		var seqS, parS []time.Duration
		for r := 0; r < b.opts.runs; r++ {
			seq, err := createDelete(ctx, p.ctrl, fmt.Sprintf("seq%d", r), n, 1, c)
			if err != nil {
				return rows, err
			}
			par, err := createDelete(ctx, p.ctrl, fmt.Sprintf("par%d", r), n, n, c)
			if err != nil {
				return rows, err
			}
			seqS, parS = append(seqS, seq), append(parS, par)
			ratios = append(ratios, seq.Seconds()/par.Seconds())
		}
		sm, _ := stats(seqS)
		pm, _ := stats(parS)
		slicesSortFloat(ratios)
		rows = append(rows,
			durationRow(fmt.Sprintf("%d creates + %d deletes (256 MiB), one at a time, %s, %s", n, n, kind.name, where), seqS, "", fmt.Sprintf("%.0f calls/s", float64(2*n)/sm.Seconds())),
			durationRow(fmt.Sprintf("%d creates + %d deletes (256 MiB), all in flight, %s, %s", n, n, kind.name, where), parS, "", fmt.Sprintf("%.0f calls/s, no errors", float64(2*n)/pm.Seconds())),
			row{name: "  throughput gain", value: fmt.Sprintf("%.2fx", ratios[len(ratios)/2]),
				spread: fmt.Sprintf("%.2fx..%.2fx", ratios[0], ratios[len(ratios)-1]), target: ">= 4x"})
	}
	return rows, nil
}

func slicesSortFloat(f []float64) {
	for i := 1; i < len(f); i++ {
		for j := i; j > 0 && f[j] < f[j-1]; j-- {
			f[j], f[j-1] = f[j-1], f[j]
		}
	}
}

// createDelete creates n volumes with the given parallelism, then deletes
// them the same way, and returns the time of both phases together.
func createDelete(ctx context.Context, ctrl *plugin, prefix string, n, parallel int, c *csi.VolumeCapability) (time.Duration, error) {
	ids := make([]string, n)
	run := func(f func(i int) error) error {
		sem := make(chan struct{}, parallel)
		errs := make(chan error, n)
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			sem <- struct{}{}
			go func(i int) {
				defer wg.Done()
				defer func() { <-sem }()
				if err := f(i); err != nil {
					errs <- err
				}
			}(i)
		}
		wg.Wait()
		close(errs)
		return <-errs
	}
	began := time.Now()
	if err := run(func(i int) error {
		resp, err := ctrl.ctrl.CreateVolume(ctx, createReq(fmt.Sprintf("%s-%d", prefix, i), concurrencyVolumeSize, c, nil))
		ids[i] = resp.GetVolume().GetVolumeId()
		return err
	}); err != nil {
		return 0, fmt.Errorf("CreateVolume (%d in flight): %w", parallel, err)
	}
	if err := run(func(i int) error {
		_, err := ctrl.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: ids[i]})
		return err
	}); err != nil {
		return 0, fmt.Errorf("DeleteVolume (%d in flight): %w", parallel, err)
	}
	return time.Since(began), nil
}

// inBatches runs f for every i in [from, to), eight at a time (the
// driver's records are made durable one fsync at a time; eight in flight
// fill the disk's queue), and returns the first error.
func inBatches(from, to int, f func(i int) error) error {
	const parallel = 8
	for from < to {
		batch := min(parallel, to-from)
		var wg sync.WaitGroup
		errs := make(chan error, batch)
		for i := from; i < from+batch; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := f(i); err != nil {
					errs <- err
				}
			}()
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			return err
		}
		from += batch
	}
	return nil
}

// controllerScale: one controller with a block pool and its own ganesha
// (image storage). NFS export scaling, then start-up with many volumes
// recorded, ListVolumes paging and memory with more.
func controllerScale(ctx context.Context, b *bench) ([]row, error) {
	dir := b.dir("controller")
	pool := filepath.Join(dir, "pool")
	if err := os.MkdirAll(pool, 0o700); err != nil {
		return nil, err
	}
	ctrl, err := b.plugin(ctx, "controller", filepath.Join(dir, "controller"),
		"--roles", "controller", "--block-pool="+zone+"="+pool, "--block-pool-filesystem=direct", "--max-volumes-per-node", "100000",
		"--nfs-export-root", filepath.Join(dir, "nfs"), "--nfs-storage", "images", "--nfs-image-filesystem", b.opts.nfsImageFS,
		"--nfs-server", "127.0.0.1", "--nfs-listen-address", "127.0.0.1", "--nfs-port", "20490",
		"--nfs-ganesha-dir", filepath.Join(dir, "ganesha"))
	if err != nil {
		return nil, err
	}
	defer stopGanesha(filepath.Join(dir, "ganesha"))
	var rows []row
	nfsCap := capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, "ext4")
	nfsParams := map[string]string{"backend": "nfs"}
	nfsCount := 0
	nfsSize := int64(300 << 20)
	if b.opts.nfsImageFS == "ext4" {
		nfsSize = 16 << 20
	}
	createNFS := func(name string) (string, error) {
		resp, err := ctrl.ctrl.CreateVolume(ctx, createReq(name, nfsSize, nfsCap, nfsParams))
		if err != nil {
			return "", fmt.Errorf("CreateVolume nfs: %w", err)
		}
		return resp.GetVolume().GetVolumeId(), nil
	}
	createsAt, publishesAt := map[int][]time.Duration{}, map[int][]time.Duration{}
	for _, target := range b.opts.nfsCounts {
		if err := inBatches(nfsCount, target, func(i int) error {
			_, err := createNFS(fmt.Sprintf("nfs-%d", i))
			return err
		}); err != nil {
			return rows, err
		}
		nfsCount = max(nfsCount, target)
		var creates, publishes []time.Duration
		for i := 0; i < 10*b.opts.runs; i++ {
			began := time.Now()
			id, err := createNFS(fmt.Sprintf("nfs-extra-%d-%d", target, i))
			if err != nil {
				return rows, err
			}
			creates = append(creates, time.Since(began))
			node := fmt.Sprintf("bench-n%d@%s@127.0.1.%d", i%200, zone, 1+i%200)
			began = time.Now()
			if _, err := ctrl.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: nfsCap}); err != nil {
				return rows, fmt.Errorf("ControllerPublishVolume nfs: %w", err)
			}
			publishes = append(publishes, time.Since(began))
			if _, err := ctrl.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node}); err != nil {
				return rows, err
			}
			if _, err := ctrl.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				return rows, err
			}
		}
		cr := durationRow(fmt.Sprintf("NFS CreateVolume with %d NFS volumes", target), creates, "", "image storage: truncate, mkfs."+b.opts.nfsImageFS+", mount, export")
		cr.note += ", p99 " + ms(p99(creates))
		pr := durationRow(fmt.Sprintf("NFS ControllerPublish with %d NFS volumes", target), publishes, "p99 <= 30ms", "export file + ganesha UpdateExport over D-Bus, p99 "+ms(p99(publishes)))
		rows = append(rows, cr, pr)
		createsAt[target], publishesAt[target] = creates, publishes
	}
	if lo, hi := b.opts.nfsCounts[0], b.opts.nfsCounts[len(b.opts.nfsCounts)-1]; lo != hi {
		rows = append(rows,
			growthRow(fmt.Sprintf("  NFS CreateVolume at %d / at %d", hi, lo), createsAt[lo], createsAt[hi]),
			growthRow(fmt.Sprintf("  NFS ControllerPublish at %d / at %d", hi, lo), publishesAt[lo], publishesAt[hi]))
	}

	if err := inBatches(nfsCount, b.opts.nfsVols, func(i int) error {
		_, err := createNFS(fmt.Sprintf("nfs-%d", i))
		return err
	}); err != nil {
		return rows, err
	}
	nfsCount = max(nfsCount, b.opts.nfsVols)
	// A share of them held by nodes, as in a cluster: a restart serves
	// those at once and the others at their next publish.
	list, err := ctrl.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		return rows, err
	}
	published := 0
	for i, e := range list.GetEntries() {
		if float64(published) >= b.opts.nfsPublished*float64(nfsCount) {
			break
		}
		if !strings.HasPrefix(e.GetVolume().GetVolumeId(), "nfs") {
			continue
		}
		node := fmt.Sprintf("bench-held-n%d@%s@127.0.2.%d", i%200, zone, 1+i%200)
		if _, err := ctrl.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: e.GetVolume().GetVolumeId(), NodeId: node, VolumeCapability: nfsCap}); err != nil {
			return rows, fmt.Errorf("ControllerPublishVolume nfs: %w", err)
		}
		published++
	}
	restarts := func(what string) error {
		var starts []time.Duration
		for r := 0; r < b.opts.runs; r++ {
			ctrl.stop()
			d, err := ctrl.start(ctx)
			if err != nil {
				return err
			}
			starts = append(starts, d)
		}
		rows = append(rows, durationRow("controller start to ready, "+what, starts, "<= 3s (1,000 NFS) / <= 5s (5,000 block + 1,000 NFS)",
			fmt.Sprintf("exec to Probe ready; ganesha started, the %d published NFS volumes mounted and exported", published)))
		return nil
	}
	// Start-up with the NFS volumes alone, then with block volumes too.
	if err := restarts(fmt.Sprintf("%d NFS volumes", nfsCount)); err != nil {
		return rows, err
	}
	blockCap := capability(singleWriter, "")
	made := 0
	fillBlock := func(total int) error {
		err := inBatches(made, total, func(i int) error {
			if _, err := ctrl.ctrl.CreateVolume(ctx, createReq(fmt.Sprintf("blk-%d", i), scaleVolumeSize, blockCap, nil)); err != nil {
				return fmt.Errorf("CreateVolume block: %w", err)
			}
			return nil
		})
		made = max(made, total)
		return err
	}
	if err := fillBlock(b.opts.blockVols); err != nil {
		return rows, err
	}
	if err := restarts(fmt.Sprintf("%d block + %d NFS volumes", b.opts.blockVols, nfsCount)); err != nil {
		return rows, err
	}

	// ListVolumes paging and memory with more volumes.
	if err := fillBlock(b.opts.listVols - nfsCount); err != nil {
		return rows, err
	}
	pages := map[string][]time.Duration{}
	var order []string
	total := 0
	for r := 0; r < b.opts.runs; r++ {
		token, page := "", 0
		for {
			began := time.Now()
			resp, err := ctrl.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 100, StartingToken: token})
			if err != nil {
				return rows, fmt.Errorf("ListVolumes at page %d: %w", page, err)
			}
			d := time.Since(began)
			total = page*100 + len(resp.GetEntries())
			var bucket string
			switch {
			case page < 10:
				bucket = "first 10 pages"
			case page >= (b.opts.listVols/100)-10:
				bucket = "last 10 pages"
			case page >= (b.opts.listVols/200)-5 && page < (b.opts.listVols/200)+5:
				bucket = "10 pages in the middle"
			}
			if bucket != "" {
				if _, ok := pages[bucket]; !ok {
					order = append(order, bucket)
				}
				pages[bucket] = append(pages[bucket], d)
			}
			token = resp.GetNextToken()
			page++
			if token == "" {
				break
			}
		}
	}
	for _, bucket := range order {
		rows = append(rows, durationRow(fmt.Sprintf("ListVolumes page of 100 of %d, %s", total, bucket), pages[bucket], "flat", ""))
	}
	rss, err := ctrl.rssKiB()
	if err != nil {
		return rows, err
	}
	rows = append(rows, row{name: fmt.Sprintf("controller RSS with %d volumes", total), value: fmt.Sprintf("%.1f MiB", float64(rss)/1024),
		target: "<= 64 MiB", note: "after paging through them all"})
	return rows, nil
}

// stopGanesha stops a ganesha the controller left behind, by the PID in its
// pid file (the controller stops its own on SIGTERM; this is for failures).
func stopGanesha(dir string) {
	data, err := os.ReadFile(filepath.Join(dir, "ganesha.pid"))
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 1 {
		return
	}
	if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); strings.Contains(exe, "ganesha") {
		if p, err := os.FindProcess(pid); err == nil {
			_ = p.Kill()
		}
	}
}

// nodeScale: a node plugin with many published volumes: memory, and how
// long a restart takes until it is ready again.
func nodeScale(ctx context.Context, b *bench) ([]row, error) {
	p, err := b.startBlockPair(ctx, "node")
	if err != nil {
		return nil, err
	}
	c := capability(singleWriter, "ext4")
	for i := 0; i < b.opts.nodeVols; i++ {
		if _, _, err := p.publish(ctx, fmt.Sprintf("pub-%d", i), 64<<20, c); err != nil {
			return nil, fmt.Errorf("volume %d: %w", i, err)
		}
	}
	rss, err := p.node.rssKiB()
	if err != nil {
		return nil, err
	}
	var starts []time.Duration
	for r := 0; r < b.opts.runs; r++ {
		p.node.stop()
		d, err := p.node.start(ctx)
		if err != nil {
			return nil, err
		}
		starts = append(starts, d)
	}
	rssAfter, err := p.node.rssKiB()
	if err != nil {
		return nil, err
	}
	return []row{
		durationRow(fmt.Sprintf("node plugin start to ready, %d published volumes", b.opts.nodeVols), starts, "<= 1s",
			"exec to Probe ready; lock files read and reconciled with the mounts"),
		{name: fmt.Sprintf("node plugin RSS with %d published volumes", b.opts.nodeVols), value: fmt.Sprintf("%.1f MiB", float64(rss)/1024),
			target: "<= 32 MiB", note: fmt.Sprintf("%.1f MiB after a restart", float64(rssAfter)/1024)},
	}, nil
}

// dataPath: fio on a published raw block volume (a direct-I/O loop device)
// against the same fio on a file in the pool's own filesystem.
func dataPath(ctx context.Context, b *bench) ([]row, error) {
	if _, err := exec.LookPath("fio"); err != nil {
		return nil, fmt.Errorf("fio not installed (apt-get install fio; make bench does)")
	}
	p, err := b.startBlockPair(ctx, "fio")
	if err != nil {
		return nil, err
	}
	_, device, err := p.publish(ctx, "fio", gib, capability(singleWriter, ""))
	if err != nil {
		return nil, err
	}
	file := filepath.Join(p.pool, "fio-reference")
	if _, err := sh("truncate", "-s", "1G", file); err != nil {
		return nil, err
	}
	runs := min(b.opts.runs, 3)
	var rows []row
	for _, job := range []struct {
		name, rw, bs, unit string
		iodepth            int
	}{
		{"1 MiB sequential write", "write", "1M", "MiB/s", 8},
		{"4 KiB random write", "randwrite", "4k", "IOPS", 32},
	} {
		var vol, ref []float64
		for r := 0; r < runs; r++ {
			for _, t := range []struct {
				path string
				out  *[]float64
			}{{device, &vol}, {file, &ref}} {
				v, err := fio(t.path, job.rw, job.bs, job.iodepth, b.opts.fioSeconds, job.unit)
				if err != nil {
					return rows, err
				}
				*t.out = append(*t.out, v)
			}
		}
		slicesSortFloat(vol)
		slicesSortFloat(ref)
		mv, mr := vol[len(vol)/2], ref[len(ref)/2]
		rows = append(rows,
			row{name: "fio " + job.name + ", published volume", value: fmt.Sprintf("%.0f %s", mv, job.unit), spread: fmt.Sprintf("%.0f..%.0f", vol[0], vol[len(vol)-1]), note: fmt.Sprintf("%d runs of %ds, direct I/O, iodepth %d", runs, b.opts.fioSeconds, job.iodepth)},
			row{name: "fio " + job.name + ", file in the pool's filesystem", value: fmt.Sprintf("%.0f %s", mr, job.unit), spread: fmt.Sprintf("%.0f..%.0f", ref[0], ref[len(ref)-1])},
			row{name: "  volume / file", value: fmt.Sprintf("%.2fx", mv/mr), target: ">= 0.9x"})
	}
	return rows, nil
}

func fio(path, rw, bs string, iodepth, seconds int, unit string) (float64, error) {
	out, err := exec.Command("fio", "--name=bench", "--filename="+path, "--rw="+rw, "--bs="+bs,
		"--direct=1", "--ioengine=libaio", fmt.Sprintf("--iodepth=%d", iodepth), "--size=1G",
		fmt.Sprintf("--runtime=%d", seconds), "--time_based", "--output-format=json").Output()
	if err != nil {
		return 0, fmt.Errorf("fio %s on %s: %v", rw, path, err)
	}
	var res struct {
		Jobs []struct {
			Write struct {
				IOPS    float64 `json:"iops"`
				BWBytes float64 `json:"bw_bytes"`
			} `json:"write"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal(out[strings.IndexByte(string(out), '{'):], &res); err != nil || len(res.Jobs) == 0 {
		return 0, fmt.Errorf("fio output: %v", err)
	}
	if unit == "IOPS" {
		return res.Jobs[0].Write.IOPS, nil
	}
	return res.Jobs[0].Write.BWBytes / (1 << 20), nil
}

// sanityWallTime: csi-sanity's wall time per backend and access type, the
// test binaries built first so compilation is not counted.
func sanityWallTime(ctx context.Context, b *bench) ([]row, error) {
	dir := b.dir("sanity")
	var rows []row
	for _, s := range []struct{ pkg, name string }{
		{"./test/sanity/mount", "block backend, mount (ext4)"},
		{"./test/sanity/block", "block backend, raw block"},
		{"./test/sanity/nfs", "NFS backend, mount"},
	} {
		bin := filepath.Join(dir, filepath.Base(s.pkg)+".test")
		if out, err := exec.Command("go", "test", "-c", "-o", bin, s.pkg).CombinedOutput(); err != nil {
			return rows, fmt.Errorf("building %s: %v: %s", s.pkg, err, out)
		}
		var samples []time.Duration
		for r := 0; r < min(b.opts.runs, 3); r++ {
			cmd := exec.Command(bin, "-test.count=1")
			cmd.Dir = s.pkg
			began := time.Now()
			if out, err := cmd.CombinedOutput(); err != nil {
				return rows, fmt.Errorf("%s: %v: %s", s.pkg, err, tail0(out))
			}
			samples = append(samples, time.Since(began))
		}
		rows = append(rows, durationRow("csi-sanity wall time, "+s.name, samples, "", "100 specs; the test binary, not its build"))
	}
	return rows, nil
}

func tail0(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

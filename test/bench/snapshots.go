package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/status"
)

// poolFilesystem is a filesystem a block pool directory can sit on, made
// by the bench for the measurement and removed with it.
type poolFilesystem struct {
	name string
	// make mounts a fresh filesystem of this kind at mnt, using dir for
	// its image.
	make func(dir, mnt string) error
	// args choose the driver's --block-pool-filesystem (none: the default).
	args []string
}

// poolFilesystems are the ones the operator guide names: what a default
// install has (ext4), tmpfs and xfs made without reflinks, on each of which
// the driver keeps a btrfs for the pool (--block-pool-filesystem=auto, the
// default, on this machine), ext4 once more with the xfs kept where btrfs
// is missing, and xfs with reflinks and btrfs, which are pools as they are.
var poolFilesystems = []poolFilesystem{
	{"ext4 (kept btrfs)", imageFilesystem("mkfs.ext4", "-F", "-q"), nil},
	{"ext4 (kept xfs)", imageFilesystem("mkfs.ext4", "-F", "-q"), []string{"--block-pool-filesystem=xfs"}},
	{"tmpfs (kept btrfs)", func(_, mnt string) error {
		_, err := sh("mount", "-t", "tmpfs", "-o", "size=3g,mode=0700", "tmpfs", mnt)
		return err
	}, nil},
	{"xfs reflink=0 (kept btrfs)", imageFilesystem("mkfs.xfs", "-f", "-q", "-m", "reflink=0"), nil},
	{"xfs reflink=1", imageFilesystem("mkfs.xfs", "-f", "-q", "-m", "reflink=1"), nil},
	{"btrfs", imageFilesystem("mkfs.btrfs", "-f", "-q"), nil},
}

// imageFilesystem formats a sparse 3 GiB image in dir and mounts it at mnt.
func imageFilesystem(mkfs ...string) func(dir, mnt string) error {
	return func(dir, mnt string) error {
		img := filepath.Join(dir, "outer.img")
		if _, err := sh("truncate", "-s", "3G", img); err != nil {
			return err
		}
		if _, err := sh(append(mkfs, img)...); err != nil {
			return err
		}
		_, err := sh("mount", "-o", "loop", img, mnt)
		return err
	}
}

// snapshotsInUse: what a snapshot of a volume being written costs its
// writer, on every pool filesystem. A writer rewrites 4 KiB blocks of a
// file on a mounted ext4 volume, each followed by fdatasync, first alone
// (the baseline), then while snapshots of the volume are taken one after
// another. The stall is how much the writer's p99 and longest write grow
// while snapshots are taken; the snapshot call's own time is reported too.
func snapshotsInUse(ctx context.Context, b *bench) ([]row, error) {
	var rows []row
	for i, pf := range poolFilesystems {
		r, err := snapshotsOn(ctx, b, fmt.Sprintf("snapshots-%d", i), pf)
		rows = append(rows, r...)
		if err != nil {
			return rows, fmt.Errorf("pool on %s: %w", pf.name, err)
		}
		b.cleanup()
	}
	return rows, nil
}

func snapshotsOn(ctx context.Context, b *bench, name string, pf poolFilesystem) ([]row, error) {
	dir := b.dir(name)
	outer := filepath.Join(dir, "outer")
	if err := os.Mkdir(outer, 0o700); err != nil {
		return nil, err
	}
	if err := pf.make(dir, outer); err != nil {
		return nil, err
	}
	pool := filepath.Join(outer, "pool")
	if err := os.Mkdir(pool, 0o700); err != nil {
		return nil, err
	}
	p, err := b.startBlockPairIn(ctx, dir, pool, pf.args...)
	if err != nil {
		return nil, err
	}
	id, target, err := p.publish(ctx, "busy", gib, capability(singleWriter, "ext4"))
	if err != nil {
		return nil, err
	}
	w, err := startWriter(filepath.Join(target, "data"))
	if err != nil {
		return nil, err
	}
	baselineFor := time.Duration(b.opts.runs) * 400 * time.Millisecond
	time.Sleep(baselineFor)
	baseline := w.take()

	var calls []time.Duration
	var snaps []string
	var refused error
	for i := 0; i < 4*b.opts.runs; i++ {
		began := time.Now()
		s, err := p.ctrl.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: id, Name: fmt.Sprintf("busy-%d", i)})
		if err != nil {
			refused = err
			break
		}
		calls = append(calls, time.Since(began))
		snaps = append(snaps, s.GetSnapshot().GetSnapshotId())
		time.Sleep(100 * time.Millisecond) // the writer writes between snapshots too
	}
	during := w.take()
	werr := w.stop()

	for _, s := range snaps {
		if _, err := p.ctrl.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: s}); err != nil {
			return nil, fmt.Errorf("DeleteSnapshot %s: %w", s, err)
		}
	}
	if err := p.unpublish(ctx, "busy", id); err != nil {
		return nil, err
	}
	if werr != nil {
		return nil, fmt.Errorf("the writer: %w", werr)
	}
	title := "snapshot of a volume in use, pool on " + pf.name
	if refused != nil {
		st, _ := status.FromError(refused)
		return []row{{name: title, value: "refused", note: st.Code().String() + ": " + st.Message()}}, nil
	}
	baseP99, duringP99 := p99(baseline), p99(during)
	return []row{
		durationRow(title, calls, "", fmt.Sprintf("%d CreateSnapshot calls, 1 GiB ext4 volume being written", len(calls))),
		{name: "  writer's 4 KiB write+fdatasync p99", value: ms(duringP99), spread: "alone " + ms(baseP99),
			target: "<= 50ms", note: fmt.Sprintf("%d writes during the snapshots, %d alone", len(during), len(baseline))},
		{name: "  writer's longest write", value: ms(slicesMax(during)), spread: "alone " + ms(slicesMax(baseline)),
			target: "<= 100ms", note: "the stall a snapshot can cause"},
	}, nil
}

// startBlockPairIn starts a controller and a node plugin on the pool
// directory given, their own state under dir.
func (b *bench) startBlockPairIn(ctx context.Context, dir, pool string, extra ...string) (*blockPair, error) {
	poolArg := "--block-pool=" + zone + "=" + pool
	ctrl, err := b.plugin(ctx, "controller", filepath.Join(dir, "controller"),
		append([]string{"--roles", "controller", poolArg, "--max-volumes-per-node", "100000"}, extra...)...)
	if err != nil {
		return nil, err
	}
	node, err := b.plugin(ctx, "node", filepath.Join(dir, "node"),
		append([]string{"--roles", "node", "--node-id", nodeName, "--zone", zone, poolArg,
			"--state-dir", filepath.Join(dir, "node", "state"), "--max-volumes-per-node", "100000"}, extra...)...)
	if err != nil {
		return nil, err
	}
	info, err := node.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, err
	}
	return &blockPair{ctrl: ctrl, node: node, nodeID: info.GetNodeId(), kubelet: filepath.Join(dir, "kubelet"), pool: pool}, nil
}

// writer rewrites 4 KiB blocks of one file, each followed by fdatasync,
// and keeps how long each took.
type writer struct {
	mu      sync.Mutex
	samples []time.Duration
	quit    chan struct{}
	done    chan error
}

func startWriter(path string) (*writer, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, err
	}
	w := &writer{quit: make(chan struct{}), done: make(chan error, 1)}
	go func() {
		defer f.Close()
		block := make([]byte, 4096)
		for i := 0; ; i++ {
			select {
			case <-w.quit:
				w.done <- nil
				return
			default:
			}
			block[0] = byte(i)
			began := time.Now()
			if _, err := f.WriteAt(block, int64(i%1024)*4096); err != nil {
				w.done <- err
				return
			}
			if err := unix.Fdatasync(int(f.Fd())); err != nil {
				w.done <- err
				return
			}
			took := time.Since(began)
			w.mu.Lock()
			w.samples = append(w.samples, took)
			w.mu.Unlock()
		}
	}()
	return w, nil
}

// take returns the samples since the last take.
func (w *writer) take() []time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.samples
	w.samples = nil
	return s
}

func (w *writer) stop() error {
	close(w.quit)
	select {
	case err := <-w.done:
		return err
	case <-time.After(time.Minute):
		return errors.New("still writing a minute after being told to stop")
	}
}

func slicesMax(s []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range s {
		m = max(m, d)
	}
	return m
}

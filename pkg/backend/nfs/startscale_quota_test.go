package nfs_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testfiles"
)

// startScalePoolSize is the pool image of BenchmarkControllerStartQuotaStorage.
// The image is sparse: what it costs is what xfs writes, about 65 MiB for
// mkfs (mostly the log) plus a few KiB per volume (its directory, record and
// quota), so it fits the VM's tmpfs TMPDIR (half of its 4 GiB of memory)
// with room to spare. Its size only has to hold 5,000 volumes of the
// minimum size (one 4 KiB block each) as far as the controller's promises
// go.
const startScalePoolSize = int64(1) << 30

// BenchmarkControllerStartQuotaStorage measures how a restarted NFS
// controller's start (NewController + Start) grows with the number of
// volumes recorded, on the quota storage (one xfs pool with project
// quotas), with 1% of the volumes published to a node.
//
// It needs a kernel whose xfs has quota support; make test-vm's VM has one.
// Under its emulation each create costs two xfs_quota runs, about 0.5 s,
// so setting up 5,000 volumes takes over 20 minutes, more than the VM's
// default timeout:
//
//	VM_TEST_PKG=pkg/backend/nfs VM_TEST_RACE=0 VM_TEST_TIMEOUT=3600 bash test/vm/projquota.sh \
//		-test.run '^$' -test.bench BenchmarkControllerStartQuotaStorage -test.benchtime 3x
//
// ganesha is the in-memory stand-in loggingGanesha (ganesha cannot run in
// the VM: no D-Bus or network set-up there), so this measures the records
// and the storage, not D-Bus calls.
func BenchmarkControllerStartQuotaStorage(b *testing.B) {
	for _, n := range []int{500, 5000} {
		b.Run(fmt.Sprintf("volumes=%d", n), func(b *testing.B) {
			ctx := context.Background()
			pool, exportDir := startScaleSetUp(b, ctx, n)
			storage := nfs.NewQuotaStorage(pool, nil) // the pool's release is registered by startScaleSetUp
			cfg := nfs.Config{Storage: storage, ExportDir: exportDir, Server: "10.0.0.1"}
			for b.Loop() {
				ctrl, err := nfs.NewController(ctx, cfg)
				if err != nil {
					b.Fatal(err)
				}
				// A restarted controller starts its ganesha afresh.
				if err := ctrl.Start(ctx, newLoggingGanesha(new([]string))); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/1e6/float64(b.N), "ms/start")
		})
	}
}

// startScaleSetUp prepares a pool in a temporary directory, creates n
// volumes of the storage's minimum size through a started controller and
// publishes 1% of them to one node. The pool is released, and checked to
// leave no mount or loop device behind, when b ends.
func startScaleSetUp(b *testing.B, ctx context.Context, n int) (*projquota.Pool, string) {
	b.Helper()
	testfiles.RequireLoopDevices(b, "mounts an xfs pool image on a loop device", "mkfs.xfs", "xfs_quota", "losetup")
	// Not b.TempDir: its name comes from the benchmark's, whose "=" an
	// export path may not hold (ganesha.Export refuses it).
	top, err := os.MkdirTemp("", "startscale-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := os.RemoveAll(top); err != nil {
			b.Errorf("removing the temporary directory: %v", err)
		}
	})
	dir, exportDir := filepath.Join(top, "pool"), filepath.Join(top, "exports")
	pool, release, err := projquota.Prepare(ctx, dir, startScalePoolSize)
	if errors.Is(err, projquota.ErrNoKernelQuota) {
		b.Skipf("cannot measure the quota storage on this machine (VM_TEST_PKG=pkg/backend/nfs test/vm/projquota.sh runs it under a kernel that can): %v", err)
	}
	if err != nil {
		b.Fatalf("Prepare: %v", err)
	}
	// Registered after the removal: cleanups run last first, so the pool
	// is released before its directory is removed.
	b.Cleanup(func() {
		if err := release(); err != nil {
			b.Errorf("releasing the pool: %v", err)
		}
		startScaleCheckNothingLeft(b, dir)
	})

	storage := nfs.NewQuotaStorage(pool, nil)
	ctrl, err := nfs.NewController(ctx, nfs.Config{Storage: storage, ExportDir: exportDir, Server: "10.0.0.1"})
	if err != nil {
		b.Fatal(err)
	}
	if err := ctrl.Start(ctx, newLoggingGanesha(new([]string))); err != nil {
		b.Fatal(err)
	}
	ids := make([]volumeid.ID, n)
	for i := range ids {
		name := fmt.Sprintf("start-scale-%d", i)
		if ids[i], err = volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name)); err != nil {
			b.Fatal(err)
		}
	}
	// CreateVolume may be called concurrently (ids and bytes are reserved
	// under one lock), and each create waits on xfs_quota processes, so
	// one worker per CPU makes the set-up shorter, not different.
	began := time.Now()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
		next     = make(chan int)
	)
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				_, err := ctrl.CreateVolume(ctx, backend.VolumeSpec{
					ID: ids[i], Name: fmt.Sprintf("start-scale-%d", i), CapacityBytes: ctrl.MinimumSize(),
					AccessType: accessmode.Mount, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter},
				})
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("CreateVolume %d of %d: %w", i, n, err)
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := range ids {
		mu.Lock()
		failed := firstErr != nil
		mu.Unlock()
		if failed {
			break
		}
		next <- i
	}
	close(next)
	wg.Wait()
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	created := time.Since(began)

	began = time.Now()
	node := nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.11"}
	published := 0
	for i := 0; i < n; i += 100 {
		if _, err := ctrl.SetAttachments(ctx, ids[i], []accessmode.Attachment{{Node: node, Mode: accessmode.MultiNodeMultiWriter}}); err != nil {
			b.Fatalf("SetAttachments: %v", err)
		}
		published++
	}
	b.Logf("set-up: %d volumes of %d bytes created in %v (%.1f ms each, %d workers), %d published in %v",
		n, ctrl.MinimumSize(), created.Round(time.Millisecond), float64(created.Microseconds())/1e3/float64(n),
		runtime.GOMAXPROCS(0), published, time.Since(began).Round(time.Millisecond))
	return pool, exportDir
}

// startScaleCheckNothingLeft fails b if anything is still mounted under
// dir or a loop device is still bound to a file in it.
func startScaleCheckNothingLeft(b *testing.B, dir string) {
	b.Helper()
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		b.Errorf("checking for leftovers: %v", err)
		return
	}
	for _, m := range localcluster.MountsUnder(real) {
		b.Errorf("left mounted: %s", m)
	}
	for _, l := range localcluster.LoopsUnder(real) {
		b.Errorf("left attached: %s", l)
	}
}

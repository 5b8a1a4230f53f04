package nfs

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestStatsOnADeadServerKeepThreadsFlat: the NFS server stops answering
// (its ganesha is stopped with SIGSTOP: connections stay up, nothing
// answers, as with a hung server) while the kubelet keeps asking for the
// volume's stats. A statfs on the kernel's NFS mount then blocks its OS
// thread until the server answers; the node plugin keeps at most one of
// those per path, answers UNAVAILABLE, and its thread count stays flat over
// 10,000 polls. Once the server answers again, so do the stats, and the
// volume unstages cleanly.
func TestStatsOnADeadServerKeepThreadsFlat(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestKernelNFSAccessModes (the kernel NFS client) and pkg/backend/nfs's bounded statfs")
	e := setup(t, 1)
	ctx := e.ctx
	vm1 := e.vm("vm1")
	v := e.create("dead-server", accessmode.MultiNodeMultiWriter, nil)
	wantCode(t, "start", v.start("vm1", "app", false), codes.OK)
	v.mustWrite("vm1", "app", "before", "written before the server hung")
	target := v.target("vm1", "app")
	node := e.nodes["vm1"]
	stats := func(ctx context.Context) error {
		_, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.v.GetVolumeId(), VolumePath: target})
		return err
	}
	if err := stats(ctx); err != nil {
		t.Fatalf("stats while the server answers: %v", err)
	}
	plugin, err := vm1.PluginStatus(ctx)
	if err != nil || !plugin.Running {
		t.Fatalf("plugin status: %+v, %v", plugin, err)
	}
	threads := func() int {
		t.Helper()
		out, code, err := vm1.Run(ctx, "cat", "/proc/"+strconv.Itoa(plugin.PID)+"/status")
		if err != nil || code != 0 {
			t.Fatalf("reading the plugin's status: %v (exit %d)", err, code)
		}
		for _, line := range strings.Split(out, "\n") {
			if n, ok := strings.CutPrefix(line, "Threads:"); ok {
				v, err := strconv.Atoi(strings.TrimSpace(n))
				if err != nil {
					t.Fatalf("Threads line %q", line)
				}
				return v
			}
		}
		t.Fatalf("no Threads line in:\n%s", out)
		return 0
	}
	// Warm the server up with calls in parallel, as the polls below are,
	// so the baseline has the threads gRPC and the runtime keep anyway.
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); _ = stats(ctx) }()
	}
	wg.Wait()
	before := threads()

	ganeshaPID, _ := testenv.NFSServerPIDs(t, e.ctrl.GaneshaDir)
	if err := syscall.Kill(ganeshaPID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			if err := syscall.Kill(ganeshaPID, syscall.SIGCONT); err != nil {
				t.Errorf("SIGCONT to ganesha (pid %d): %v", ganeshaPID, err)
			}
		}
	}
	t.Cleanup(resume) // whatever happens, the server runs again before cleanup
	t.Logf("ganesha (pid %d) stopped; the plugin (pid %d) has %d threads", ganeshaPID, plugin.PID, before)

	const polls, workers = 10000, 8
	var mu sync.Mutex
	byCode := map[codes.Code]int{}
	next := make(chan int)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range next {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				err := stats(cctx)
				cancel()
				mu.Lock()
				byCode[status.Code(err)]++
				mu.Unlock()
			}
		}()
	}
	for i := range polls {
		next <- i
		if i == polls/2 {
			mu.Lock()
			t.Logf("halfway: %v in %v, %d threads", byCode, time.Since(start).Round(time.Millisecond), threads())
			mu.Unlock()
		}
	}
	close(next)
	wg.Wait()
	after := threads()
	t.Logf("%d polls in %v: %v; threads %d before, %d after", polls, time.Since(start).Round(time.Millisecond), byCode, before, after)
	// The first polls may still have found the server answering before
	// the kernel sent the request the stopped server never reads; every
	// other one must say the volume is unreachable.
	if byCode[codes.Unavailable] < polls-workers {
		t.Errorf("%d of %d polls answered UNAVAILABLE (%v), want all but the first few", byCode[codes.Unavailable], polls, byCode)
	}
	for c, n := range byCode {
		if c != codes.Unavailable && c != codes.OK {
			t.Errorf("%d polls answered %s, want UNAVAILABLE", n, c)
		}
	}
	// One statfs blocked in the kernel holds one thread; the rest is the
	// runtime's slack, never one thread per poll.
	if after > before+4 {
		t.Errorf("the plugin's threads grew from %d to %d over %d polls of a dead server", before, after, polls)
	}

	resume()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := stats(ctx)
		if err == nil {
			break
		}
		if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
			t.Fatalf("stats after the server came back: %v", err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	v.mustRead("vm1", "app", "before", "written before the server hung")
	v.stop("vm1", "app")
	v.delete()
}

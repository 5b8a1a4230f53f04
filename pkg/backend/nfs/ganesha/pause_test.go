package ganesha

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
)

// TestPauseHoldsGaneshaStillAndResumesIt: while paused, every thread of
// ganesha is stopped and a client writing through it makes no progress;
// after resume the same process runs on and the client's writes go on. A
// pause its caller never ends is ended by its bound, and resume then says
// so. Stop of a paused server does not wait for the pause.
func TestPauseHoldsGaneshaStillAndResumesIt(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	node := net.Nodes[0]
	runDir, exportDir, data := testDirs(t)
	srv := startServer(t, net, runDir, exportDir)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const id, pseudo = 21, "/pvc-21"
	confPath := ExportFilePath(exportDir, id)
	if err := WriteExportFile(confPath, Export{ID: id, Path: data, Pseudo: pseudo, Clients: []ClientRule{{Address: node.Addr}}}); err != nil {
		t.Fatal(err)
	}
	if err := srv.Control().ApplyExport(ctx, confPath, id); err != nil {
		t.Fatal(err)
	}
	pid := srv.GaneshaPID()

	// The writer: record n is the file rN, written by nfs-cp; acked is
	// the count of records nfs-cp reported written.
	var acked atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writeErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		local := filepath.Join(t.TempDir(), "record")
		for n := 0; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := os.WriteFile(local, fmt.Appendf(nil, "%d\n", n), 0o644); err != nil {
				writeErr = err
				return
			}
			if err := node.NFSCopy(ctx, local, net.NFSURL(pseudo, fmt.Sprintf("r%d", n))); err != nil {
				writeErr = err
				return
			}
			acked.Add(1)
		}
	}()
	defer func() {
		close(stop)
		wg.Wait()
		if writeErr != nil {
			t.Errorf("the writer: %v", writeErr)
		}
	}()
	waitAcked := func(what string, past int64) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for acked.Load() <= past {
			if time.Now().After(deadline) {
				t.Fatalf("%s: no write acknowledged in 30 s (still %d)", what, past)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	filesIn := func() int {
		entries, err := os.ReadDir(data)
		if err != nil {
			t.Fatal(err)
		}
		return len(entries)
	}
	wantRunning := func(what string) {
		t.Helper()
		if now := srv.GaneshaPID(); now != pid {
			t.Fatalf("%s: ganesha is pid %d, was %d: it was restarted", what, now, pid)
		}
		states, err := ThreadStates(pid)
		if err != nil {
			t.Fatal(err)
		}
		for tid, st := range states {
			if st != 'S' && st != 'R' && st != 'D' {
				t.Errorf("%s: thread %s of ganesha is in state %c, want running or sleeping", what, tid, st)
			}
		}
	}

	waitAcked("before the pause", 0)
	for round := range 3 {
		resume, err := srv.Pause(ctx, 10*time.Second)
		if err != nil {
			t.Fatalf("Pause: %v", err)
		}
		states, err := ThreadStates(pid)
		if err != nil {
			t.Fatal(err)
		}
		for tid, st := range states {
			if st != 'T' {
				t.Errorf("round %d: thread %s of a paused ganesha is in state %c, want T", round, tid, st)
			}
		}
		before, files := acked.Load(), filesIn()
		time.Sleep(500 * time.Millisecond)
		if n, f := acked.Load(), filesIn(); n > before+1 || f != files {
			// One nfs-cp may have been answered just before the stop.
			t.Errorf("round %d: during the pause %d writes were acknowledged and %d files appeared", round, n-before, f-files)
		}
		if err := resume(); err != nil {
			t.Fatalf("round %d: resume: %v", round, err)
		}
		wantRunning(fmt.Sprintf("round %d, after resume", round))
		waitAcked(fmt.Sprintf("round %d, after resume", round), acked.Load())
	}

	// A pause nobody ends is ended by its bound.
	began := time.Now()
	resume, err := srv.Pause(ctx, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	waitAcked("after a pause left to run out", acked.Load())
	if took := time.Since(began); took < 300*time.Millisecond {
		t.Errorf("a write was acknowledged %v into a pause bounded by 300ms", took)
	}
	wantRunning("after a pause ran out")
	if err := resume(); !errors.Is(err, ErrPauseExpired) {
		t.Errorf("resume after the pause ran out: %v, want ErrPauseExpired", err)
	}
	// The bound ended that pause: a new one can start.
	resume, err = srv.Pause(ctx, 10*time.Second)
	if err != nil {
		t.Fatalf("Pause after one ran out: %v", err)
	}
	if err := resume(); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Pause(ctx, 0); err == nil {
		t.Error("Pause with no bound succeeded")
	}
}

// TestStopEndsAPause: a server stopped while paused stops at once (SIGTERM
// is acted on after SIGCONT) rather than after StopTimeout and SIGKILL.
func TestStopEndsAPause(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	runDir, exportDir, _ := testDirs(t)
	srv := startServer(t, net, runDir, exportDir, func(c *ServerConfig) { c.StopTimeout = 20 * time.Second })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resume, err := srv.Pause(ctx, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if err := srv.Stop(); err != nil {
		t.Errorf("Stop of a paused server: %v", err)
	}
	if took := time.Since(began); took > 10*time.Second {
		t.Errorf("Stop of a paused server took %v", took)
	}
	_ = resume()
	if _, err := srv.Pause(ctx, time.Second); err == nil {
		t.Error("Pause of a stopped server succeeded")
	}
}

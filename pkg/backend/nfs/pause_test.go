package nfs_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testfiles"
)

// pausedServer is a controller on a real quota pool served by a real
// ganesha of its own, which it pauses for copies of volumes in use, and a
// node namespace to write through it from.
type pausedServer struct {
	ctrl    *nfs.Controller
	srv     *ganesha.Server
	root    string // the pool's root
	net     *ganeshatest.Network
	node    ganeshatest.Namespace
	pid     int // ganesha's
	mu      sync.Mutex
	pauses  []string // "outcome" per pause, as Config.Paused heard them
	took    []time.Duration
	stopped []string // threads not stopped right after a Pause returned
}

// pausedOptions change a pausedServer.
type pausedOptions struct {
	// mkfs, when set, formats the pool image with these mkfs.xfs options
	// (Prepare keeps an image it finds as it is).
	mkfs []string
	// noPause leaves Config.Pause unset, as with a ganesha the driver does
	// not run.
	noPause bool
}

// startPausedServer sets up a pausedServer with the given pause budget.
func startPausedServer(t *testing.T, budget time.Duration, opts pausedOptions) *pausedServer {
	mkfsArgs := opts.mkfs
	t.Helper()
	testfiles.RequireLoopDevices(t, "mounts an xfs pool image on a loop device", "mkfs.xfs", "xfs_quota", "losetup", "cp")
	ganeshatest.RequireCommands(t, "ip", "nsenter", "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat")
	ctx := context.Background()
	// Not t.TempDir: the bus socket's path must stay short.
	top, err := os.MkdirTemp("", "pause-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(top); err != nil {
			t.Errorf("removing the temporary directory: %v", err)
		}
	})
	// ganesha reaches the exports as root; the squashed users its clients
	// become must get through too.
	if err := os.Chmod(top, 0o755); err != nil {
		t.Fatal(err)
	}
	poolDir := filepath.Join(top, "pool")
	if len(mkfsArgs) > 0 {
		if err := os.MkdirAll(poolDir, 0o755); err != nil {
			t.Fatal(err)
		}
		image := filepath.Join(poolDir, projquota.ImageName)
		if err := os.WriteFile(image, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(image, 1<<30); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("mkfs.xfs", append(append([]string{"-q"}, mkfsArgs...), image)...).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.xfs: %v: %s", err, out)
		}
	}
	pool, release, err := projquota.Prepare(ctx, poolDir, 1<<30)
	if errors.Is(err, projquota.ErrNoKernelQuota) {
		t.Skipf("cannot test the quota storage on this machine (VM_TEST_PKG=pkg/backend/nfs test/vm/projquota.sh runs it under a kernel that can): %v", err)
	}
	if err != nil {
		t.Fatalf("Prepare: %v", err)
	}
	t.Cleanup(func() {
		if err := release(); err != nil {
			t.Errorf("releasing the pool: %v", err)
		}
	})
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	exportDir := filepath.Join(top, "exports")
	srv, err := ganesha.StartServer(ctx, ganesha.ServerConfig{Dir: filepath.Join(top, "g"), ExportDir: exportDir,
		ListenAddress: net.Server.Addr.String(), NetNSPath: net.Server.Path, Logf: t.Logf})
	if err != nil {
		t.Fatalf("StartServer: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Errorf("stopping ganesha: %v", err)
		}
	})
	p := &pausedServer{srv: srv, root: pool.Root(), net: net, node: net.Nodes[0], pid: srv.GaneshaPID()}
	pause := func(ctx context.Context, maxStall time.Duration) (func() error, error) {
		resume, err := srv.Pause(ctx, maxStall)
		if err == nil {
			states, serr := ganesha.ThreadStates(p.pid)
			p.mu.Lock()
			if serr != nil {
				p.stopped = append(p.stopped, serr.Error())
			}
			for tid, st := range states {
				if st != 'T' {
					p.stopped = append(p.stopped, tid+":"+string(st))
				}
			}
			p.mu.Unlock()
		}
		return resume, err
	}
	if opts.noPause {
		pause = nil
	}
	p.ctrl, err = nfs.NewController(ctx, nfs.Config{Storage: nfs.NewQuotaStorage(pool, nil), ExportDir: exportDir,
		Server: net.Server.Addr.String(), Pause: pause, PauseBudget: budget,
		Paused: func(took time.Duration, outcome string) {
			p.mu.Lock()
			p.pauses, p.took = append(p.pauses, outcome), append(p.took, took)
			p.mu.Unlock()
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ctrl.Start(ctx, srv.Control()); err != nil {
		t.Fatal(err)
	}
	return p
}

// writtenVolume creates a volume attached read-write to the node, with
// dirs directories d0, d1, ... in it holding filler files each, and
// returns it and the pseudo path it is served at.
func (p *pausedServer) writtenVolume(t *testing.T, name string, dirs, filler int) (volumeid.ID, string) {
	t.Helper()
	ctx := context.Background()
	id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.ctrl.CreateVolume(ctx, backend.VolumeSpec{ID: id, Name: name, CapacityBytes: volumeSize,
		AccessType: accessmode.Mount, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}}); err != nil {
		t.Fatal(err)
	}
	node := nodeid.Node{Name: "n1", Zone: "zone-a", Address: p.node.Addr.String()}
	vol, err := p.ctrl.SetAttachments(ctx, id, []accessmode.Attachment{{Node: node, Mode: accessmode.MultiNodeMultiWriter}})
	if err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(p.root, "volumes", id.FileName())
	for d := range dirs {
		dir := filepath.Join(data, "d"+strconv.Itoa(d))
		if err := os.Mkdir(dir, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, 0o777); err != nil {
			t.Fatal(err)
		}
		for f := range filler {
			if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("filler%d", f)), []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return id, vol.Context[nfs.ContextShare]
}

// volumeSize holds the filler files of the tests (a block each) and lets
// the pool promise a few copies.
const volumeSize = 64 << 20

// writer writes records 0, 1, 2, ... through NFS, record n as the file
// d<n%dirs>/r<n> holding "n\n", one nfs-cp each: the record is
// acknowledged when nfs-cp reports it written.
type writer struct {
	mu    sync.Mutex
	acked int // records 0..acked-1 are acknowledged
	err   error
	stop  chan struct{}
	done  chan struct{}
}

func (p *pausedServer) startWriter(t *testing.T, pseudo string, dirs int) *writer {
	t.Helper()
	w := &writer{stop: make(chan struct{}), done: make(chan struct{})}
	local := filepath.Join(t.TempDir(), "record")
	go func() {
		defer close(w.done)
		for n := 0; ; n++ {
			select {
			case <-w.stop:
				return
			default:
			}
			err := os.WriteFile(local, []byte(strconv.Itoa(n)+"\n"), 0o644)
			if err == nil {
				err = p.node.NFSCopy(context.Background(), local, p.net.NFSURL(pseudo, fmt.Sprintf("d%d/r%d", n%dirs, n)))
			}
			w.mu.Lock()
			if err != nil {
				w.err = fmt.Errorf("record %d: %w", n, err)
				w.mu.Unlock()
				return
			}
			w.acked = n + 1
			w.mu.Unlock()
		}
	}()
	t.Cleanup(w.end)
	return w
}

func (w *writer) end() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
}

func (w *writer) state() (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.acked, w.err
}

// waitPast waits until more than n records are acknowledged.
func (w *writer) waitPast(t *testing.T, what string, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		acked, err := w.state()
		if err != nil {
			t.Fatalf("%s: the writer failed: %v", what, err)
		}
		if acked > n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no record acknowledged past %d within a minute", what, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkRecords checks the records in a copy of a written volume: every
// record acknowledged before the copy was asked for (acked) is there
// whole, and the records there are those of one instant: 0..m whole, and at
// most the one after m, the record being written at that instant, begun
// (its file made, its bytes perhaps not yet). A copy walked while the
// writer went on holds a record of a directory walked late and misses an
// earlier one of a directory walked early.
func checkRecords(t *testing.T, what, tree string, dirs, acked int) (m int) {
	t.Helper()
	whole, begun := map[int]bool{}, map[int]bool{}
	for d := range dirs {
		entries, err := os.ReadDir(filepath.Join(tree, "d"+strconv.Itoa(d)))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		for _, e := range entries {
			num, ok := strings.CutPrefix(e.Name(), "r")
			if !ok {
				continue
			}
			n, err := strconv.Atoi(num)
			if err != nil || n%dirs != d {
				t.Errorf("%s: unexpected file d%d/%s", what, d, e.Name())
				continue
			}
			data, err := os.ReadFile(filepath.Join(tree, "d"+strconv.Itoa(d), e.Name()))
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			if string(data) == num+"\n" {
				whole[n] = true
			} else {
				begun[n] = true
			}
		}
	}
	m = -1
	for whole[m+1] {
		m++
	}
	if m+1 < acked {
		t.Errorf("%s: records 0..%d were acknowledged before the copy was asked for; it holds 0..%d whole, not %d", what, acked-1, m, m+1)
	}
	for n := range whole {
		if n > m {
			t.Errorf("%s: record %d is there and record %d is not: not the tree of one instant", what, n, m+1)
		}
	}
	for n := range begun {
		if n != m+1 {
			t.Errorf("%s: record %d is there half written and records up to %d whole: not the tree of one instant", what, n, m)
		}
	}
	return m
}

// TestSnapshotOfAVolumeInUseIsOfOneInstant: on the quota storage, a
// volume that a node writes through ganesha is snapshotted and cloned while
// ganesha is held still, so each copy holds every write acknowledged
// before it was asked for, and the tree of one instant, across files and
// directories. The writer is slowed, never failed: its writes go on after
// each copy, to the same ganesha, which runs again. Each pause is timed.
func TestSnapshotOfAVolumeInUseIsOfOneInstant(t *testing.T) {
	// Generous: the VM that has xfs quotas emulates its CPU.
	p := startPausedServer(t, 15*time.Second, pausedOptions{})
	ctx := context.Background()
	// Filler files make each directory's walk take a while, so that a
	// copy made while the writer runs would see it move on mid-walk.
	const dirs, filler = 4, 300
	id, pseudo := p.writtenVolume(t, "in-use", dirs, filler)
	w := p.startWriter(t, pseudo, dirs)
	w.waitPast(t, "before the first snapshot", dirs)

	const copies = 4
	for i := range copies {
		acked, _ := w.state()
		var tree string
		if i < copies-1 {
			snapID, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, fmt.Sprintf("s%d", i)))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.ctrl.CreateSnapshot(ctx, snapID, fmt.Sprintf("s%d", i), id); err != nil {
				t.Fatalf("snapshot %d of a volume being written: %v", i, err)
			}
			tree = filepath.Join(p.root, "snapshots", snapID.FileName())
		} else {
			clone, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "clone"))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.ctrl.CreateVolume(ctx, backend.VolumeSpec{ID: clone, Name: "clone", CapacityBytes: volumeSize,
				AccessType: accessmode.Mount, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter},
				Source: &backend.Source{VolumeID: id.String()}}); err != nil {
				t.Fatalf("clone of a volume being written: %v", err)
			}
			tree = filepath.Join(p.root, "volumes", clone.FileName())
		}
		m := checkRecords(t, fmt.Sprintf("copy %d", i), tree, dirs, acked)
		t.Logf("copy %d: %d records acknowledged before it was asked for, records 0..%d in it", i, acked, m)
		// The writer goes on: the pause ended.
		w.waitPast(t, fmt.Sprintf("after copy %d", i), m+1)
		if now := p.srv.GaneshaPID(); now != p.pid {
			t.Fatalf("after copy %d ganesha is pid %d, was %d", i, now, p.pid)
		}
		states, err := ganesha.ThreadStates(p.pid)
		if err != nil {
			t.Fatal(err)
		}
		for tid, st := range states {
			if st != 'S' && st != 'R' && st != 'D' {
				t.Errorf("after copy %d thread %s of ganesha is in state %c", i, tid, st)
			}
		}
	}
	w.end()
	if _, err := w.state(); err != nil {
		t.Errorf("the writer: %v", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.stopped) > 0 {
		t.Errorf("threads of ganesha not stopped when Pause returned: %v", p.stopped)
	}
	if len(p.pauses) != copies {
		t.Errorf("%d pauses recorded (%v), want one per copy, %d", len(p.pauses), p.pauses, copies)
	}
	for i, o := range p.pauses {
		if o != nfs.PauseCopied || p.took[i] <= 0 || p.took[i] > 15*time.Second {
			t.Errorf("pause %d: %s after %v, want %s within the budget", i, o, p.took[i], nfs.PauseCopied)
		}
	}
	t.Logf("pauses: %v", p.took)
}

// TestCopyOverThePauseBudget: a volume in use with more files than can be
// copied within the pause budget is neither snapshotted nor cloned
// (UNAVAILABLE, saying why and what to change); ganesha runs again and the
// writer goes on, and nothing of the copies is left: no snapshot, no
// volume, no directory in the pool, no record.
func TestCopyOverThePauseBudget(t *testing.T) {
	// Long enough for ganesha's threads to stop even in an emulated VM on
	// a busy machine (tens of milliseconds when idle; over 200 ms seen
	// with a build beside it, which made the pause fail rather than run
	// over), far too short to clone 10,000 files there (seconds: each is
	// an open, a clone, an owner, a mode and times).
	const budget = time.Second
	p := startPausedServer(t, budget, pausedOptions{})
	ctx := context.Background()
	const dirs = 2
	id, pseudo := p.writtenVolume(t, "many-files", dirs, 5000)
	w := p.startWriter(t, pseudo, dirs)
	w.waitPast(t, "before the snapshot", 0)

	snapID, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "late"))
	if err != nil {
		t.Fatal(err)
	}
	wantRefused := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("%s of a volume in use with 10,000 files in a %v budget: %v, want UNAVAILABLE", what, budget, err)
		}
		for _, want := range []string{id.String(), "too many files", "--nfs-pause-budget", budget.String()} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s refused with %q, which does not say %q", what, err, want)
			}
		}
	}
	_, err = p.ctrl.CreateSnapshot(ctx, snapID, "late", id)
	wantRefused("snapshot", err)
	clone, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "late-clone"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.ctrl.CreateVolume(ctx, backend.VolumeSpec{ID: clone, Name: "late-clone", CapacityBytes: volumeSize,
		AccessType: accessmode.Mount, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter},
		Source: &backend.Source{VolumeID: id.String()}})
	wantRefused("clone", err)

	acked, _ := w.state()
	w.waitPast(t, "after the refused copies", acked)
	if now := p.srv.GaneshaPID(); now != p.pid {
		t.Errorf("ganesha is pid %d, was %d", now, p.pid)
	}
	if _, err := p.ctrl.Snapshot(ctx, snapID); status.Code(err) != codes.NotFound {
		t.Errorf("the refused snapshot: %v, want NotFound", err)
	}
	if _, err := p.ctrl.Volume(ctx, clone); status.Code(err) != codes.NotFound {
		t.Errorf("the refused clone: %v, want NotFound", err)
	}
	for _, dir := range []string{"snapshots", "meta/snapshots"} {
		if entries, err := os.ReadDir(filepath.Join(p.root, dir)); err != nil || len(entries) != 0 {
			t.Errorf("%s after the refused snapshot: %v (%v), want empty", dir, entries, err)
		}
	}
	for _, dir := range []string{"volumes", "meta/volumes"} {
		if entries, err := os.ReadDir(filepath.Join(p.root, dir)); err != nil || len(entries) != 1 {
			t.Errorf("%s after the refused clone: %v (%v), want only the source", dir, entries, err)
		}
	}
	p.mu.Lock()
	if len(p.pauses) != 2 || p.pauses[0] != nfs.PauseOverBudget || p.pauses[1] != nfs.PauseOverBudget {
		t.Errorf("pauses recorded: %v, want two %s", p.pauses, nfs.PauseOverBudget)
	}
	p.mu.Unlock()

	// Detached, it copies as before, without a pause and whatever its size.
	w.end()
	if _, err := p.ctrl.SetAttachments(ctx, id, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := p.ctrl.CreateSnapshot(ctx, snapID, "late", id); err != nil {
		t.Errorf("snapshot of the volume at rest: %v", err)
	}
}

// TestNoPausedCopyWithoutReflinksOrPause: on a quota pool made without
// reflinks a copy copies bytes, too slow to hold the server for, and a
// ganesha the driver does not run cannot be held; either way a volume in
// use is refused as before (FAILED_PRECONDITION, saying why) and ganesha
// is never paused. Detached, it copies.
func TestNoPausedCopyWithoutReflinksOrPause(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts pausedOptions
		why  string
	}{
		{"pool without reflinks", pausedOptions{mkfs: []string{"-m", "reflink=0"}}, "without reflinks"},
		{"no ganesha to hold", pausedOptions{noPause: true}, "--nfs-ganesha-dbus"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPausedServer(t, 15*time.Second, tc.opts)
			ctx := context.Background()
			id, _ := p.writtenVolume(t, "refused", 1, 1)
			snapID, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "nr"))
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.ctrl.CreateSnapshot(ctx, snapID, "nr", id)
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), tc.why) {
				t.Errorf("snapshot of a volume in use: %v, want FAILED_PRECONDITION saying %q", err, tc.why)
			}
			if _, err := p.ctrl.SetAttachments(ctx, id, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := p.ctrl.CreateSnapshot(ctx, snapID, "nr", id); err != nil {
				t.Errorf("snapshot of the volume at rest: %v", err)
			}
			p.mu.Lock()
			defer p.mu.Unlock()
			if len(p.pauses) != 0 {
				t.Errorf("ganesha was paused %d times", len(p.pauses))
			}
		})
	}
}

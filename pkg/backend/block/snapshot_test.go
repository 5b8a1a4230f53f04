package block

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
	"google.golang.org/grpc/codes"
)

// recordSize is one record of syncedWriter: fixed, so record i sits at
// offset i*recordSize and a torn or missing record is plain to see.
const recordSize = 4096

func record(i int64) []byte {
	b := make([]byte, recordSize)
	copy(b, fmt.Sprintf("record %012d\n", i))
	return b
}

// syncedWriter writes record after record to its files, each fsync'd
// before the next, and counts the records acknowledged (write and fsync
// returned): what a database would have told its clients is durable. With
// several files it writes record i to each in turn, as a database writes
// its log before its data, and a record counts once it is in all of them.
type syncedWriter struct {
	synced atomic.Int64
	stop   chan struct{}
	done   sync.WaitGroup
	err    error
}

func startSyncedWriter(t *testing.T, files ...*os.File) *syncedWriter {
	t.Helper()
	w := &syncedWriter{stop: make(chan struct{})}
	w.done.Add(1)
	go func() {
		defer w.done.Done()
		for i := int64(0); ; i++ {
			select {
			case <-w.stop:
				return
			default:
			}
			for _, f := range files {
				if _, err := f.WriteAt(record(i), i*recordSize); err != nil {
					w.err = err
					return
				}
				if err := f.Sync(); err != nil {
					w.err = err
					return
				}
			}
			w.synced.Store(i + 1)
		}
	}()
	t.Cleanup(w.halt)
	return w
}

// waitFor lets the writer acknowledge at least n more records.
func (w *syncedWriter) waitFor(t *testing.T, n int64) {
	t.Helper()
	want := w.synced.Load() + n
	deadline := time.Now().Add(time.Minute)
	for w.synced.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("the writer acknowledged %d records in a minute, want %d (error: %v)", w.synced.Load(), want, w.err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (w *syncedWriter) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	w.done.Wait()
}

// checkRecords reads records 0..n-1 from path: every one must be there,
// whole.
func checkRecords(t *testing.T, path string, n int64) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, recordSize)
	for i := int64(0); i < n; i++ {
		if _, err := f.ReadAt(got, i*recordSize); err != nil {
			t.Fatalf("%s: record %d of %d acknowledged before the snapshot: %v", path, i, n, err)
		}
		if want := record(i); string(got) != string(want) {
			t.Fatalf("%s: record %d of %d acknowledged before the snapshot reads %q", path, i, n, got[:24])
		}
	}
}

// TestSnapshotOfAVolumeInUse: a snapshot of a volume a workload writes and
// fsyncs is a single point in time holding every write acknowledged before
// the call, on a pool with reflinks; a restore of it, read-only (ROX, on
// another node, mounted without skipping the journal) or read/write, shows
// them. A pool without reflinks refuses to copy a volume attached for
// writing (FAILED_PRECONDITION, saying why), snapshots and clones alike,
// and copies it once it is detached.
func TestSnapshotOfAVolumeInUse(t *testing.T) {
	requireRoot(t)
	for _, kind := range []string{fsExt4, fsXFS, "raw"} {
		t.Run(kind+"/reflink pool", func(t *testing.T) {
			root := testRoot(t)
			pool := filepath.Join(testenv.ReflinkXFS(t, 4<<30), "pool")
			if err := os.Mkdir(pool, 0o700); err != nil {
				t.Fatal(err)
			}
			f := openFixture(t, root, map[string]string{"zone-a": pool})
			snapshotsWhileWriting(t, f, kind, true)
		})
		t.Run(kind+"/btrfs pool", func(t *testing.T) {
			root := testRoot(t)
			pool := filepath.Join(testenv.LoopFilesystem(t, 2<<30, "btrfs", "-q"), "pool")
			if err := os.Mkdir(pool, 0o700); err != nil {
				t.Fatal(err)
			}
			f := openFixture(t, root, map[string]string{"zone-a": pool})
			snapshotsWhileWriting(t, f, kind, true)
		})
		t.Run(kind+"/plain pool", func(t *testing.T) {
			f := newFixture(t, "zone-a")
			snapshotsWhileWriting(t, f, kind, false)
		})
	}
}

func snapshotsWhileWriting(t *testing.T, f *fixture, kind string, reflinks bool) {
	ctx := context.Background()
	fsType := kind
	spec := mountSpec(t, "zone-a", "busy", fsType, 64*mib)
	if kind == "raw" {
		spec.AccessType, spec.FsType = accessmode.Block, ""
	} else {
		spec.CapacityBytes = fsSize(fsType)
	}
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	req := f.mountReq(spec.ID, "n1", "busy", false)
	req.AccessType, req.Mode = spec.AccessType, accessmode.SingleNodeWriter
	staged := f.stage(t, req)

	// The writer's file: the raw device itself, or a file in the filesystem.
	path := staged.Device
	if kind != "raw" {
		path = filepath.Join(staged.StagingPath, "log")
	}
	out, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	w := startSyncedWriter(t, out)
	w.waitFor(t, 20)

	type taken struct {
		id    backend.Snapshot
		acked int64
	}
	var snaps []taken
	var cloneID volumeid.ID
	var cloneAcked int64
	for i := range 3 {
		acked := w.synced.Load()
		name := fmt.Sprintf("busy-%d", i)
		s, err := f.ctrl.CreateSnapshot(ctx, snapID(t, "zone-a", name), name, spec.ID)
		if !reflinks {
			wantCode(t, err, codes.FailedPrecondition)
			clone := mountSpec(t, "zone-a", "clone", fsType, spec.CapacityBytes)
			clone.AccessType, clone.FsType = spec.AccessType, spec.FsType
			clone.Source = &backend.Source{VolumeID: spec.ID.String()}
			_, err := f.ctrl.CreateVolume(ctx, clone)
			wantCode(t, err, codes.FailedPrecondition)
			break
		}
		if err != nil {
			t.Fatalf("CreateSnapshot of a volume in use on a reflink pool: %v", err)
		}
		snaps = append(snaps, taken{*s, acked})
		w.waitFor(t, 10)
		if i == 0 {
			// A clone while written, too: the same single instant.
			cloneAcked = w.synced.Load()
			clone := mountSpec(t, "zone-a", "clone", fsType, spec.CapacityBytes)
			clone.AccessType, clone.FsType = spec.AccessType, spec.FsType
			clone.Source = &backend.Source{VolumeID: spec.ID.String()}
			if _, err := f.ctrl.CreateVolume(ctx, clone); err != nil {
				t.Fatalf("CreateVolume from a volume in use on a reflink pool: %v", err)
			}
			cloneID = clone.ID
			w.waitFor(t, 10)
		}
	}
	w.halt()
	if w.err != nil {
		t.Fatalf("the writer failed: %v", w.err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	if !reflinks {
		// Detached, the same volume copies: nobody writes it any more.
		acked := w.synced.Load()
		f.unstage(t, staged)
		f.attach(t, spec.ID)
		s, err := f.ctrl.CreateSnapshot(ctx, snapID(t, "zone-a", "detached"), "detached", spec.ID)
		if err != nil {
			t.Fatalf("CreateSnapshot of a detached volume on a plain pool: %v", err)
		}
		snaps = append(snaps, taken{*s, acked})
	}

	for i, s := range snaps {
		sid := snapID(t, "zone-a", s.id.Name)
		// Read-only, as ReadOnlyMany on another node.
		rox := mountSpec(t, "zone-a", fmt.Sprintf("rox-%d", i), fsType, spec.CapacityBytes)
		rox.AccessType, rox.FsType = spec.AccessType, spec.FsType
		rox.Modes = []accessmode.Mode{accessmode.MultiNodeReaderOnly}
		rox.Source = &backend.Source{SnapshotID: sid.String()}
		f.create(t, rox)
		f.attach(t, rox.ID, reader("n2"))
		req := f.mountReq(rox.ID, "n2", rox.Name, true)
		req.AccessType, req.Mode = rox.AccessType, accessmode.MultiNodeReaderOnly
		r := f.stage(t, req)
		if kind == "raw" {
			checkRecords(t, r.Device, s.acked)
		} else {
			checkRecords(t, filepath.Join(r.StagingPath, "log"), s.acked)
		}
		f.unstage(t, r)
	}
	// One restore read/write as well: its filesystem mounts and reads the same.
	last := snaps[len(snaps)-1]
	rw := mountSpec(t, "zone-a", "rw-restore", fsType, spec.CapacityBytes)
	rw.AccessType, rw.FsType = spec.AccessType, spec.FsType
	rw.Source = &backend.Source{SnapshotID: snapID(t, "zone-a", last.id.Name).String()}
	f.create(t, rw)
	f.attach(t, rw.ID, writer("n2"))
	req = f.mountReq(rw.ID, "n2", "rw-restore", false)
	req.AccessType, req.Mode = rw.AccessType, accessmode.SingleNodeWriter
	r := f.stage(t, req)
	if kind == "raw" {
		checkRecords(t, r.Device, last.acked)
	} else {
		checkRecords(t, filepath.Join(r.StagingPath, "log"), last.acked)
	}
	f.unstage(t, r)
	if cloneID.Zone != "" {
		f.attach(t, cloneID, writer("n3"))
		req := f.mountReq(cloneID, "n3", "clone", false)
		req.AccessType, req.Mode = spec.AccessType, accessmode.SingleNodeWriter
		r := f.stage(t, req)
		if kind == "raw" {
			checkRecords(t, r.Device, cloneAcked)
		} else {
			checkRecords(t, filepath.Join(r.StagingPath, "log"), cloneAcked)
		}
		f.unstage(t, r)
	}
}

// fillImage writes n bytes of random data into the volume's image, so a
// byte copy of it has real work to do.
func fillImage(t *testing.T, f *fixture, id volumeid.ID, n int64) {
	t.Helper()
	out, err := os.OpenFile(imageOf(t, f, id), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := io.CopyN(out, rand.Reader, n); err != nil {
		t.Fatal(err)
	}
	if err := out.Sync(); err != nil {
		t.Fatal(err)
	}
}

// shortCall is a call whose deadline is far shorter than the copy.
func shortCall(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	t.Cleanup(cancel)
	return ctx
}

// TestLongSnapshotCopyOutlivesTheCall: a byte copy longer than the call's
// deadline goes on in the background; the call and its retries answer in
// time with the snapshot not ready to use (Snapshot and ListSnapshots too),
// no retry starts the copy again, and the finished snapshot holds the
// source's bytes. A restore as long answers ABORTED until its copy is done,
// then the volume, again with one copy. DeleteSnapshot and DeleteVolume
// during a copy cancel it and leave nothing behind, and the space it held
// is free again.
func TestLongSnapshotCopyOutlivesTheCall(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "big", "", 512*mib)
	spec.AccessType = accessmode.Block
	f.create(t, spec)
	fillImage(t, f, spec.ID, 384*mib)

	started := copiesStarted.Load()
	sid := snapID(t, "zone-a", "slow")
	s, err := f.ctrl.CreateSnapshot(shortCall(t), sid, "slow", spec.ID)
	if err != nil {
		t.Fatalf("CreateSnapshot with a short deadline: %v", err)
	}
	if !s.Cutting {
		t.Fatal("a 384 MiB byte copy finished within a 20ms call: the test proves nothing on this machine")
	}
	if got, err := f.ctrl.Snapshot(context.Background(), sid); err != nil || !got.Cutting {
		t.Fatalf("Snapshot during the copy: %+v, %v; want it listed, not ready", got, err)
	}
	if all, _ := f.ctrl.ListSnapshots(context.Background()); len(all) != 1 || !all[0].Cutting {
		t.Fatalf("ListSnapshots during the copy: %+v; want the snapshot, not ready", all)
	}
	wantCreating(t, f, sid, false) // a snapshot is no volume in the making
	restore := mountSpec(t, "zone-a", "too-early", "", 512*mib)
	restore.AccessType = accessmode.Block
	restore.Source = &backend.Source{SnapshotID: sid.String()}
	_, err = f.ctrl.CreateVolume(context.Background(), restore)
	wantCode(t, err, codes.Unavailable)

	deadline := time.Now().Add(time.Minute)
	for s.Cutting {
		if time.Now().After(deadline) {
			t.Fatal("the copy did not finish within a minute")
		}
		if s, err = f.ctrl.CreateSnapshot(shortCall(t), sid, "slow", spec.ID); err != nil {
			t.Fatalf("CreateSnapshot retried during the copy: %v", err)
		}
	}
	if n := copiesStarted.Load() - started; n != 1 {
		t.Fatalf("%d copies started for one snapshot and its retries, want 1", n)
	}
	if !sameFiles(t, imageOf(t, f, spec.ID), imageOf(t, f, sid)) {
		t.Fatal("the finished snapshot's image differs from its source's")
	}

	// A restore is a byte copy as long: ABORTED until it is done, retries
	// wait for the same copy, another capacity under the name is refused.
	started = copiesStarted.Load()
	restored := mountSpec(t, "zone-a", "restored", "", 512*mib)
	restored.AccessType = accessmode.Block
	restored.Source = &backend.Source{SnapshotID: sid.String()}
	_, err = f.ctrl.CreateVolume(shortCall(t), restored)
	wantCode(t, err, codes.Aborted)
	wantCreating(t, f, restored.ID, true)
	other := restored
	other.CapacityBytes = 1024 * mib
	_, err = f.ctrl.CreateVolume(context.Background(), other)
	wantCode(t, err, codes.AlreadyExists)
	if _, err := f.ctrl.Volume(context.Background(), restored.ID); codeOf(err) != codes.NotFound {
		t.Fatalf("Volume during the copy: %v; want NotFound until it is complete", err)
	}
	for {
		if time.Now().After(deadline) {
			t.Fatal("the restore did not finish within a minute")
		}
		_, err := f.ctrl.CreateVolume(shortCall(t), restored)
		if err == nil {
			break
		}
		wantCode(t, err, codes.Aborted)
	}
	if n := copiesStarted.Load() - started; n != 1 {
		t.Fatalf("%d copies started for one restore and its retries, want 1", n)
	}
	wantCreating(t, f, restored.ID, false)
	if !sameFiles(t, imageOf(t, f, spec.ID), imageOf(t, f, restored.ID)) {
		t.Fatal("the restored image differs from the snapshot's source")
	}

	// Deleted while copying: cancelled, nothing left, room given back.
	// What the pool has promised to work in progress, read under the lock
	// that guards it (the pool's free space itself moves with whatever else
	// the machine writes).
	reserved := func() int64 {
		f.ctrl.mu.Lock()
		defer f.ctrl.mu.Unlock()
		return f.ctrl.reserved["zone-a"]
	}
	// A cancelled copy leaves no temporary file and no reservation.
	cancelledCleanly := func(what, dir string) {
		t.Helper()
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if strings.Contains(e.Name(), tempMarker) {
				t.Fatalf("a cancelled %s left %s", what, e.Name())
			}
		}
		if r := reserved(); r != 0 {
			t.Fatalf("%d bytes still reserved after the cancelled %s", r, what)
		}
	}
	gone := snapID(t, "zone-a", "cancelled")
	if s, err := f.ctrl.CreateSnapshot(shortCall(t), gone, "cancelled", spec.ID); err != nil || !s.Cutting {
		t.Fatalf("CreateSnapshot: %+v, %v; want a copy in progress", s, err)
	}
	if err := f.ctrl.DeleteSnapshot(context.Background(), gone); err != nil {
		t.Fatalf("DeleteSnapshot during the copy: %v", err)
	}
	if _, err := f.ctrl.Snapshot(context.Background(), gone); codeOf(err) != codes.NotFound {
		t.Fatalf("Snapshot after DeleteSnapshot: %v, want NotFound", err)
	}
	cancelledCleanly("copy", filepath.Dir(imageOf(t, f, gone)))
	// The same for a restore deleted while it copies.
	dropped := mountSpec(t, "zone-a", "dropped", "", 512*mib)
	dropped.AccessType = accessmode.Block
	dropped.Source = &backend.Source{SnapshotID: sid.String()}
	_, err = f.ctrl.CreateVolume(shortCall(t), dropped)
	wantCode(t, err, codes.Aborted)
	if err := f.ctrl.DeleteVolume(context.Background(), dropped.ID); err != nil {
		t.Fatalf("DeleteVolume during the copy: %v", err)
	}
	if _, err := f.ctrl.Volume(context.Background(), dropped.ID); codeOf(err) != codes.NotFound {
		t.Fatalf("Volume after DeleteVolume: %v, want NotFound", err)
	}
	if exists(imageOf(t, f, dropped.ID)) {
		t.Fatal("a cancelled restore left its image")
	}
	wantCreating(t, f, dropped.ID, false)
	cancelledCleanly("restore", filepath.Dir(imageOf(t, f, dropped.ID)))
}

// wantCreating checks what the controller says of a creation in the
// background of id.
func wantCreating(t *testing.T, f *fixture, id volumeid.ID, want bool) {
	t.Helper()
	if creating, err := f.ctrl.Creating(context.Background(), id); err != nil || creating != want {
		t.Fatalf("Creating(%s) = %v, %v; want %v", id, creating, err, want)
	}
}

func sameFiles(t *testing.T, a, b string) bool {
	t.Helper()
	out, err := exec.Command("cmp", "--quiet", a, b).CombinedOutput()
	if err != nil {
		t.Logf("cmp %s %s: %v %s", a, b, err, out)
		return false
	}
	return true
}

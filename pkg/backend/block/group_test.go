package block

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/test/testenv"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
)

// recordsIn counts the whole records at the start of path and fails if a
// record follows a gap: the file is a prefix of the writer's records.
func recordsIn(t *testing.T, path string) int64 {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for ; (n+1)*recordSize <= int64(len(data)); n++ {
		if string(data[n*recordSize:(n+1)*recordSize]) != string(record(n)) {
			break
		}
	}
	for i := n + 1; (i+1)*recordSize <= int64(len(data)); i++ {
		if string(data[i*recordSize:(i+1)*recordSize]) == string(record(i)) {
			t.Fatalf("%s holds record %d but not record %d: not one instant", path, i, n)
		}
	}
	return n
}

// TestGroupSnapshotOfVolumesBeingWritten: on a pool on btrfs (a
// directory on btrfs, or a btrfs the driver keeps in one), a group
// snapshot of two volumes both being written is of one instant: across
// many groups, no restored member b holds a record its partner a had not
// acknowledged, and both hold every record acknowledged before the call.
// On a pool that captures one volume at a time (xfs with reflinks, kept or
// not, or a btrfs pool laid out before its volumes were a subvolume), the same group
// is refused, naming both writers.
func TestGroupSnapshotOfVolumesBeingWritten(t *testing.T) {
	requireRoot(t)
	t.Run("btrfs pool", func(t *testing.T) {
		pool := filepath.Join(testenv.LoopFilesystem(t, 2<<30, "btrfs", "-q"), "pool")
		if err := os.Mkdir(pool, 0o700); err != nil {
			t.Fatal(err)
		}
		f := openFixture(t, testRoot(t), map[string]string{"zone-a": pool})
		if ok, err := isSubvolume(filepath.Join(pool, volumesDir)); err != nil || !ok {
			t.Fatalf("a new pool on btrfs has its volumes in a subvolume: %v, %v", ok, err)
		}
		for _, d := range []string{volumesDir, snapshotsDir, templatesDir} {
			if !noCOW(t, filepath.Join(pool, d)) {
				t.Errorf("%s of a new btrfs pool keeps copy-on-write on", d)
			}
		}
		groupsWhileWriting(t, f, true)
		if left, _ := filepath.Glob(filepath.Join(pool, groupCapturePrefix+"*")); len(left) > 0 {
			t.Errorf("captures left in the pool: %v", left)
		}
	})
	// What the default (auto) gives on an ext4 root where btrfs is at
	// hand, as --block-pool-filesystem=btrfs does: the kept btrfs's pool
	// is laid out as one made on btrfs, and so are its groups.
	t.Run("kept btrfs pool", func(t *testing.T) {
		root := testRoot(t)
		k := keepPools(t, map[string]string{"zone-a": outerDir(t, "ext4")})
		pool := k.Roots["zone-a"]
		if filepath.Base(pool) != KeptMountDir || mountedFsType(t, pool) != "btrfs" {
			t.Fatalf("pool root %s is not a kept btrfs", pool)
		}
		f := openFixture(t, root, k.Roots)
		if ok, err := isSubvolume(filepath.Join(pool, volumesDir)); err != nil || !ok {
			t.Fatalf("a new pool on a kept btrfs has its volumes in a subvolume: %v, %v", ok, err)
		}
		if !noCOW(t, filepath.Join(pool, volumesDir)) {
			t.Errorf("%s of a new kept btrfs pool keeps copy-on-write on", volumesDir)
		}
		groupsWhileWriting(t, f, true)
	})
	// And what --block-pool-filesystem=xfs (or auto without btrfs) gives
	// there: a kept xfs, whose groups of several writers are refused.
	t.Run("kept xfs pool", func(t *testing.T) {
		root := testRoot(t)
		k := keepPoolsAs(t, map[string]string{"zone-a": outerDir(t, "ext4")}, PoolFilesystemXFS)
		groupsWhileWriting(t, openFixture(t, root, k.Roots), false)
	})
	t.Run("xfs reflink pool", func(t *testing.T) {
		pool := filepath.Join(testenv.ReflinkXFS(t, 1<<30), "pool")
		if err := os.Mkdir(pool, 0o700); err != nil {
			t.Fatal(err)
		}
		groupsWhileWriting(t, openFixture(t, testRoot(t), map[string]string{"zone-a": pool}), false)
	})
	t.Run("btrfs pool laid out before", func(t *testing.T) {
		pool := filepath.Join(testenv.LoopFilesystem(t, 2<<30, "btrfs", "-q"), "pool")
		if err := os.MkdirAll(filepath.Join(pool, volumesDir), 0o700); err != nil {
			t.Fatal(err)
		}
		groupsWhileWriting(t, openFixture(t, testRoot(t), map[string]string{"zone-a": pool}), false)
	})
}

func noCOW(t *testing.T, dir string) bool {
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	flags, err := unix.IoctlGetUint32(int(d.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		t.Fatal(err)
	}
	return flags&fsNoCOWFlag != 0
}

func groupsWhileWriting(t *testing.T, f *fixture, atOnce bool) {
	ctx := context.Background()
	var files []*os.File
	var specs []backend.VolumeSpec
	for _, name := range []string{"log", "data"} {
		spec := mountSpec(t, "zone-a", name, fsExt4, fsSize(fsExt4))
		f.create(t, spec)
		f.attach(t, spec.ID, writer("n1"))
		req := f.mountReq(spec.ID, "n1", name, false)
		req.Mode = accessmode.SingleNodeWriter
		staged := f.stage(t, req)
		out, err := os.OpenFile(filepath.Join(staged.StagingPath, "records"), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { out.Close() })
		files, specs = append(files, out), append(specs, spec)
	}
	w := startSyncedWriter(t, files[0], files[1]) // the log, then the data
	w.waitFor(t, 20)

	type taken struct {
		members []*backend.Snapshot
		acked   int64
	}
	var groups []taken
	for i := range 6 {
		var members []backend.GroupMember
		for _, spec := range specs {
			name := fmt.Sprintf("g%d-%s", i, spec.Name)
			members = append(members, backend.GroupMember{ID: snapID(t, "zone-a", name), Name: name, Source: spec.ID})
		}
		acked := w.synced.Load()
		got, err := f.ctrl.CreateSnapshotGroup(ctx, members)
		if !atOnce {
			wantCode(t, err, codes.FailedPrecondition)
			for _, spec := range specs {
				if !strings.Contains(err.Error(), spec.ID.String()) {
					t.Errorf("the refusal does not name writer %s: %v", spec.ID, err)
				}
			}
			if !strings.Contains(err.Error(), "--block-pool-filesystem="+PoolFilesystemBtrfs) {
				t.Errorf("the refusal does not say how to get a pool that takes groups at one instant: %v", err)
			}
			if snaps, _ := f.ctrl.ListSnapshots(ctx); len(snaps) != 0 {
				t.Errorf("a refused group left %d snapshots", len(snaps))
			}
			return
		}
		if err != nil {
			t.Fatalf("group snapshot %d of two volumes being written: %v", i, err)
		}
		if len(got) != len(members) {
			t.Fatalf("group snapshot %d has %d members, want %d", i, len(got), len(members))
		}
		groups = append(groups, taken{got, acked})
		w.waitFor(t, 7)
	}
	w.halt()
	if w.err != nil {
		t.Fatalf("the writer failed: %v", w.err)
	}

	for i, g := range groups {
		var counts []int64
		for j, m := range g.members {
			restore := mountSpec(t, "zone-a", fmt.Sprintf("r%d-%d", i, j), fsExt4, fsSize(fsExt4))
			restore.Modes = []accessmode.Mode{accessmode.MultiNodeReaderOnly}
			restore.Source = &backend.Source{SnapshotID: m.ID}
			f.create(t, restore)
			f.attach(t, restore.ID, reader("n2"))
			req := f.mountReq(restore.ID, "n2", restore.Name, true)
			req.Mode = accessmode.MultiNodeReaderOnly
			r := f.stage(t, req)
			counts = append(counts, recordsIn(t, filepath.Join(r.StagingPath, "records")))
			f.unstage(t, r)
		}
		log, data := counts[0], counts[1]
		if data > log {
			t.Errorf("group %d: the data volume holds %d records, its log only %d: data the log never acknowledged", i, data, log)
		}
		if data < g.acked {
			t.Errorf("group %d: %d records acknowledged on both before the call, the data volume holds %d", i, g.acked, data)
		}
		t.Logf("group %d: acknowledged before %d, log %d, data %d", i, g.acked, log, data)
	}
}

// TestCaptureLeftByACrashIsRemovedAtStart: a controller that dies while a
// group's members are cloned out of its capture leaves the capture, a
// read-only subvolume in the pool; the next start removes it and keeps the
// volumes.
func TestCaptureLeftByACrashIsRemovedAtStart(t *testing.T) {
	requireRoot(t)
	pool := filepath.Join(testenv.LoopFilesystem(t, 1<<30, "btrfs", "-q"), "pool")
	if err := os.Mkdir(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	root := testRoot(t)
	f := openFixture(t, root, map[string]string{"zone-a": pool})
	spec := mountSpec(t, "zone-a", "kept", "", 16*mib)
	spec.AccessType, spec.FsType = accessmode.Block, ""
	f.create(t, spec)
	capture := groupCapturePrefix + "crashed"
	if err := snapshotSubvolume(filepath.Join(pool, volumesDir), pool, capture); err != nil {
		t.Fatal(err)
	}
	if !exists(filepath.Join(pool, capture, spec.ID.FileName()+imageSuffix)) {
		t.Fatal("the capture holds no image of the volume")
	}

	again := openFixture(t, root, map[string]string{"zone-a": pool})
	if exists(filepath.Join(pool, capture)) {
		t.Errorf("the capture %s is still in the pool after a start", capture)
	}
	if _, err := again.ctrl.Volume(context.Background(), spec.ID); err != nil {
		t.Errorf("the volume after the start: %v", err)
	}
}

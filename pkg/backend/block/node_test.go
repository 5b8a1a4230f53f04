package block

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
)

func fsSize(fsType string) int64 {
	if fsType == fsXFS {
		return xfsMinSize
	}
	return 64 * mib
}

func TestStagedFilesystemKeepsDataAcrossUnstageAndStage(t *testing.T) {
	for _, fsType := range []string{fsExt4, fsXFS} {
		t.Run(fsType, func(t *testing.T) {
			f := newFixture(t, "zone-a")
			spec := mountSpec(t, "zone-a", "data", fsType, fsSize(fsType))
			f.create(t, spec)
			f.attach(t, spec.ID, writer("n1"))

			req := f.mountReq(spec.ID, "n1", "data", false)
			staged := f.stage(t, req)
			if !loop.ValidDevice(staged.Device) || staged.FsType != fsType || staged.StagingPath != req.StagingPath {
				t.Fatalf("unexpected staged %+v", staged)
			}
			if got := mountedFsType(t, req.StagingPath); got != fsType {
				t.Fatalf("staging path holds %q, want %q", got, fsType)
			}
			writeFileSynced(t, filepath.Join(req.StagingPath, "hello"), "kept")
			if h := f.node.Health(context.Background(), staged); h.Abnormal {
				t.Fatalf("health of a fresh stage: %+v", h)
			}
			f.unstage(t, staged)
			assertNothingStagedUnder(t, f.root)
			if fi, err := os.Stat(req.StagingPath); err != nil || fi.Mode().Perm() != 0o750 {
				t.Fatalf("staging path the stage created: %v, %v; want a 0750 directory", fi, err)
			}
			// Unstaging twice is fine.
			f.unstage(t, staged)

			again := f.stage(t, req)
			if got := readFile(t, filepath.Join(req.StagingPath, "hello")); got != "kept" {
				t.Fatalf("after restage the file holds %q", got)
			}
			f.unstage(t, again)
			assertNothingStagedUnder(t, f.root)
		})
	}
}

func TestStageRefusesANodeTheVolumeIsNotAttachedTo(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "guarded", "", 64*mib)
	f.create(t, spec)

	_, err := f.node.Stage(context.Background(), f.mountReq(spec.ID, "n2", "guarded", false))
	wantCode(t, err, codes.FailedPrecondition)
	if !strings.Contains(err.Error(), "attached to: no node") {
		t.Errorf("message %q does not say nobody holds the volume", err)
	}

	f.attach(t, spec.ID, writer("n1"))
	_, err = f.node.Stage(context.Background(), f.mountReq(spec.ID, "n2", "guarded", false))
	wantCode(t, err, codes.FailedPrecondition)
	for _, part := range []string{"not attached to node n2", "attached to: n1", "ControllerPublishVolume must succeed first"} {
		if !strings.Contains(err.Error(), part) {
			t.Errorf("message %q lacks %q", err, part)
		}
	}
	assertNothingStagedUnder(t, f.root)
}

func TestStageRefusesWhatDoesNotMatchTheVolume(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "typed", "ext4", 64*mib)
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	blockReq := f.mountReq(spec.ID, "n1", "typed", false)
	blockReq.AccessType = accessmode.Block
	btrfsReq := f.mountReq(spec.ID, "n1", "typed", false)
	btrfsReq.FsType = "btrfs"
	otherZone := f.mountReq(volID(t, "zone-z", "typed"), "n1", "typed", false)
	missing := f.mountReq(volID(t, "zone-a", "never-created"), "n1", "typed", false)
	relative := f.mountReq(spec.ID, "n1", "typed", false)
	relative.StagingPath = "staging/typed"

	tests := []struct {
		name string
		req  backend.StageRequest
		want codes.Code
		says string
	}{
		{"access type differs", blockReq, codes.FailedPrecondition, "access type"},
		{"unsupported fs type", btrfsReq, codes.InvalidArgument, "btrfs"},
		{"zone without a pool on this node", otherZone, codes.FailedPrecondition, `no block pool for zone "zone-z"`},
		{"volume never created", missing, codes.NotFound, "does not exist"},
		{"relative staging path", relative, codes.InvalidArgument, "absolute"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := f.node.Stage(context.Background(), tt.req)
			wantCode(t, err, tt.want)
			if !strings.Contains(err.Error(), tt.says) {
				t.Errorf("message %q lacks %q", err, tt.says)
			}
		})
	}
	assertNothingStagedUnder(t, f.root)
}

// A node whose pool directory is not the controller's (a hostPath on
// another machine) must say so, not report the volume as never created:
// the one is an install mistake, the other a CO's stale record.
func TestStageOnANodeThatDoesNotShareThePoolSaysSo(t *testing.T) {
	f := newFixture(t, "zone-a", "zone-b")
	spec := mountSpec(t, "zone-a", "elsewhere", "ext4", 64*mib)
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))

	ownDir := filepath.Join(f.root, "node-local-pool")
	if err := os.MkdirAll(ownDir, 0o700); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		dir  string
		says []string
	}{
		{"a directory no controller used", ownDir, []string{"not the pool the controller uses", ownDir, PoolMarkerFile, "iscsi.enabled"}},
		{"another zone's pool", f.pools["zone-b"], []string{`is the pool of zone "zone-b"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node, err := NewNode(map[string]string{"zone-a": tt.dir})
			if err != nil {
				t.Fatalf("NewNode: %v", err)
			}
			_, err = node.Stage(context.Background(), f.mountReq(spec.ID, "n1", "elsewhere", false))
			wantCode(t, err, codes.FailedPrecondition)
			for _, part := range tt.says {
				if !strings.Contains(err.Error(), part) {
					t.Errorf("message %q lacks %q", err, part)
				}
			}
		})
	}
	// The node on the controller's own pool stages it.
	f.unstage(t, f.stage(t, f.mountReq(spec.ID, "n1", "elsewhere", false)))
	assertNothingStagedUnder(t, f.root)
}

func TestStageHonoursAReadOnlyAttachment(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "ro-att", "ext4", 64*mib)
	spec.Modes = []accessmode.Mode{accessmode.MultiNodeSingleWriter}
	spec.AccessType = accessmode.Block
	f.create(t, spec)
	tests := []struct {
		name       string
		attachment accessmode.Attachment
	}{
		{"attached read-only", accessmode.Attachment{Node: testNode("n1"), Mode: accessmode.MultiNodeSingleWriter, ReadOnly: true}},
		{"attached with a read-only mode", accessmode.Attachment{Node: testNode("n1"), Mode: accessmode.MultiNodeReaderOnly}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f.attach(t, spec.ID, tt.attachment)
			req := backend.StageRequest{VolumeID: spec.ID, Node: testNode("n1"), AccessType: accessmode.Block}
			_, err := f.node.Stage(context.Background(), req)
			wantCode(t, err, codes.FailedPrecondition)
			if !strings.Contains(err.Error(), "read-only") {
				t.Fatalf("message %q does not say why", err)
			}
			req.ReadOnly = true
			f.unstage(t, f.stage(t, req))
		})
	}
	assertNothingStagedUnder(t, f.root)
}

func TestStageWithoutFsTypeAdoptsTheVolumesFilesystem(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "untyped", "", xfsMinSize)
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	first := f.mountReq(spec.ID, "n1", "untyped", false)
	first.FsType = fsXFS
	f.unstage(t, f.stage(t, first))

	staged := f.stage(t, f.mountReq(spec.ID, "n1", "untyped", false))
	if staged.FsType != fsXFS || mountedFsType(t, staged.StagingPath) != fsXFS {
		t.Fatalf("stage without fs type mounted %q (staged %q), want the xfs it holds", mountedFsType(t, staged.StagingPath), staged.FsType)
	}
	f.unstage(t, staged)

	fresh := mountSpec(t, "zone-a", "fresh", "", 64*mib)
	f.create(t, fresh)
	f.attach(t, fresh.ID, writer("n1"))
	staged = f.stage(t, f.mountReq(fresh.ID, "n1", "fresh", false))
	if staged.FsType != fsExt4 || mountedFsType(t, staged.StagingPath) != fsExt4 {
		t.Fatalf("an unformatted volume without fs type got %q, want ext4", staged.FsType)
	}
	f.unstage(t, staged)
	assertNothingStagedUnder(t, f.root)
}

func TestFailedMountDetachesTheLoopDevice(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "xfs-vol", "xfs", xfsMinSize)
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	staged := f.stage(t, f.mountReq(spec.ID, "n1", "first", false))
	f.unstage(t, staged)

	// Formatted as xfs; asking for ext4 must fail after the attach.
	req := f.mountReq(spec.ID, "n1", "second", false)
	req.FsType = fsExt4
	_, err := f.node.Stage(context.Background(), req)
	wantCode(t, err, codes.FailedPrecondition)
	assertNothingStagedUnder(t, f.root)

	// Read-only first use cannot format (a volume that names no
	// filesystem is formatted by its first stage).
	fresh := mountSpec(t, "zone-a", "fresh", "", 64*mib)
	f.create(t, fresh)
	f.attach(t, fresh.ID, reader("n1"))
	_, err = f.node.Stage(context.Background(), f.mountReq(fresh.ID, "n1", "fresh", true))
	wantCode(t, err, codes.FailedPrecondition)
	assertNothingStagedUnder(t, f.root)
}

func TestReadOnlyStageRefusesWritesWithEROFS(t *testing.T) {
	for _, fsType := range []string{fsExt4, fsXFS} {
		t.Run(fsType, func(t *testing.T) {
			f := newFixture(t, "zone-a")
			spec := mountSpec(t, "zone-a", "ro", fsType, fsSize(fsType))
			f.create(t, spec)
			f.attach(t, spec.ID, writer("n1"))
			rw := f.stage(t, f.mountReq(spec.ID, "n1", "rw", false))
			writeFileSynced(t, filepath.Join(rw.StagingPath, "existing"), "readable")
			f.unstage(t, rw)

			f.attach(t, spec.ID, reader("n1"))
			ro := f.stage(t, f.mountReq(spec.ID, "n1", "ro", true))
			if !ro.ReadOnly {
				t.Fatal("staged is not marked read-only")
			}
			if got := readFile(t, filepath.Join(ro.StagingPath, "existing")); got != "readable" {
				t.Fatalf("read %q", got)
			}
			err := os.WriteFile(filepath.Join(ro.StagingPath, "new"), []byte("x"), 0o600)
			if !errors.Is(err, syscall.EROFS) {
				t.Fatalf("write on a read-only stage: %v, want EROFS", err)
			}
			if ro, _ := os.ReadFile(filepath.Join("/sys/block", filepath.Base(ro.Device), "ro")); strings.TrimSpace(string(ro)) != "1" {
				t.Fatal("the loop device itself is writable")
			}
			f.unstage(t, ro)
			assertNothingStagedUnder(t, f.root)
		})
	}
}

func TestReadOnlyVolumeServesSeveralNodesOnOneMachine(t *testing.T) {
	for _, fsType := range []string{fsExt4, fsXFS} {
		t.Run(fsType, func(t *testing.T) {
			f := newFixture(t, "zone-a")
			spec := mountSpec(t, "zone-a", "shared", fsType, fsSize(fsType))
			spec.Modes = []accessmode.Mode{accessmode.MultiNodeReaderOnly}
			f.create(t, spec)
			f.attach(t, spec.ID, reader("n1"), reader("n2"))
			// Two node processes share the pool; each gets its own device.
			other, err := NewNode(f.pools)
			if err != nil {
				t.Fatal(err)
			}
			s1 := f.stage(t, f.mountReq(spec.ID, "n1", "n1", true))
			s2, err := other.Stage(context.Background(), f.mountReq(spec.ID, "n2", "n2", true))
			if err != nil {
				t.Fatalf("second node: %v", err)
			}
			t.Cleanup(func() { other.Unstage(context.Background(), s2) })
			if s1.Device == s2.Device {
				t.Fatalf("both nodes share %s", s1.Device)
			}
			for _, s := range []*backend.Staged{s1, s2} {
				err := os.WriteFile(filepath.Join(s.StagingPath, "x"), nil, 0o600)
				if !errors.Is(err, syscall.EROFS) {
					t.Fatalf("write on %s: %v, want EROFS", s.StagingPath, err)
				}
			}
			// Unstaging one node must leave the other's device alone.
			if err := other.Unstage(context.Background(), s2); err != nil {
				t.Fatal(err)
			}
			if h := f.node.Health(context.Background(), s1); h.Abnormal {
				t.Fatalf("first node after the second unstaged: %+v", h)
			}
			f.unstage(t, s1)
			assertNothingStagedUnder(t, f.root)
		})
	}
}

func TestRawBlockStageExposesTheWholeCapacity(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "raw", "", 48*mib)
	spec.AccessType = accessmode.Block
	spec.Modes = []accessmode.Mode{accessmode.MultiNodeMultiWriter}
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	req := backend.StageRequest{VolumeID: spec.ID, Node: testNode("n1"), StagingPath: filepath.Join(f.root, "staging", "raw"), AccessType: accessmode.Block}
	staged := f.stage(t, req)
	size, err := loop.Size(staged.Device)
	if err != nil {
		t.Fatal(err)
	}
	if size != 48*mib {
		t.Fatalf("device is %d bytes, want %d", size, 48*mib)
	}
	if h := f.node.Health(context.Background(), staged); h.Abnormal {
		t.Fatalf("health: %+v", h)
	}
	// Through the device, into the image.
	writeAt(t, staged.Device, []byte("raw bytes"), 7*mib)
	dev, _ := os.OpenFile(staged.Device, os.O_RDWR, 0)
	dev.Sync()
	dev.Close()
	f.unstage(t, staged)
	if got := readAt(t, imageOf(t, f, spec.ID), 9, 7*mib); string(got) != "raw bytes" {
		t.Fatalf("image holds %q", got)
	}

	ro := req
	ro.ReadOnly = true
	roStaged := f.stage(t, ro)
	// Linux may let the device be opened for writing; the write itself fails.
	if dev, err := os.OpenFile(roStaged.Device, os.O_WRONLY, 0); err == nil {
		_, werr := dev.WriteAt(make([]byte, 4096), 0)
		dev.Close()
		if !errors.Is(werr, syscall.EPERM) && !errors.Is(werr, syscall.EROFS) && !errors.Is(werr, syscall.EACCES) {
			t.Fatalf("write to a read-only block stage: %v, want EPERM/EROFS/EACCES", werr)
		}
	}
	f.unstage(t, roStaged)
	assertNothingStagedUnder(t, f.root)
}

func TestOnlineExpandGrowsTheMountedFilesystem(t *testing.T) {
	for _, fsType := range []string{fsExt4, fsXFS} {
		t.Run(fsType, func(t *testing.T) {
			f := newFixture(t, "zone-a")
			initial := fsSize(fsType)
			spec := mountSpec(t, "zone-a", "grow", fsType, initial)
			f.create(t, spec)
			f.attach(t, spec.ID, writer("n1"))
			staged := f.stage(t, f.mountReq(spec.ID, "n1", "grow", false))
			before := statfsBytes(t, staged.StagingPath)

			if _, err := f.ctrl.ExpandVolume(context.Background(), spec.ID, 2*initial); err != nil {
				t.Fatal(err)
			}
			size, err := f.node.Expand(context.Background(), staged)
			if fsType == fsExt4 && !hasCapSysResource(t) {
				// The kernel refuses to grow mounted ext4 without the
				// capability; the device grows, the filesystem at the next
				// stage.
				wantCode(t, err, codes.FailedPrecondition)
				if !strings.Contains(err.Error(), "CAP_SYS_RESOURCE") {
					t.Fatalf("message %q does not name the missing capability", err)
				}
				if got, _ := loop.Size(staged.Device); got != 2*initial {
					t.Fatalf("device is %d bytes after Expand, want %d", got, 2*initial)
				}
				f.unstage(t, staged)
				staged = f.stage(t, f.mountReq(spec.ID, "n1", "grow", false))
				t.Log("no CAP_SYS_RESOURCE: ext4 grew at restage instead of online")
			} else {
				if err != nil {
					t.Fatal(err)
				}
				if size != 2*initial {
					t.Fatalf("Expand reports %d bytes, want %d", size, 2*initial)
				}
			}
			after := statfsBytes(t, staged.StagingPath)
			if after < before+initial*9/10 {
				t.Fatalf("filesystem grew from %d to %d bytes, want about %d more", before, after, initial)
			}
			f.unstage(t, staged)
			assertNothingStagedUnder(t, f.root)
		})
	}
}

func TestSnapshotRestoreAndCloneCarryFilesystemData(t *testing.T) {
	for _, fsType := range []string{fsExt4, fsXFS} {
		t.Run(fsType, func(t *testing.T) {
			f := newFixture(t, "zone-a", "zone-b")
			ctx := context.Background()
			size := fsSize(fsType)
			spec := mountSpec(t, "zone-a", "origin", fsType, size)
			f.create(t, spec)
			f.attach(t, spec.ID, writer("n1"))
			origin := f.stage(t, f.mountReq(spec.ID, "n1", "origin", false))
			writeFileSynced(t, filepath.Join(origin.StagingPath, "f"), "from origin")
			f.unstage(t, origin)
			// Detached: these pools have no reflinks, and a volume attached
			// for writing is not copied there (TestSnapshotOfAVolumeInUse).
			f.attach(t, spec.ID)

			sid := snapID(t, "zone-a", "snap")
			if _, err := f.ctrl.CreateSnapshot(ctx, sid, "snap", spec.ID); err != nil {
				t.Fatal(err)
			}
			restored := mountSpec(t, "zone-b", "restored", fsType, 2*size)
			restored.Source = &backend.Source{SnapshotID: sid.String()}
			f.create(t, restored)
			f.attach(t, restored.ID, writer("n1"))
			clone := mountSpec(t, "zone-a", "clone", fsType, size)
			clone.Source = &backend.Source{VolumeID: spec.ID.String()}
			f.create(t, clone)
			f.attach(t, clone.ID, writer("n1"))
			f.attach(t, spec.ID, writer("n1"))

			// All three at once: xfs copies share a UUID.
			origin = f.stage(t, f.mountReq(spec.ID, "n1", "origin", false))
			r := f.stage(t, f.mountReq(restored.ID, "n1", "restored", false))
			c := f.stage(t, f.mountReq(clone.ID, "n1", "clone", false))
			for _, s := range []*backend.Staged{r, c} {
				if got := readFile(t, filepath.Join(s.StagingPath, "f")); got != "from origin" {
					t.Fatalf("%s holds %q", s.StagingPath, got)
				}
			}
			// The restore was made larger; stage grew the filesystem into it.
			if got, small := statfsBytes(t, r.StagingPath), statfsBytes(t, origin.StagingPath); got < small+size*9/10 {
				t.Fatalf("restored filesystem has %d bytes, origin %d: not grown", got, small)
			}
			writeFileSynced(t, filepath.Join(c.StagingPath, "f"), "changed in clone")
			if got := readFile(t, filepath.Join(origin.StagingPath, "f")); got != "from origin" {
				t.Fatalf("writing the clone changed the origin: %q", got)
			}
			for _, s := range []*backend.Staged{origin, r, c} {
				f.unstage(t, s)
			}
			assertNothingStagedUnder(t, f.root)
		})
	}
}

func TestUnstageNeverDetachesAForeignLoopDevice(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "mine", "", 64*mib)
	spec.AccessType = accessmode.Block
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))

	foreignImage := filepath.Join(f.root, "foreign.img")
	if err := os.WriteFile(foreignImage, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(foreignImage, 16*mib); err != nil {
		t.Fatal(err)
	}
	foreign, err := loop.Attach(context.Background(), foreignImage, false)
	if err != nil {
		t.Fatal(err)
	}
	// A staged record whose device number has since been reused.
	stale := &backend.Staged{VolumeID: spec.ID.String(), AccessType: accessmode.Block, Device: foreign.Path}
	if err := f.node.Unstage(context.Background(), stale); err != nil {
		t.Fatal(err)
	}
	if backing, _ := loop.BackingFile(foreign.Path); backing != foreignImage {
		t.Fatalf("foreign device %s was detached (backing now %q)", foreign.Path, backing)
	}
	if h := f.node.Health(context.Background(), stale); !h.Abnormal || h.Reason != "LoopDeviceReassigned" {
		t.Fatalf("health of a reassigned device: %+v", h)
	}
	if _, err := f.node.Expand(context.Background(), stale); codeOf(err) != codes.FailedPrecondition {
		t.Fatalf("Expand on a reassigned device: %v", err)
	}
	if _, err := loop.DetachIfBackedBy(context.Background(), foreign.Path, foreignImage); err != nil {
		t.Fatal(err)
	}
	bogus := &backend.Staged{VolumeID: spec.ID.String(), AccessType: accessmode.Block, Device: "/dev/sda"}
	if err := f.node.Unstage(context.Background(), bogus); err == nil {
		t.Fatal("Unstage accepted a device that is not a loop device")
	}
	assertNothingStagedUnder(t, f.root)
}

func TestNodeHealthNoticesWhatWentAway(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "watched", "ext4", 64*mib)
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	staged := f.stage(t, f.mountReq(spec.ID, "n1", "watched", false))
	if h := f.node.Health(ctx, staged); h.Abnormal {
		t.Fatalf("healthy stage reported %+v", h)
	}
	if out, err := exec.Command("umount", staged.StagingPath).CombinedOutput(); err != nil {
		t.Fatalf("umount: %v: %s", err, out)
	}
	if h := f.node.Health(ctx, staged); !h.Abnormal || h.Reason != "StagingPathNotMounted" {
		t.Fatalf("after umount: %+v", h)
	}
	if out, err := exec.Command("losetup", "--detach", staged.Device).CombinedOutput(); err != nil {
		t.Fatalf("losetup -d: %v: %s", err, out)
	}
	if h := f.node.Health(ctx, staged); !h.Abnormal || h.Reason != "LoopDeviceDetached" {
		t.Fatalf("after detach: %+v", h)
	}
	if err := os.Remove(imageOf(t, f, spec.ID)); err != nil {
		t.Fatal(err)
	}
	if h := f.node.Health(ctx, staged); !h.Abnormal || h.Reason != "ImageMissing" {
		t.Fatalf("after removing the image: %+v", h)
	}
	f.unstage(t, staged)
	assertNothingStagedUnder(t, f.root)
}

func TestStageRetriedOnAStagedPathReusesTheMount(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "retry", "ext4", 64*mib)
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	req := f.mountReq(spec.ID, "n1", "retry", false)
	first := f.stage(t, req)
	second := f.stage(t, req)
	if second.Device != first.Device {
		t.Fatalf("retried stage attached %s besides %s", second.Device, first.Device)
	}
	if n := len(loopsUnder(t, f.root)); n != 1 {
		t.Fatalf("%d loop devices for one volume", n)
	}

	roRetry := req
	roRetry.ReadOnly = true
	_, err := f.node.Stage(context.Background(), roRetry)
	wantCode(t, err, codes.AlreadyExists)
	xfsRetry := req
	xfsRetry.FsType = fsXFS
	_, err = f.node.Stage(context.Background(), xfsRetry)
	wantCode(t, err, codes.AlreadyExists)

	other := mountSpec(t, "zone-a", "other", "ext4", 64*mib)
	f.create(t, other)
	f.attach(t, other.ID, writer("n1"))
	clash := f.mountReq(other.ID, "n1", "retry", false)
	_, err = f.node.Stage(context.Background(), clash)
	wantCode(t, err, codes.AlreadyExists)
	f.unstage(t, first)
	assertNothingStagedUnder(t, f.root)
}

func TestStageWorksWithPoolsOnTmpfs(t *testing.T) {
	requireRoot(t)
	root := testRoot(t)
	poolDir := filepath.Join(root, "pool")
	mountTmpfs(t, poolDir, "512m")
	f := openFixture(t, root, map[string]string{"zone-a": poolDir})
	for _, fsType := range []string{fsExt4, fsXFS} {
		spec := mountSpec(t, "zone-a", "tmpfs-"+fsType, fsType, fsSize(fsType))
		f.create(t, spec)
		f.attach(t, spec.ID, writer("n1"))
		staged := f.stage(t, f.mountReq(spec.ID, "n1", fsType, false))
		writeFileSynced(t, filepath.Join(staged.StagingPath, "f"), fsType)
		f.unstage(t, staged)
		staged = f.stage(t, f.mountReq(spec.ID, "n1", fsType, true))
		if got := readFile(t, filepath.Join(staged.StagingPath, "f")); got != fsType {
			t.Fatalf("read back %q", got)
		}
		f.unstage(t, staged)
	}
	assertNothingStagedUnder(t, f.root)
}

func mountedFsType(t *testing.T, path string) string {
	t.Helper()
	for _, mp := range mountsUnder(t, path) {
		if mp.Path == path {
			return mp.Type
		}
	}
	t.Fatalf("%s is not mounted", path)
	return ""
}

func statfsBytes(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks) * st.Bsize
}

// hasCapSysResource reports whether this process may grow a mounted ext4
// filesystem (some CI machines drop the capability from the bounding set).
func hasCapSysResource(t *testing.T) bool {
	t.Helper()
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return caps&(1<<unix.CAP_SYS_RESOURCE) != 0
		}
	}
	t.Fatal("no CapEff in /proc/self/status")
	return false
}

// TestExpandRefusesADeviceOfAReplacedImage: a volume deleted and created
// again reuses its image's name. A device still bound to the deleted image
// is not the volume any more: Expand refuses it (it would refresh to the
// old file's size), health says the image was replaced, and Unstage still
// cleans it up.
func TestExpandRefusesADeviceOfAReplacedImage(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "reborn", "", 16*mib)
	spec.AccessType = accessmode.Block
	f.create(t, spec)
	f.attach(t, spec.ID, writer("n1"))
	req := f.mountReq(spec.ID, "n1", "reborn", false)
	req.AccessType = accessmode.Block
	staged := f.stage(t, req)

	image := imageOf(t, f, spec.ID)
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(image, 32*mib); err != nil {
		t.Fatal(err)
	}
	_, err := f.node.Expand(ctx, staged)
	wantCode(t, err, codes.FailedPrecondition)
	if h := f.node.Health(ctx, staged); !h.Abnormal || h.Reason != "ImageReplaced" {
		t.Fatalf("health of a device bound to the replaced image: %+v", h)
	}
	f.unstage(t, staged)
	assertNothingStagedUnder(t, f.root)
}

// sysfsBytes is the size of a block device as /sys/block/<dev>/size tells
// it (512-byte sectors), a second view next to loop.Size's ioctl.
func sysfsBytes(t *testing.T, dev string) int64 {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "size"))
	if err != nil {
		t.Fatal(err)
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return sectors * 512
}

// TestExpandOfAReadOnlyFilesystemStage: a volume some node may write, staged
// read-only, gets its device refreshed, but its filesystem cannot grow
// there; the answer is FAILED_PRECONDITION saying it grows at the next
// read/write stage, not OK, and that stage does grow it.
func TestExpandOfAReadOnlyFilesystemStage(t *testing.T) {
	for _, fsType := range []string{fsExt4, fsXFS} {
		t.Run(fsType, func(t *testing.T) {
			f := newFixture(t, "zone-a")
			ctx := context.Background()
			initial := fsSize(fsType)
			spec := mountSpec(t, "zone-a", "ro-grow", fsType, initial)
			f.create(t, spec)
			f.attach(t, spec.ID, writer("n1"))
			f.unstage(t, f.stage(t, f.mountReq(spec.ID, "n1", "format", false)))

			f.attach(t, spec.ID, accessmode.Attachment{Node: testNode("n1"), Mode: accessmode.SingleNodeWriter, ReadOnly: true})
			ro := f.stage(t, f.mountReq(spec.ID, "n1", "ro", true))
			before := statfsBytes(t, ro.StagingPath)
			vol, err := f.ctrl.ExpandVolume(ctx, spec.ID, 2*initial)
			if err != nil {
				t.Fatal(err)
			}
			if !f.ctrl.NodeExpansionRequired(vol) {
				t.Fatal("a writable filesystem volume grew without asking its nodes to expand it")
			}

			size, err := f.node.Expand(ctx, ro)
			wantCode(t, err, codes.FailedPrecondition)
			if size != 0 || !strings.Contains(err.Error(), "next staged read/write") {
				t.Fatalf("Expand of a read-only stage = %d, %q; want no size and a message saying when the filesystem grows", size, err)
			}
			if got, _ := loop.Size(ro.Device); got != 2*initial {
				t.Fatalf("read-only device is %d bytes after Expand, want %d", got, 2*initial)
			}
			if got := sysfsBytes(t, ro.Device); got != 2*initial {
				t.Fatalf("sysfs gives the read-only device %d bytes, want %d", got, 2*initial)
			}
			if ro, err := loop.ReadOnly(ro.Device); err != nil || !ro {
				t.Fatalf("the refreshed device is no longer read-only (%t, %v)", ro, err)
			}
			if after := statfsBytes(t, ro.StagingPath); after != before {
				t.Fatalf("the read-only filesystem changed size from %d to %d", before, after)
			}
			f.unstage(t, ro)

			f.attach(t, spec.ID, writer("n1"))
			rw := f.stage(t, f.mountReq(spec.ID, "n1", "rw", false))
			if after := statfsBytes(t, rw.StagingPath); after < before+initial*9/10 {
				t.Fatalf("the next read/write stage has %d bytes, was %d; want about %d more", after, before, initial)
			}
			f.unstage(t, rw)
			assertNothingStagedUnder(t, f.root)
		})
	}
}

// TestVolumeNoNodeMayWriteGrowsOnlyAsRawBlock: a filesystem volume whose
// every mode is read-only cannot grow on any node, so its image is not
// grown (OUT_OF_RANGE) and no node is asked to expand it; a raw block one
// grows, and its readers' devices take the new size.
func TestVolumeNoNodeMayWriteGrowsOnlyAsRawBlock(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	rox := []accessmode.Mode{accessmode.MultiNodeReaderOnly}

	fs := mountSpec(t, "zone-a", "rox-fs", fsExt4, 64*mib)
	fs.Modes = rox
	f.create(t, fs)
	_, err := f.ctrl.ExpandVolume(ctx, fs.ID, 128*mib)
	wantCode(t, err, codes.OutOfRange)
	if !strings.Contains(err.Error(), "no node may write") {
		t.Fatalf("refusal %q does not say why", err)
	}
	vol, err := f.ctrl.Volume(ctx, fs.ID)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(imageOf(t, f, fs.ID)); err != nil || vol.CapacityBytes != 64*mib || fi.Size() != 64*mib {
		t.Fatalf("after the refusal: capacity %d, image %v (%v); want both %d", vol.CapacityBytes, fi.Size(), err, 64*mib)
	}
	if vol, err = f.ctrl.ExpandVolume(ctx, fs.ID, 64*mib); err != nil {
		t.Fatalf("an expansion to the size it has: %v, want OK", err)
	}
	if f.ctrl.NodeExpansionRequired(vol) {
		t.Fatal("nodes are asked to expand a filesystem no node can grow")
	}
	f.attach(t, fs.ID, reader("r1"))
	staged := f.stage(t, f.mountReq(fs.ID, "r1", "rox-fs", true))
	_, err = f.node.Expand(ctx, staged)
	wantCode(t, err, codes.FailedPrecondition)
	if !strings.Contains(err.Error(), "cannot grow on any node") {
		t.Fatalf("Expand of a volume no node may write: %q does not say it never grows", err)
	}
	f.unstage(t, staged)

	raw := mountSpec(t, "zone-a", "rox-raw", "", 16*mib)
	raw.AccessType, raw.Modes = accessmode.Block, rox
	f.create(t, raw)
	f.attach(t, raw.ID, reader("r1"), reader("r2"))
	var readers []*backend.Staged
	for _, n := range []string{"r1", "r2"} {
		readers = append(readers, f.stage(t, backend.StageRequest{VolumeID: raw.ID, Node: testNode(n), ReadOnly: true,
			StagingPath: filepath.Join(f.root, "staging", "rox-raw-"+n), AccessType: accessmode.Block}))
	}
	if vol, err = f.ctrl.ExpandVolume(ctx, raw.ID, 32*mib); err != nil || vol.CapacityBytes != 32*mib {
		t.Fatalf("ExpandVolume of a raw block volume no node may write: %+v, %v; want it grown to %d", vol, err, 32*mib)
	}
	if !f.ctrl.NodeExpansionRequired(vol) {
		t.Fatal("the readers of a grown raw block volume are not asked to refresh their devices")
	}
	for _, s := range readers {
		if size, err := f.node.Expand(ctx, s); err != nil || size != 32*mib || sysfsBytes(t, s.Device) != 32*mib {
			t.Fatalf("Expand of reader %s: %d, %v, device %d bytes; want %d", s.Device, size, err, sysfsBytes(t, s.Device), 32*mib)
		}
	}
	for _, s := range readers {
		f.unstage(t, s)
	}
	assertNothingStagedUnder(t, f.root)
}

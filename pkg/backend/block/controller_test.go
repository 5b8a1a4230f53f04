package block

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
)

func TestCreateVolumeRefusesBadSpecs(t *testing.T) {
	f := newFixture(t, "zone-a")
	nfsID, _ := volumeid.New(accessmode.BackendNFS, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "nfs"))
	tests := []struct {
		name   string
		mutate func(*backend.VolumeSpec)
		want   codes.Code
	}{
		{"zone without a pool", func(s *backend.VolumeSpec) { s.ID = volID(t, "zone-z", "v") }, codes.InvalidArgument},
		{"nfs id", func(s *backend.VolumeSpec) { s.ID = nfsID }, codes.InvalidArgument},
		{"snapshot id", func(s *backend.VolumeSpec) { s.ID = snapID(t, "zone-a", "v") }, codes.InvalidArgument},
		{"zero capacity", func(s *backend.VolumeSpec) { s.CapacityBytes = 0 }, codes.InvalidArgument},
		{"unsupported fs type", func(s *backend.VolumeSpec) { s.FsType = "btrfs" }, codes.InvalidArgument},
		{"unknown access type", func(s *backend.VolumeSpec) { s.AccessType = "tape" }, codes.InvalidArgument},
		{"two sources", func(s *backend.VolumeSpec) {
			s.Source = &backend.Source{SnapshotID: snapID(t, "zone-a", "s").String(), VolumeID: volID(t, "zone-a", "x").String()}
		}, codes.InvalidArgument},
		{"unknown snapshot", func(s *backend.VolumeSpec) { s.Source = &backend.Source{SnapshotID: snapID(t, "zone-a", "s").String()} }, codes.NotFound},
		{"unknown source volume", func(s *backend.VolumeSpec) { s.Source = &backend.Source{VolumeID: volID(t, "zone-a", "x").String()} }, codes.NotFound},
		{"source in a zone without a pool", func(s *backend.VolumeSpec) { s.Source = &backend.Source{VolumeID: volID(t, "zone-z", "x").String()} }, codes.NotFound},
		{"unparsable source", func(s *backend.VolumeSpec) { s.Source = &backend.Source{VolumeID: "block:zone-a:../../etc"} }, codes.NotFound},
		{"way too large", func(s *backend.VolumeSpec) { s.CapacityBytes = 1 << 60 }, codes.ResourceExhausted},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := mountSpec(t, "zone-a", "v", "", 16*mib)
			tt.mutate(&spec)
			_, err := f.ctrl.CreateVolume(context.Background(), spec)
			wantCode(t, err, tt.want)
		})
	}
	entries, err := os.ReadDir(filepath.Join(f.pools["zone-a"], "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 0 {
		t.Fatalf("refused creations left files behind: %v", entries)
	}
	if _, err := f.ctrl.Capacity(context.Background(), "zone-z"); err == nil {
		t.Fatal("Capacity of a zone without a pool succeeded")
	} else {
		wantCode(t, err, codes.InvalidArgument)
	}
}

func TestCreateVolumeRecordsAndReturnsTheVolume(t *testing.T) {
	f := newFixture(t, "zone-b", "zone-a")
	if got := f.ctrl.Zones(); !reflect.DeepEqual(got, []string{"zone-a", "zone-b"}) {
		t.Fatalf("Zones = %v, want sorted", got)
	}
	spec := mountSpec(t, "zone-b", "pvc-1", "xfs", 32*mib)
	spec.Parameters = map[string]string{"k": "v"}
	v := f.create(t, spec)
	if v.ID != spec.ID.String() || v.Zone != "zone-b" || v.CapacityBytes != 32*mib || v.CreatedAt.IsZero() || v.FsType != "xfs" {
		t.Fatalf("unexpected volume %+v", v)
	}
	image := imageOf(t, f, spec.ID)
	fi, err := os.Stat(image)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != 32*mib || fi.Mode().Perm() != 0o600 {
		t.Fatalf("image size %d mode %v, want %d and 0600", fi.Size(), fi.Mode().Perm(), 32*mib)
	}
	if alloc, _ := allocatedBytes(image); alloc != 0 {
		t.Fatalf("new image allocates %d bytes, want a sparse file", alloc)
	}
	meta, _ := f.ctrl.pools["zone-b"].metaPath(spec.ID)
	if fi, err := os.Stat(meta); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("metadata %s: %v, %v", meta, fi, err)
	}
	if _, err := f.ctrl.CreateVolume(context.Background(), spec); err == nil {
		t.Fatal("second CreateVolume with the same id succeeded")
	} else {
		wantCode(t, err, codes.AlreadyExists)
	}

	got, err := f.ctrl.Volume(context.Background(), spec.ID)
	if err != nil || !reflect.DeepEqual(got, v) {
		t.Fatalf("Volume = %+v, %v; want %+v", got, err, v)
	}
	// Callers get copies: changing one must not change the index.
	got.Parameters["k"] = "changed"
	got.Modes[0] = accessmode.MultiNodeMultiWriter
	again, _ := f.ctrl.Volume(context.Background(), spec.ID)
	if again.Parameters["k"] != "v" || again.Modes[0] != accessmode.SingleNodeWriter {
		t.Fatal("a returned volume aliases the index")
	}
	_, err = f.ctrl.Volume(context.Background(), volID(t, "zone-a", "absent"))
	wantCode(t, err, codes.NotFound)
}

func TestReadOnlyFilesystemVolumeIsFormattedAtCreate(t *testing.T) {
	f := newFixture(t, "zone-a")
	for _, fs := range []string{"", "ext4", "xfs"} {
		t.Run("fs="+fs, func(t *testing.T) {
			spec := mountSpec(t, "zone-a", "ro-"+fs, fs, xfsMinSize)
			spec.Modes = []accessmode.Mode{accessmode.MultiNodeReaderOnly}
			f.create(t, spec)
			out, err := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", imageOf(t, f, spec.ID)).Output()
			if err != nil {
				t.Fatalf("blkid: %v", err)
			}
			if got := strings.TrimSpace(string(out)); got != fsOrDefault(fs) {
				t.Fatalf("image holds %q, want %q", got, fsOrDefault(fs))
			}
		})
	}
	// A writable ext4 volume gets its filesystem from a template at create
	// (template_test.go); the others are left for the node.
	for _, fs := range []string{"", "xfs"} {
		t.Run("writable volume is left for the node, fs="+fs, func(t *testing.T) {
			spec := mountSpec(t, "zone-a", "rw-"+fs, fs, xfsMinSize)
			f.create(t, spec)
			if err := exec.Command("blkid", "-p", imageOf(t, f, spec.ID)).Run(); err == nil {
				t.Fatal("a writable volume was formatted at create")
			}
		})
	}
}

func TestCapacityShrinksAsVolumesAreCreated(t *testing.T) {
	requireRoot(t)
	root := testRoot(t)
	poolDir := filepath.Join(root, "pool")
	mountTmpfs(t, poolDir, "256m")
	f := openFixture(t, root, map[string]string{"zone-a": poolDir})
	ctx := context.Background()
	capacity := func() int64 {
		t.Helper()
		c, err := f.ctrl.Capacity(ctx, "zone-a")
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// tmpfs charges a page or so per metadata file; allow for that.
	const slack = 256 << 10

	before := capacity()
	if before < 250*mib {
		t.Fatalf("fresh 256 MiB pool offers only %d bytes", before)
	}
	spec := mountSpec(t, "zone-a", "a", "", 64*mib)
	f.create(t, spec)
	afterCreate := capacity()
	if afterCreate > before-64*mib || afterCreate < before-64*mib-slack {
		t.Fatalf("capacity after a 64 MiB volume = %d, want about %d", afterCreate, before-64*mib)
	}

	// A node writing into the volume it holds moves space from "promised"
	// to "used": what is left for new volumes does not change.
	f.attach(t, spec.ID, writer("n1"))
	img, err := os.OpenFile(imageOf(t, f, spec.ID), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := img.WriteAt(bytes.Repeat([]byte{1}, int(16*mib)), 0); err != nil {
		t.Fatal(err)
	}
	img.Close()
	if afterWrite := capacity(); afterWrite > afterCreate || afterWrite < afterCreate-slack {
		t.Fatalf("capacity after writing 16 MiB into a volume = %d, want about %d", afterWrite, afterCreate)
	}

	_, err = f.ctrl.CreateVolume(ctx, mountSpec(t, "zone-a", "too-big", "", afterCreate+mib))
	wantCode(t, err, codes.ResourceExhausted)
	for _, part := range []string{`"zone-a"`, strconv.FormatInt(afterCreate+mib, 10)} {
		if !strings.Contains(err.Error(), part) {
			t.Errorf("message %q does not name %s", err, part)
		}
	}

	_, err = f.ctrl.ExpandVolume(ctx, spec.ID, 64*mib+afterCreate+mib)
	wantCode(t, err, codes.ResourceExhausted)
	if v, _ := f.ctrl.Volume(ctx, spec.ID); v.CapacityBytes != 64*mib {
		t.Fatalf("refused expansion changed capacity to %d", v.CapacityBytes)
	}

	if err := f.ctrl.DeleteVolume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if afterDelete := capacity(); afterDelete < before-slack {
		t.Fatalf("capacity after deleting the volume = %d, want about %d", afterDelete, before)
	}
}

func TestConcurrentCreationsCannotShareTheLastFreeBytes(t *testing.T) {
	requireRoot(t)
	root := testRoot(t)
	poolDir := filepath.Join(root, "pool")
	mountTmpfs(t, poolDir, "100m")
	f := openFixture(t, root, map[string]string{"zone-a": poolDir})
	free, err := f.ctrl.Capacity(context.Background(), "zone-a")
	if err != nil {
		t.Fatal(err)
	}
	const racers = 4
	var wg sync.WaitGroup
	errs := make([]error, racers)
	for i := range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = f.ctrl.CreateVolume(context.Background(), mountSpec(t, "zone-a", "racer-"+strconv.Itoa(i), "", free*6/10))
		}()
	}
	wg.Wait()
	succeeded := 0
	for _, err := range errs {
		switch codeOf(err) {
		case codes.OK:
			succeeded++
		case codes.ResourceExhausted:
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	if succeeded != 1 {
		t.Fatalf("%d of %d creations of 60%% of the pool succeeded, want exactly 1", succeeded, racers)
	}
}

func TestExpandVolumeGrowsTheImageAndNeverShrinksIt(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "grow", "", 16*mib)
	f.create(t, spec)
	image := imageOf(t, f, spec.ID)
	tests := []struct {
		name    string
		request int64
		want    int64
	}{
		{"grow", 32 * mib, 32 * mib},
		{"same size is a no-op", 32 * mib, 32 * mib},
		{"smaller never shrinks", 8 * mib, 32 * mib},
		{"grow again", 48 * mib, 48 * mib},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := f.ctrl.ExpandVolume(ctx, spec.ID, tt.request)
			if err != nil {
				t.Fatal(err)
			}
			fi, err := os.Stat(image)
			if err != nil {
				t.Fatal(err)
			}
			if v.CapacityBytes != tt.want || fi.Size() != tt.want {
				t.Fatalf("capacity %d, image %d; want %d", v.CapacityBytes, fi.Size(), tt.want)
			}
		})
	}
	_, err := f.ctrl.ExpandVolume(ctx, volID(t, "zone-a", "absent"), 64*mib)
	wantCode(t, err, codes.NotFound)
}

func TestSetAttachmentsIsRecordedInTheMetadata(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "att", "", 16*mib)
	f.create(t, spec)
	atts := []accessmode.Attachment{writer("n1"), reader("n2")}
	v, err := f.ctrl.SetAttachments(ctx, spec.ID, atts)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(v.Attachments, atts) {
		t.Fatalf("returned attachments %+v", v.Attachments)
	}
	// What a node reads is what matters.
	onDisk, err := f.node.loop.readVolume(f.node.loop.pools["zone-a"], spec.ID)
	if err != nil || !reflect.DeepEqual(onDisk.Attachments, atts) {
		t.Fatalf("metadata attachments %+v, %v", onDisk, err)
	}
	if _, err := f.ctrl.SetAttachments(ctx, spec.ID, nil); err != nil {
		t.Fatal(err)
	}
	onDisk, _ = f.node.loop.readVolume(f.node.loop.pools["zone-a"], spec.ID)
	if len(onDisk.Attachments) != 0 {
		t.Fatalf("attachments after clearing: %+v", onDisk.Attachments)
	}
	_, err = f.ctrl.SetAttachments(ctx, volID(t, "zone-a", "absent"), atts)
	wantCode(t, err, codes.NotFound)

	// A node reaches the shared pool through its own loop device: a
	// fence cannot be kept here, and is refused rather than recorded.
	fenced := writer("n1")
	fenced.Fenced = true
	_, err = f.ctrl.SetAttachments(ctx, spec.ID, []accessmode.Attachment{fenced})
	wantCode(t, err, codes.FailedPrecondition)
	if !strings.Contains(err.Error(), "--block-target") {
		t.Errorf("the refusal of a fence does not say where fences hold: %v", err)
	}
	onDisk, _ = f.node.loop.readVolume(f.node.loop.pools["zone-a"], spec.ID)
	if len(onDisk.Attachments) != 0 {
		t.Fatalf("a refused fence was recorded: %+v", onDisk.Attachments)
	}
	// A storage target keeps it (and fences at its target).
	if v, err := f.ctrl.RecordAttachments(ctx, spec.ID, []accessmode.Attachment{fenced}); err != nil || !v.Attachments[0].Fenced {
		t.Fatalf("RecordAttachments of a fenced attachment: %+v, %v", v, err)
	}
	if _, err := f.ctrl.RecordAttachments(ctx, spec.ID, nil); err != nil {
		t.Fatal(err)
	}
}

func TestDeleteVolumeRemovesEverythingAndIsIdempotent(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "del", "", 16*mib)
	f.create(t, spec)
	image := imageOf(t, f, spec.ID)
	meta, _ := f.ctrl.pools["zone-a"].metaPath(spec.ID)
	for i := range 2 {
		if err := f.ctrl.DeleteVolume(ctx, spec.ID); err != nil {
			t.Fatalf("delete #%d: %v", i+1, err)
		}
	}
	if exists(image) || exists(meta) {
		t.Fatal("files survived DeleteVolume")
	}
	if _, err := f.ctrl.Volume(ctx, spec.ID); codeOf(err) != codes.NotFound {
		t.Fatalf("Volume after delete: %v", err)
	}
	if err := f.ctrl.DeleteVolume(ctx, volID(t, "zone-z", "never")); err != nil {
		t.Fatalf("delete in a zone without a pool: %v", err)
	}
	if vols, _ := f.ctrl.ListVolumes(ctx); len(vols) != 0 {
		t.Fatalf("ListVolumes after delete: %v", vols)
	}
}

func TestVolumeHealthReportsMissingAndShrunkImages(t *testing.T) {
	f := newFixture(t, "zone-a")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "health", "", 16*mib)
	f.create(t, spec)
	image := imageOf(t, f, spec.ID)

	h, err := f.ctrl.VolumeHealth(ctx, spec.ID)
	if err != nil || h.Abnormal {
		t.Fatalf("fresh volume: %+v, %v", h, err)
	}
	if err := os.Truncate(image, 8*mib); err != nil {
		t.Fatal(err)
	}
	if h, _ := f.ctrl.VolumeHealth(ctx, spec.ID); !h.Abnormal || h.Reason != "ImageTooSmall" {
		t.Fatalf("shrunk image: %+v", h)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	if h, _ := f.ctrl.VolumeHealth(ctx, spec.ID); !h.Abnormal || h.Reason != "ImageMissing" {
		t.Fatalf("missing image: %+v", h)
	}
	_, err = f.ctrl.VolumeHealth(ctx, volID(t, "zone-a", "absent"))
	wantCode(t, err, codes.NotFound)
}

func TestSnapshotsCopyDataAndRestoreAcrossZones(t *testing.T) {
	f := newFixture(t, "zone-a", "zone-b")
	ctx := context.Background()
	spec := mountSpec(t, "zone-a", "src", "", 16*mib)
	spec.AccessType = accessmode.Block
	f.create(t, spec)
	payload := []byte("written before the snapshot")
	writeAt(t, imageOf(t, f, spec.ID), payload, 5*mib)

	sid := snapID(t, "zone-a", "snap")
	snap, err := f.ctrl.CreateSnapshot(ctx, sid, "snap", spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if snap.SourceVolumeID != spec.ID.String() || snap.SizeBytes != 16*mib || snap.ID != sid.String() || snap.CreatedAt.IsZero() {
		t.Fatalf("unexpected snapshot %+v", snap)
	}
	// Later writes to the source must not reach the snapshot.
	writeAt(t, imageOf(t, f, spec.ID), []byte("written after the snapshot!"), 5*mib)

	restored := mountSpec(t, "zone-b", "restored", "", 24*mib)
	restored.AccessType = accessmode.Block
	restored.Source = &backend.Source{SnapshotID: sid.String()}
	v := f.create(t, restored)
	if v.Source == nil || v.Source.SnapshotID != sid.String() {
		t.Fatalf("restored volume does not record its source: %+v", v.Source)
	}
	img := imageOf(t, f, restored.ID)
	if got := readAt(t, img, len(payload), 5*mib); !bytes.Equal(got, payload) {
		t.Fatalf("restored data %q, want %q", got, payload)
	}
	if fi, _ := os.Stat(img); fi.Size() != 24*mib {
		t.Fatalf("restored image is %d bytes, want it grown to %d", fi.Size(), 24*mib)
	}
	if alloc, _ := allocatedBytes(img); alloc > 2*mib {
		t.Fatalf("restored image allocates %d bytes; the copy was not sparse", alloc)
	}

	small := mountSpec(t, "zone-a", "small", "", 8*mib)
	small.Source = &backend.Source{SnapshotID: sid.String()}
	_, err = f.ctrl.CreateVolume(ctx, small)
	wantCode(t, err, codes.OutOfRange)

	_, err = f.ctrl.CreateSnapshot(ctx, snapID(t, "zone-b", "wrong-zone"), "x", spec.ID)
	wantCode(t, err, codes.InvalidArgument)
	_, err = f.ctrl.CreateSnapshot(ctx, snapID(t, "zone-a", "orphan"), "x", volID(t, "zone-a", "absent"))
	wantCode(t, err, codes.NotFound)

	snaps, _ := f.ctrl.ListSnapshots(ctx)
	if len(snaps) != 1 || !reflect.DeepEqual(snaps[0], snap) {
		t.Fatalf("ListSnapshots = %+v", snaps)
	}
	for range 2 {
		if err := f.ctrl.DeleteSnapshot(ctx, sid); err != nil {
			t.Fatal(err)
		}
	}
	_, err = f.ctrl.Snapshot(ctx, sid)
	wantCode(t, err, codes.NotFound)
	// The restored volume is a full copy and outlives its snapshot.
	if got := readAt(t, img, len(payload), 5*mib); !bytes.Equal(got, payload) {
		t.Fatal("restored data changed after deleting the snapshot")
	}
}

func TestCloneCopiesTheSourceVolume(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "origin", "", 16*mib)
	f.create(t, spec)
	payload := []byte("cloned bytes")
	writeAt(t, imageOf(t, f, spec.ID), payload, 3*mib)
	clone := mountSpec(t, "zone-a", "clone", "", 16*mib)
	clone.Source = &backend.Source{VolumeID: spec.ID.String()}
	f.create(t, clone)
	if got := readAt(t, imageOf(t, f, clone.ID), len(payload), 3*mib); !bytes.Equal(got, payload) {
		t.Fatalf("clone holds %q, want %q", got, payload)
	}
	smaller := mountSpec(t, "zone-a", "smaller", "", 8*mib)
	smaller.Source = &backend.Source{VolumeID: spec.ID.String()}
	_, err := f.ctrl.CreateVolume(context.Background(), smaller)
	wantCode(t, err, codes.OutOfRange)
}

func TestRestartedControllerSeesTheSameVolumesAndRemovesCrashLeftovers(t *testing.T) {
	f := newFixture(t, "zone-a", "zone-b")
	ctx := context.Background()
	a := f.create(t, mountSpec(t, "zone-a", "a", "ext4", 16*mib))
	f.create(t, mountSpec(t, "zone-b", "b", "", 16*mib))
	if _, err := f.ctrl.CreateSnapshot(ctx, snapID(t, "zone-a", "s"), "s", volID(t, "zone-a", "a")); err != nil {
		t.Fatal(err)
	}
	f.attach(t, volID(t, "zone-a", "a"), writer("n1"))
	wantVolumes, _ := f.ctrl.ListVolumes(ctx)
	wantSnapshots, _ := f.ctrl.ListSnapshots(ctx)

	volumes := filepath.Join(f.pools["zone-a"], "volumes")
	snapshots := filepath.Join(f.pools["zone-a"], "snapshots")
	orphanVol := volID(t, "zone-a", "never-recorded")
	orphanSnap := snapID(t, "zone-a", "never-recorded")
	leftovers := []string{
		filepath.Join(volumes, "."+orphanVol.FileName()+".img.tmp-12345"),  // interrupted create
		filepath.Join(volumes, "."+orphanVol.FileName()+".json.tmp-67890"), // interrupted metadata write
		filepath.Join(volumes, orphanVol.FileName()+".img"),                // created, never recorded
		filepath.Join(snapshots, orphanSnap.FileName()+".img"),
	}
	for _, p := range leftovers {
		if err := os.WriteFile(p, []byte("junk"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	foreign := filepath.Join(volumes, "README")
	if err := os.WriteFile(foreign, []byte("not ours"), 0o600); err != nil {
		t.Fatal(err)
	}

	restarted, err := NewController(f.pools)
	if err != nil {
		t.Fatal(err)
	}
	gotVolumes, _ := restarted.ListVolumes(ctx)
	gotSnapshots, _ := restarted.ListSnapshots(ctx)
	if len(gotVolumes) != 2 || len(gotSnapshots) != 1 {
		t.Fatalf("restarted controller lists %d volumes and %d snapshots, want 2 and 1", len(gotVolumes), len(gotSnapshots))
	}
	for i := range gotVolumes {
		if !gotVolumes[i].CreatedAt.Equal(wantVolumes[i].CreatedAt) {
			t.Fatalf("CreatedAt changed over a restart")
		}
		gotVolumes[i].CreatedAt = wantVolumes[i].CreatedAt
	}
	gotSnapshots[0].CreatedAt = wantSnapshots[0].CreatedAt
	if !reflect.DeepEqual(gotVolumes, wantVolumes) || !reflect.DeepEqual(gotSnapshots, wantSnapshots) {
		t.Fatalf("after restart:\n%+v\n%+v\nwant:\n%+v\n%+v", gotVolumes, gotSnapshots, wantVolumes, wantSnapshots)
	}
	if gotVolumes[0].ID != a.ID || len(gotVolumes[0].Attachments) != 1 {
		t.Fatalf("attachments lost over a restart: %+v", gotVolumes[0])
	}
	for _, p := range leftovers {
		if exists(p) {
			t.Errorf("leftover %s survived the restart", filepath.Base(p))
		}
	}
	if !exists(foreign) {
		t.Error("a file the backend did not create was removed")
	}
	if !exists(imageOf(t, f, volID(t, "zone-a", "a"))) {
		t.Error("a recorded image was removed")
	}
}

func TestCorruptMetadataStopsTheController(t *testing.T) {
	f := newFixture(t, "zone-a")
	spec := mountSpec(t, "zone-a", "c", "", 16*mib)
	f.create(t, spec)
	meta, _ := f.ctrl.pools["zone-a"].metaPath(spec.ID)
	if err := os.WriteFile(meta, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Starting without the volume would let its image be treated as a
	// leftover and deleted.
	if _, err := NewController(f.pools); err == nil {
		t.Fatal("NewController accepted corrupt metadata")
	}
	if !exists(imageOf(t, f, spec.ID)) {
		t.Fatal("the image of a volume with corrupt metadata was removed")
	}
}

// A volume record holds each attachment's node as the id string, as
// records written before the node was typed do: such a record loads with
// the node parsed; one whose node id does not parse stops the controller,
// and says which record and what is wrong with it, rather than starting
// without knowing who holds the volume.
func TestRecordedNodeIDs(t *testing.T) {
	tests := []struct {
		name, nodeID string
		want         nodeid.Node // zero: the record must not load
	}{
		{"key and zone", "n1@zone-a", nodeid.Node{Name: "n1", Zone: "zone-a"}},
		{"with address and limit", "n1@zone-a@10.0.0.1@64", nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.1", MaxVolumes: 64}},
		{"with an initiator", "n1@zone-a@@@iqn.2026-11.io.example:n1", nodeid.Node{Name: "n1", Zone: "zone-a", Initiator: "iqn.2026-11.io.example:n1"}},
		{"no zone", "n1", nodeid.Node{}},
		{"empty", "", nodeid.Node{}},
		{"limit not a number", "n1@zone-a@10.0.0.1@x", nodeid.Node{}},
		{"a path for a key", "../n1@zone-a", nodeid.Node{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, "zone-a")
			spec := mountSpec(t, "zone-a", "recorded", "", 16*mib)
			f.create(t, spec)
			f.attach(t, spec.ID, writer("n1"))
			meta, _ := f.ctrl.pools["zone-a"].metaPath(spec.ID)
			data, err := os.ReadFile(meta)
			if err != nil {
				t.Fatal(err)
			}
			recorded := []byte(`"nodeID": "n1@zone-a"`)
			if !bytes.Contains(data, recorded) {
				t.Fatalf("the record holds no %s:\n%s", recorded, data)
			}
			data = bytes.Replace(data, recorded, []byte(`"nodeID": "`+tt.nodeID+`"`), 1)
			if err := os.WriteFile(meta, data, 0o600); err != nil {
				t.Fatal(err)
			}
			restarted, err := NewController(f.pools)
			if tt.want == (nodeid.Node{}) {
				if err == nil || !strings.Contains(err.Error(), meta) || !strings.Contains(err.Error(), "node") {
					t.Fatalf("NewController with an attachment to %q: %v; want an error naming %s and the node id", tt.nodeID, err, meta)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			v, err := restarted.Volume(context.Background(), spec.ID)
			if err != nil {
				t.Fatal(err)
			}
			if len(v.Attachments) != 1 || v.Attachments[0].Node != tt.want {
				t.Fatalf("attachments %+v, want one to %+v", v.Attachments, tt.want)
			}
		})
	}
}

func writeAt(t *testing.T, path string, data []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, off); err != nil {
		t.Fatal(err)
	}
}

func readAt(t *testing.T, path string, n int, off int64) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, off); err != nil {
		t.Fatal(err)
	}
	return buf
}

package block

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"google.golang.org/grpc/codes"
)

// filesystemUUIDs reads the UUID of the ext4 filesystem in image from its
// primary superblock and from every backup dumpe2fs lists.
func filesystemUUIDs(t *testing.T, image string) []string {
	t.Helper()
	dump := func(args ...string) string {
		out, err := exec.Command("dumpe2fs", append(args, image)...).CombinedOutput()
		if err != nil {
			t.Fatalf("dumpe2fs %v %s: %v: %s", args, image, err, out)
		}
		return string(out)
	}
	uuidOf := func(out string) string {
		m := regexp.MustCompile(`Filesystem UUID:\s+(\S+)`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no UUID in dumpe2fs output: %s", out)
		}
		return m[1]
	}
	full := dump()
	blockSize := regexp.MustCompile(`Block size:\s+(\d+)`).FindStringSubmatch(full)
	uuids := []string{uuidOf(full)}
	for _, m := range regexp.MustCompile(`Backup superblock at (\d+)`).FindAllStringSubmatch(full, -1) {
		uuids = append(uuids, uuidOf(dump("-h", "-o", "superblock="+m[1], "-o", "blocksize="+blockSize[1])))
	}
	if len(uuids) < 2 {
		t.Fatalf("%s: no backup superblocks listed", image)
	}
	return uuids
}

// e2fsckClean runs a forced, read-only check: it fails on any checksum or
// structure the kernel would not accept.
func e2fsckClean(t *testing.T, image string) {
	t.Helper()
	if out, err := exec.Command("e2fsck", "-f", "-n", image).CombinedOutput(); err != nil {
		t.Fatalf("e2fsck -f -n %s: %v: %s", image, err, out)
	}
}

func TestEveryExt4VolumeHasItsOwnUUID(t *testing.T) {
	f := newFixture(t, "zone-a")
	seen := map[string]string{}
	template := f.ctrl.pools["zone-a"].templatePath(fsExt4, 64<<20)
	for _, name := range []string{"one", "two", "three"} {
		v := f.create(t, mountSpec(t, "zone-a", name, "ext4", 64<<20))
		id := volID(t, "zone-a", name)
		image := imageOf(t, f, id)
		e2fsckClean(t, image)
		uuids := filesystemUUIDs(t, image)
		for _, u := range uuids[1:] {
			if u != uuids[0] {
				t.Fatalf("volume %s: backup superblock has UUID %s, the primary %s", v.ID, u, uuids[0])
			}
		}
		if other, dup := seen[uuids[0]]; dup {
			t.Fatalf("volumes %s and %s share the filesystem UUID %s", other, name, uuids[0])
		}
		seen[uuids[0]] = name
	}
	if tu := filesystemUUIDs(t, template)[0]; seen[tu] != "" {
		t.Fatalf("volume %s has its template's UUID %s", seen[tu], tu)
	}
	// blkid, as mounts by UUID see them.
	out, err := exec.Command("blkid", "-p", "-s", "UUID", "-o", "value", imageOf(t, f, volID(t, "zone-a", "one"))).Output()
	if err != nil || seen[strings.TrimSpace(string(out))] != "one" {
		t.Fatalf("blkid reports UUID %q (%v) for volume one", out, err)
	}
}

func TestTemplateIsNeitherAVolumeNorALeftover(t *testing.T) {
	f := newFixture(t, "zone-a")
	f.create(t, mountSpec(t, "zone-a", "vol", "ext4", 64<<20))
	p := f.ctrl.pools["zone-a"]
	if entries, _ := os.ReadDir(p.templatesDir()); len(entries) != 1 {
		t.Fatalf("templates after one ext4 create: %v, want one", entries)
	}
	// Raw block volumes and xfs volumes use no template.
	raw := mountSpec(t, "zone-a", "raw", "", 64<<20)
	raw.AccessType = accessmode.Block
	f.create(t, raw)
	if entries, _ := os.ReadDir(p.templatesDir()); len(entries) != 1 {
		t.Fatalf("templates after a raw block create: %v, want one", entries)
	}
	vols, err := f.ctrl.ListVolumes(context.Background())
	if err != nil || len(vols) != 2 {
		t.Fatalf("ListVolumes = %d volumes (%v), want 2", len(vols), err)
	}
	if err := f.ctrl.DeleteVolume(context.Background(), volID(t, "zone-a", "vol")); err != nil {
		t.Fatal(err)
	}
	// A restart keeps the complete template for later creates and removes
	// what is not one.
	stray := filepath.Join(p.templatesDir(), "ext4-1234-v0.img")
	if err := os.WriteFile(stray, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	reopened := openFixture(t, f.root, f.pools)
	if entries, _ := os.ReadDir(p.templatesDir()); len(entries) != 1 || !exists(p.templatePath(fsExt4, 64<<20)) {
		t.Fatalf("templates after a restart: %v, want the one complete template", entries)
	}
	vols, err = reopened.ctrl.ListVolumes(context.Background())
	if err != nil || len(vols) != 1 || vols[0].ID != volID(t, "zone-a", "raw").String() {
		t.Fatalf("ListVolumes after a restart = %v (%v), want the raw block volume alone", vols, err)
	}
	if entries, _ := os.ReadDir(p.kindDir(volID(t, "zone-a", "raw").Kind)); len(entries) != 2 {
		t.Fatalf("volume directory after a restart: %v, want the raw block volume's image and record", entries)
	}
}

func TestATemplateRemovedBehindTheControllersBackIsMadeAgain(t *testing.T) {
	f := newFixture(t, "zone-a")
	f.create(t, mountSpec(t, "zone-a", "first", "ext4", 64<<20))
	template := f.ctrl.pools["zone-a"].templatePath(fsExt4, 64<<20)
	if err := os.Remove(template); err != nil {
		t.Fatal(err)
	}
	f.create(t, mountSpec(t, "zone-a", "second", "ext4", 64<<20))
	if !exists(template) {
		t.Fatal("the template was not made again")
	}
	e2fsckClean(t, imageOf(t, f, volID(t, "zone-a", "second")))
}

func TestUnusedTemplatesAreDropped(t *testing.T) {
	f := newFixture(t, "zone-a")
	p := f.ctrl.pools["zone-a"]
	for i := range maxTemplates + 2 {
		f.create(t, mountSpec(t, "zone-a", "size-"+string(rune('a'+i)), "ext4", int64(64+i)<<20))
	}
	if entries, _ := os.ReadDir(p.templatesDir()); len(entries) != maxTemplates {
		t.Fatalf("%d templates kept, want %d", len(entries), maxTemplates)
	}
	if exists(p.templatePath(fsExt4, 64<<20)) {
		t.Fatal("the least recently used template was kept")
	}
}

// A controller that dies after a volume's image got its filesystem from a
// template, before the image was published and recorded, leaves a
// temporary image (and maybe a template half made): the next start removes
// both, keeps the complete template, and no volume appears.
func TestCrashBetweenTemplateCopyAndRecordLeavesNoOrphan(t *testing.T) {
	f := newFixture(t, "zone-a")
	p := f.ctrl.pools["zone-a"]
	id := volID(t, "zone-a", "interrupted")
	final, err := p.imagePath(id)
	if err != nil {
		t.Fatal(err)
	}
	tmp, err := tempName(final)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.ctrl.templates.fillFromTemplate(context.Background(), p, fsExt4, 64<<20, tmp); err != nil {
		t.Fatal(err)
	}
	halfMade, err := tempName(p.templatePath(fsExt4, 128<<20))
	if err != nil {
		t.Fatal(err)
	}
	reopened := openFixture(t, f.root, f.pools)
	if entries, _ := os.ReadDir(p.kindDir(id.Kind)); len(entries) != 0 {
		t.Fatalf("volumes after a restart: %v, want nothing", entries)
	}
	if entries, _ := os.ReadDir(p.templatesDir()); len(entries) != 1 || !exists(p.templatePath(fsExt4, 64<<20)) {
		t.Fatalf("templates after a restart: %v, want the complete one alone", entries)
	}
	if exists(halfMade) || exists(tmp) {
		t.Fatal("a leftover survived the restart")
	}
	if vols, _ := reopened.ctrl.ListVolumes(context.Background()); len(vols) != 0 {
		t.Fatalf("volumes after a restart: %v, want none", vols)
	}
}

// An ext4 volume's first stage finds the filesystem the controller made:
// no mkfs at the stage. An xfs volume's first stage still formats.
func TestFirstStageFindsAnExt4VolumeFormatted(t *testing.T) {
	f := newFixture(t, "zone-a")
	for _, tt := range []struct {
		fsType  string
		formats int64
	}{{"ext4", 0}, {"xfs", 1}} {
		f.create(t, mountSpec(t, "zone-a", tt.fsType, tt.fsType, fsSize(tt.fsType)))
		id := volID(t, "zone-a", tt.fsType)
		f.attach(t, id, writer("n1"))
		before := stageFormats.Load()
		staged := f.stage(t, f.mountReq(id, "n1", tt.fsType, false))
		if got := stageFormats.Load() - before; got != tt.formats {
			t.Fatalf("%s: the first stage formatted %d times, want %d", tt.fsType, got, tt.formats)
		}
		if staged.FsType != tt.fsType {
			t.Fatalf("staged as %q, want %s", staged.FsType, tt.fsType)
		}
		writeFileSynced(t, filepath.Join(staged.StagingPath, "data"), "kept")
		f.unstage(t, staged)
		again := f.stage(t, f.mountReq(id, "n1", tt.fsType, false))
		if got := readFile(t, filepath.Join(again.StagingPath, "data")); got != "kept" {
			t.Fatalf("%s: after a second stage the file holds %q", tt.fsType, got)
		}
	}
}

// A read-only first stage mounts the filesystem an ext4 volume got at
// creation: nothing needs writing. An xfs volume has no filesystem until a
// read/write stage makes it, so its read-only first stage is refused.
func TestReadOnlyFirstStageNeedsTheFilesystemMadeAtCreate(t *testing.T) {
	f := newFixture(t, "zone-a")
	for _, tt := range []struct {
		fsType  string
		allowed bool
	}{{fsExt4, true}, {fsXFS, false}} {
		f.create(t, mountSpec(t, "zone-a", tt.fsType, tt.fsType, fsSize(tt.fsType)))
		id := volID(t, "zone-a", tt.fsType)
		f.attach(t, id, reader("n1"))
		req := f.mountReq(id, "n1", tt.fsType, true)
		if !tt.allowed {
			_, err := f.node.Stage(context.Background(), req)
			wantCode(t, err, codes.FailedPrecondition)
			continue
		}
		staged := f.stage(t, req)
		if got := mountedFsType(t, staged.StagingPath); got != tt.fsType || !staged.ReadOnly {
			t.Fatalf("the read-only first stage mounted %q (read-only %t), want %s read-only", got, staged.ReadOnly, tt.fsType)
		}
		f.unstage(t, staged)
	}
	assertNothingStagedUnder(t, f.root)
}

// Only a complete template of this version, in the templates directory,
// is one: not a template half made, of another format, or elsewhere.
func TestIsTemplateFile(t *testing.T) {
	f := newFixture(t, "zone-a")
	p := f.ctrl.pools["zone-a"]
	f.create(t, mountSpec(t, "zone-a", "vol", "ext4", 64<<20))
	made, err := filepath.Rel(p.dir, p.templatePath(fsExt4, 64<<20))
	if err != nil || !exists(filepath.Join(p.dir, made)) {
		t.Fatalf("no template at %s (%v)", made, err)
	}
	halfMade, err := tempName(p.templatePath(fsExt4, 128<<20))
	if err != nil {
		t.Fatal(err)
	}
	halfMade, _ = filepath.Rel(p.dir, halfMade)
	for _, tt := range []struct {
		relPath string
		want    bool
	}{
		{made, true},
		{"templates/ext4-33554432-v1.img", true},
		{halfMade, false},
		{"templates/ext4-1234-v0.img", false},
		{"templates/xfs-33554432-v1.img", false},
		{"templates/ext4-033554432-v1.img", false},
		{"templates/ext4-0-v1.img", false},
		{"templates/ext4-33554432-v1.img.json", false},
		{"templates/other", false},
		{"ext4-33554432-v1.img", false},
		{"volumes/ext4-33554432-v1.img", false},
		{"volumes/templates/ext4-33554432-v1.img", false},
	} {
		if got := IsTemplateFile(tt.relPath); got != tt.want {
			t.Errorf("IsTemplateFile(%q) = %t, want %t", tt.relPath, got, tt.want)
		}
	}
}

func TestExt4SuperblockCleanliness(t *testing.T) {
	sb := make(ext4Super, ext4SuperSize)
	put16 := func(off int, v uint16) { sb[off], sb[off+1] = byte(v), byte(v>>8) }
	put32 := func(off int, v uint32) {
		for i := range 4 {
			sb[off+i] = byte(v >> (8 * i))
		}
	}
	reset := func() {
		clear(sb)
		put16(sbMagic, ext4Magic)
		put32(sbFeatureIncompat, incompatExtents)
		put16(sbState, ext4StateValid)
		put16(sbMaxMntCount, 0xFFFF) // -1: no check by mount count
	}
	for _, tt := range []struct {
		name  string
		spoil func()
		clean bool
	}{
		{"cleanly unmounted", func() {}, true},
		{"mounted or crashed", func() { put16(sbState, 0) }, false},
		{"errors recorded", func() { put16(sbState, ext4StateValid|ext4StateErrors) }, false},
		{"journal to replay", func() { put32(sbFeatureIncompat, incompatExtents|incompatRecover) }, false},
		{"orphans to release", func() { put32(sbLastOrphan, 12) }, false},
		{"check by time", func() { put32(sbCheckInterval, 3600) }, false},
		{"check by mount count due", func() { put16(sbMaxMntCount, 20); put16(sbMntCount, 20) }, false},
		{"mount count below its maximum", func() { put16(sbMaxMntCount, 20); put16(sbMntCount, 3) }, true},
	} {
		reset()
		tt.spoil()
		if !sb.isExt4() || sb.clean() != tt.clean {
			t.Errorf("%s: isExt4 %v, clean %v, want clean %v", tt.name, sb.isExt4(), sb.clean(), tt.clean)
		}
	}
}

func TestMountDirectLeavesUnknownOptionsToMount8(t *testing.T) {
	// An option mount(8) must handle is never given to mount(2): nothing
	// is attempted (the device does not even exist).
	mounted, err := mountDirect("/dev/nonexistent", t.TempDir(), fsExt4, []string{"noatime", "_netdev"})
	if mounted || err != nil {
		t.Fatalf("mountDirect with a userspace option = %v, %v; want false, nil", mounted, err)
	}
}

func TestBackupSuperblockGroups(t *testing.T) {
	var got []int64
	for g := int64(0); g < 130; g++ {
		if hasBackupSuper(g) {
			got = append(got, g)
		}
	}
	want := []int64{0, 1, 3, 5, 7, 9, 25, 27, 49, 81, 125}
	if len(got) != len(want) {
		t.Fatalf("groups with backups %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("groups with backups %v, want %v", got, want)
		}
	}
}

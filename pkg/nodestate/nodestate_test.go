package nodestate

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

func testID(t *testing.T, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func openStore(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir(), testBoot)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const testBoot = "8f1b2c3d-0000-4000-8000-000000000001"

var since = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

func holder(target string, mode accessmode.Mode) accessmode.Holder {
	return accessmode.Holder{
		TargetPath:  target,
		Mode:        mode,
		Fingerprint: "fp-" + filepath.Base(target),
		Workload:    accessmode.Workload{Name: "pod-" + filepath.Base(target), Namespace: "ns", UID: "uid-1"},
		Since:       since,
	}
}

func staged(id volumeid.ID) *backend.Staged {
	return &backend.Staged{
		VolumeID: id.String(), StagingPath: "/var/lib/kubelet/staging/" + id.Key, AccessType: accessmode.Mount,
		FsType: "ext4", Device: "/dev/loop7", Fingerprint: "stage-fp", Since: since,
	}
}

func filePath(s *Store, id volumeid.ID) string {
	return filepath.Join(s.Dir(), id.FileName()+".json")
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestOpenCreatesPrivateDirectory(t *testing.T) {
	state := t.TempDir()
	s, err := Open(state, testBoot)
	if err != nil {
		t.Fatal(err)
	}
	if s.Dir() != filepath.Join(state, DirName) {
		t.Errorf("Dir() = %s, want %s", s.Dir(), filepath.Join(state, DirName))
	}
	fi, err := os.Stat(s.Dir())
	if err != nil {
		t.Fatal(err)
	}
	if !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Errorf("lock directory mode = %v, want a 0700 directory", fi.Mode())
	}
	// Opening again (a restart) keeps what is there.
	id := testID(t, "a")
	if err := s.Save(id, &Record{Staged: staged(id)}); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(state, testBoot)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s2.Load(id)
	if err != nil || rec.Staged == nil {
		t.Errorf("after reopening, Load = %+v, %v; want the saved stage", rec, err)
	}
}

func TestLoadMissingVolumeGivesEmptyRecord(t *testing.T) {
	s := openStore(t)
	id := testID(t, "never-saved")
	rec, err := s.Load(id)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if rec.VolumeID != id.String() {
		t.Errorf("VolumeID = %q, want %q", rec.VolumeID, id)
	}
	if !rec.Empty() || rec.Staged != nil || len(rec.Holders) != 0 {
		t.Errorf("record of an unknown volume = %+v, want empty", rec)
	}
	if names := dirNames(t, s.Dir()); len(names) != 0 {
		t.Errorf("Load created files: %v", names)
	}
}

func TestSaveLoadRoundTrip(t *testing.T) {
	s := openStore(t)
	id := testID(t, "round-trip")
	in := &Record{
		Staged: staged(id),
		Holders: []accessmode.Holder{
			holder("/var/lib/kubelet/pods/a/volumes/x/mount", accessmode.SingleNodeMultiWriter),
			holder("/var/lib/kubelet/pods/b/volumes/x/mount", accessmode.SingleNodeMultiWriter),
		},
	}
	in.Holders[1].ReadOnly = true
	if err := s.Save(id, in); err != nil {
		t.Fatalf("Save: %v", err)
	}
	if in.VolumeID != id.String() {
		t.Errorf("Save did not stamp the volume id: %q", in.VolumeID)
	}
	out, err := s.Load(id)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if !reflect.DeepEqual(out, in) {
		t.Errorf("Load after Save:\n got %+v\nwant %+v", out, in)
	}
	// The file is named for the id, inside the store, and nothing else is left.
	if names := dirNames(t, s.Dir()); !slices.Equal(names, []string{id.FileName() + ".json"}) {
		t.Errorf("files in the store = %v, want only %s.json", names, id.FileName())
	}

	// Saving again replaces the record rather than merging.
	in2 := &Record{Staged: staged(id)}
	if err := s.Save(id, in2); err != nil {
		t.Fatal(err)
	}
	out, err = s.Load(id)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Holders) != 0 || out.Staged == nil {
		t.Errorf("after replacing, Load = %+v, want the stage without holders", out)
	}
}

func TestSaveKeepsVolumesApart(t *testing.T) {
	s := openStore(t)
	a, b := testID(t, "a"), testID(t, "b")
	if err := s.Save(a, &Record{Holders: []accessmode.Holder{holder("/t/a", accessmode.SingleNodeSingleWriter)}}); err != nil {
		t.Fatal(err)
	}
	rb, err := s.Load(b)
	if err != nil {
		t.Fatal(err)
	}
	if !rb.Empty() {
		t.Errorf("volume b sees volume a's holders: %+v", rb)
	}
}

func TestSaveEmptyRecordRemovesFile(t *testing.T) {
	s := openStore(t)
	id := testID(t, "to-empty")
	if err := s.Save(id, &Record{Holders: []accessmode.Holder{holder("/t/x", accessmode.SingleNodeWriter)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filePath(s, id)); err != nil {
		t.Fatalf("lock file missing after Save: %v", err)
	}
	if err := s.Save(id, &Record{}); err != nil {
		t.Fatalf("Save of an empty record: %v", err)
	}
	if _, err := os.Stat(filePath(s, id)); !os.IsNotExist(err) {
		t.Errorf("lock file still there after saving an empty record (stat: %v)", err)
	}
	if names := dirNames(t, s.Dir()); len(names) != 0 {
		t.Errorf("files left in the store: %v", names)
	}
	// Removing what is not there is fine.
	if err := s.Save(id, &Record{}); err != nil {
		t.Errorf("second Save of an empty record: %v", err)
	}
	rec, err := s.Load(id)
	if err != nil || !rec.Empty() {
		t.Errorf("Load after removal = %+v, %v; want an empty record", rec, err)
	}
}

func TestLockFilesAreMode0600(t *testing.T) {
	// Even under a permissive umask the file must not be readable by others.
	old := unix.Umask(0)
	t.Cleanup(func() { unix.Umask(old) })
	s := openStore(t)
	id := testID(t, "perm")
	for i := 0; i < 2; i++ { // create, then replace
		rec := &Record{Staged: staged(id), Holders: []accessmode.Holder{holder("/t/p", accessmode.SingleNodeWriter)}}
		if err := s.Save(id, rec); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(filePath(s, id))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 || !fi.Mode().IsRegular() {
			t.Errorf("save %d: lock file mode = %v, want -rw-------", i, fi.Mode())
		}
	}
}

func TestLoadRejectsLockFileOfAnotherVolume(t *testing.T) {
	s := openStore(t)
	a, b := testID(t, "a"), testID(t, "b")
	// b's lock file claims to be a's.
	data, err := json.Marshal(&Record{VolumeID: a.String(), Holders: []accessmode.Holder{holder("/t/x", accessmode.SingleNodeWriter)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filePath(s, b), data, 0o600); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Load(b)
	if err == nil {
		t.Fatalf("Load of a lock file claiming another volume = %+v, want an error", rec)
	}
	if !strings.Contains(err.Error(), a.String()) || !strings.Contains(err.Error(), b.String()) {
		t.Errorf("error %q should name both volume ids", err)
	}
	// A lock file without any volume id is just as foreign.
	if err := os.WriteFile(filePath(s, b), []byte(`{"holders":[{"targetPath":"/t/x"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Load(b); err == nil {
		t.Errorf("Load of a lock file without a volume id = %+v, want an error", rec)
	}
}

func TestLoadRejectsCorruptLockFile(t *testing.T) {
	s := openStore(t)
	id := testID(t, "corrupt")
	if err := os.WriteFile(filePath(s, id), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Load(id); err == nil {
		t.Errorf("Load of a corrupt lock file = %+v, want an error (never an empty record: that would unlock the volume)", rec)
	}
}

func TestRecordHolderHelpers(t *testing.T) {
	id := testID(t, "helpers")
	base := &Record{VolumeID: id.String(), Staged: staged(id)}
	r1 := base.WithHolder(holder("/t/b", accessmode.SingleNodeMultiWriter))
	r2 := r1.WithHolder(holder("/t/a", accessmode.SingleNodeMultiWriter))
	if len(base.Holders) != 0 || len(r1.Holders) != 1 {
		t.Fatalf("WithHolder changed its receiver: base %d, r1 %d holders", len(base.Holders), len(r1.Holders))
	}
	var targets []string
	for _, h := range r2.Holders {
		targets = append(targets, h.TargetPath)
	}
	if !slices.Equal(targets, []string{"/t/a", "/t/b"}) {
		t.Errorf("holders = %v, want sorted [/t/a /t/b]", targets)
	}
	replaced := holder("/t/a", accessmode.SingleNodeMultiWriter)
	replaced.ReadOnly = true
	r3 := r2.WithHolder(replaced)
	if h, ok := r3.Holder("/t/a"); !ok || !h.ReadOnly || len(r3.Holders) != 2 {
		t.Errorf("WithHolder of an existing target should replace it: %+v", r3.Holders)
	}
	r4 := r3.WithoutHolder("/t/b")
	if _, ok := r4.Holder("/t/b"); ok || len(r4.Holders) != 1 || len(r3.Holders) != 2 {
		t.Errorf("WithoutHolder: got %+v (receiver now %+v)", r4.Holders, r3.Holders)
	}
	if r4.Staged != base.Staged || r4.VolumeID != base.VolumeID {
		t.Errorf("WithoutHolder lost the stage or the id")
	}
	if _, ok := r4.Holder("/t/none"); ok {
		t.Error("Holder found a target that was never added")
	}
	if r4.Empty() || (&Record{}).Empty() == false {
		t.Error("Empty is wrong")
	}
	if !(&Record{VolumeID: "x"}).Empty() {
		t.Error("a record with only an id should be empty")
	}
}

func TestDropUnmounted(t *testing.T) {
	id := testID(t, "drop")
	rec := &Record{VolumeID: id.String(), Staged: staged(id), Holders: []accessmode.Holder{
		holder("/t/gone", accessmode.SingleNodeMultiWriter),
		holder("/t/here", accessmode.SingleNodeMultiWriter),
	}}
	mounted := func(p string) (bool, error) { return p == "/t/here", nil }
	out, dropped, err := DropUnmounted(rec, mounted)
	if err != nil {
		t.Fatal(err)
	}
	if !dropped {
		t.Error("dropped = false, want true")
	}
	if len(out.Holders) != 1 || out.Holders[0].TargetPath != "/t/here" {
		t.Errorf("holders after drop = %+v, want only /t/here", out.Holders)
	}
	if out.Staged != rec.Staged || out.VolumeID != rec.VolumeID {
		t.Error("DropUnmounted lost the stage or the id")
	}
	if len(rec.Holders) != 2 {
		t.Error("DropUnmounted changed its argument")
	}
	out, dropped, _ = DropUnmounted(out, mounted)
	if dropped || len(out.Holders) != 1 {
		t.Errorf("second drop: dropped=%t holders=%+v, want nothing dropped", dropped, out.Holders)
	}
}

func TestReconcile(t *testing.T) {
	s := openStore(t)
	keep := testID(t, "keep")         // every holder mounted
	partial := testID(t, "partial")   // one of two holders mounted
	stagedOnly := testID(t, "staged") // holder gone, stage stays
	gone := testID(t, "gone")         // holder gone, no stage: file goes
	save := func(id volumeid.ID, rec *Record) {
		t.Helper()
		if err := s.Save(id, rec); err != nil {
			t.Fatal(err)
		}
	}
	save(keep, &Record{Staged: staged(keep), Holders: []accessmode.Holder{holder("/m/keep", accessmode.SingleNodeSingleWriter)}})
	save(partial, &Record{Staged: staged(partial), Holders: []accessmode.Holder{
		holder("/m/partial-1", accessmode.SingleNodeMultiWriter),
		holder("/u/partial-2", accessmode.SingleNodeMultiWriter),
	}})
	save(stagedOnly, &Record{Staged: staged(stagedOnly), Holders: []accessmode.Holder{holder("/u/staged", accessmode.SingleNodeSingleWriter)}})
	save(gone, &Record{Holders: []accessmode.Holder{holder("/u/gone", accessmode.SingleNodeSingleWriter)}})
	keepBefore, err := os.ReadFile(filePath(s, keep))
	if err != nil {
		t.Fatal(err)
	}

	var asked []string
	isMounted := func(p string) (bool, error) {
		asked = append(asked, p)
		return strings.HasPrefix(p, "/m/"), nil
	}
	if err := s.Reconcile(isMounted, nil); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	for _, p := range []string{"/m/keep", "/m/partial-1", "/u/partial-2", "/u/staged", "/u/gone"} {
		if !slices.Contains(asked, p) {
			t.Errorf("Reconcile never checked %s", p)
		}
	}

	if after, err := os.ReadFile(filePath(s, keep)); err != nil || string(after) != string(keepBefore) {
		t.Errorf("a record with every holder mounted was rewritten or lost (%v)", err)
	}
	rec, err := s.Load(partial)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Holders) != 1 || rec.Holders[0].TargetPath != "/m/partial-1" || rec.Staged == nil {
		t.Errorf("partial: %+v, want the stage and only /m/partial-1", rec)
	}
	rec, err = s.Load(stagedOnly)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Holders) != 0 || rec.Staged == nil {
		t.Errorf("staged: %+v, want the stage and no holder", rec)
	}
	if _, err := os.Stat(filePath(s, gone)); !os.IsNotExist(err) {
		t.Errorf("a record left empty by Reconcile should lose its file (stat: %v)", err)
	}
	rec, err = s.Load(keep)
	if err != nil || len(rec.Holders) != 1 {
		t.Errorf("keep: %+v, %v", rec, err)
	}
}

func TestReconcileRemovesTempLeftovers(t *testing.T) {
	s := openStore(t)
	id := testID(t, "kept")
	if err := s.Save(id, &Record{Staged: staged(id)}); err != nil {
		t.Fatal(err)
	}
	leftovers := []string{
		"." + id.FileName() + ".json.tmp-123456",
		".whatever.json.tmp-1",
	}
	for _, n := range leftovers {
		if err := os.WriteFile(filepath.Join(s.Dir(), n), []byte("{half"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Reconcile(func(string) (bool, error) { return true, nil }, nil); err != nil {
		t.Fatalf("Reconcile with temp leftovers: %v", err)
	}
	names := dirNames(t, s.Dir())
	if !slices.Equal(names, []string{id.FileName() + ".json"}) {
		t.Errorf("files after Reconcile = %v, want only %s.json", names, id.FileName())
	}
}

func TestRemoveLeftoversKeepsOtherFiles(t *testing.T) {
	s := openStore(t)
	keep := []string{"notes.txt", ".hidden", "x.tmp-1"} // not our temporaries: no leading dot, or no marker
	for _, n := range append([]string{".a.json.tmp-9"}, keep...) {
		if err := os.WriteFile(filepath.Join(s.Dir(), n), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	s.RemoveLeftovers()
	names := dirNames(t, s.Dir())
	slices.Sort(keep)
	if !slices.Equal(names, keep) {
		t.Errorf("after RemoveLeftovers: %v, want %v", names, keep)
	}
}

func TestReconcileIgnoresLockFileClaimingAnotherVolume(t *testing.T) {
	s := openStore(t)
	victim, impostor := testID(t, "victim"), testID(t, "impostor")
	// The victim's own, legitimate record: a mounted RWOP holder.
	real := &Record{Staged: staged(victim), Holders: []accessmode.Holder{holder("/m/victim", accessmode.SingleNodeSingleWriter)}}
	if err := s.Save(victim, real); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(filePath(s, victim))
	if err != nil {
		t.Fatal(err)
	}
	// The impostor's file claims to be the victim's and holds an unmounted holder.
	data, err := json.Marshal(&Record{VolumeID: victim.String(), Holders: []accessmode.Holder{holder("/u/other", accessmode.SingleNodeSingleWriter)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filePath(s, impostor), data, 0o600); err != nil {
		t.Fatal(err)
	}
	_ = s.Reconcile(func(p string) (bool, error) { return strings.HasPrefix(p, "/m/"), nil }, nil)

	after, err := os.ReadFile(filePath(s, victim))
	if err != nil {
		t.Fatalf("the victim's lock file is gone: %v", err)
	}
	if string(after) != string(before) {
		t.Errorf("Reconcile rewrote another volume's lock file from a file that only claimed to be it:\nbefore %s\nafter  %s", before, after)
	}
	rec, err := s.Load(victim)
	if err != nil || len(rec.Holders) != 1 || rec.Holders[0].TargetPath != "/m/victim" {
		t.Errorf("victim's record = %+v, %v; want its own mounted holder", rec, err)
	}
	if _, err := s.Load(impostor); err == nil {
		t.Error("the impostor's lock file loads without error")
	}
}

func TestRecordsCarryTheBootTheyWereWrittenIn(t *testing.T) {
	s := openStore(t)
	id := testID(t, "stamped")
	if err := s.Save(id, &Record{Staged: staged(id)}); err != nil {
		t.Fatal(err)
	}
	var onDisk Record
	data, err := os.ReadFile(filePath(s, id))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &onDisk); err != nil {
		t.Fatal(err)
	}
	if onDisk.BootID != testBoot {
		t.Errorf("record on disk has boot id %q, want %q", onDisk.BootID, testBoot)
	}
}

// A reboot: the same state directory opened under another boot id.
func TestRecordsOfAnEarlierBootAreForgottenNotReleased(t *testing.T) {
	state := t.TempDir()
	before, err := Open(state, "boot-before")
	if err != nil {
		t.Fatal(err)
	}
	held, pending, old := testID(t, "held"), testID(t, "pending"), testID(t, "old")
	rawHolder := holder("/t/raw", accessmode.SingleNodeWriter)
	rawHolder.Device = "/dev/loop9"
	for id, rec := range map[volumeid.ID]*Record{
		held:    {Staged: staged(held), Holders: []accessmode.Holder{holder("/t/held", accessmode.SingleNodeSingleWriter), rawHolder}},
		pending: {StagePending: "/staging/pending"},
		old:     {Staged: staged(old)},
	} {
		if err := before.Save(id, rec); err != nil {
			t.Fatal(err)
		}
	}
	after, err := Open(state, "boot-after")
	if err != nil {
		t.Fatal(err)
	}
	// Load never hands out a claim of the earlier boot, even before Reconcile.
	rec, err := after.Load(held)
	if err != nil || !rec.Empty() {
		t.Fatalf("Load of a record of an earlier boot = %+v, %v; want an empty record", rec, err)
	}
	var released []string
	var asked []string
	err = after.Reconcile(func(p string) (bool, error) {
		asked = append(asked, p)
		return true, nil // even a path mounted now is not the earlier boot's mount
	}, func(volumeID string, h accessmode.Holder) { released = append(released, h.Device) })
	if err != nil {
		t.Fatal(err)
	}
	if len(released) != 0 {
		t.Errorf("devices of an earlier boot were released: %v (their names may belong to other volumes now)", released)
	}
	if len(asked) != 0 {
		t.Errorf("the mounts of an earlier boot were checked (%v): nothing of them can be there", asked)
	}
	if names := dirNames(t, after.Dir()); len(names) != 0 {
		t.Errorf("records of an earlier boot left files: %v", names)
	}
}

func TestRecordsWithoutBootIDAreChecked(t *testing.T) {
	// Written before records carried a boot: trusted as far as the mount
	// table confirms, no further.
	s := openStore(t)
	id := testID(t, "legacy")
	data, err := json.Marshal(&Record{VolumeID: id.String(), Staged: staged(id),
		Holders: []accessmode.Holder{holder("/m/legacy", accessmode.SingleNodeWriter), holder("/u/legacy", accessmode.SingleNodeWriter)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filePath(s, id), data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(func(p string) (bool, error) { return strings.HasPrefix(p, "/m/"), nil }, nil); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Load(id)
	if err != nil || rec.Staged == nil || len(rec.Holders) != 1 || rec.Holders[0].TargetPath != "/m/legacy" {
		t.Errorf("legacy record after Reconcile = %+v, %v; want the stage and the mounted holder", rec, err)
	}
	if rec.BootID != testBoot {
		t.Errorf("the rewritten record has boot id %q, want %q", rec.BootID, testBoot)
	}
}

// Only "not mounted" lets a holder go: a mount check that fails keeps every
// holder, or a second workload would be let in on a guess.
func TestMountCheckErrorsKeepHolders_FakeMountCheck(t *testing.T) {
	id := testID(t, "unsure")
	rec := &Record{VolumeID: id.String(), Holders: []accessmode.Holder{
		holder("/t/unsure", accessmode.SingleNodeSingleWriter),
	}}
	failing := func(string) (bool, error) { return false, unix.EIO }
	out, dropped, err := DropUnmounted(rec, failing)
	if err == nil || dropped || len(out.Holders) != 1 {
		t.Errorf("DropUnmounted with a failing check = %+v, dropped=%t, err=%v; want the holder kept and an error", out.Holders, dropped, err)
	}
	s := openStore(t)
	if err := s.Save(id, rec); err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(failing, nil); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	if got, err := s.Load(id); err != nil || len(got.Holders) != 1 {
		t.Errorf("after Reconcile with a failing check: %+v, %v; want the holder kept", got, err)
	}
}

func TestOpenTakesOverTheLockFilesOfAnEarlierVersion(t *testing.T) {
	state := t.TempDir()
	legacy := filepath.Join(state, "holders")
	if err := os.MkdirAll(legacy, 0o700); err != nil {
		t.Fatal(err)
	}
	id := testID(t, "kept")
	data, _ := json.Marshal(&Record{VolumeID: id.String(), Holders: []accessmode.Holder{holder("/m/x", accessmode.SingleNodeWriter)}})
	if err := os.WriteFile(filepath.Join(legacy, id.FileName()+".json"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := Open(state, testBoot)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Load(id)
	if err != nil || len(rec.Holders) != 1 {
		t.Errorf("holder of the earlier version's lock file = %+v, %v", rec, err)
	}
	if _, err := os.Stat(legacy); !os.IsNotExist(err) {
		t.Errorf("the earlier version's directory is still there (stat: %v)", err)
	}
}

func TestCurrentBootID(t *testing.T) {
	id, err := CurrentBootID(BootIDFile)
	if err != nil || len(id) != 36 {
		t.Errorf("CurrentBootID(%s) = %q, %v; want a UUID", BootIDFile, id, err)
	}
	dir := t.TempDir()
	for _, tc := range []struct {
		content string
		ok      bool
	}{{"abc\n", true}, {"", false}, {"\n", false}, {"a/b\n", false}, {strings.Repeat("x", 65), false}} {
		f := filepath.Join(dir, "boot")
		if err := os.WriteFile(f, []byte(tc.content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := CurrentBootID(f); (err == nil) != tc.ok {
			t.Errorf("CurrentBootID(%q): err %v, want ok=%t", tc.content, err, tc.ok)
		}
	}
	if _, err := Open(t.TempDir(), ""); err == nil {
		t.Error("Open without a boot id succeeded")
	}
}

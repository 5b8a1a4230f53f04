package holders

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
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

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
	s, err := Open(state)
	if err != nil {
		t.Fatal(err)
	}
	if s.Dir() != filepath.Join(state, "holders") {
		t.Errorf("Dir() = %s, want %s", s.Dir(), filepath.Join(state, "holders"))
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
	s2, err := Open(state)
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
	mounted := func(p string) bool { return p == "/t/here" }
	out, dropped := DropUnmounted(rec, mounted)
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
	out, dropped = DropUnmounted(out, mounted)
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
	isMounted := func(p string) bool {
		asked = append(asked, p)
		return strings.HasPrefix(p, "/m/")
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
	if err := s.Reconcile(func(string) bool { return true }, nil); err != nil {
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
	_ = s.Reconcile(func(p string) bool { return strings.HasPrefix(p, "/m/") }, nil)

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

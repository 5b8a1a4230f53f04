package nfs_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// loggingStorage is dirStorage that writes down, in one log shared with a
// loggingGanesha, which objects were restored and ensured.
type loggingStorage struct {
	dirStorage
	log *[]string
}

func (l loggingStorage) Restore(_ context.Context, rels []string) error {
	for _, rel := range rels {
		*l.log = append(*l.log, "restore "+rel)
	}
	return nil
}

func (l loggingStorage) Ensure(_ context.Context, rel string) error {
	*l.log = append(*l.log, "ensure "+rel)
	return nil
}

// loggingGanesha serves what it was given, across controller restarts (a
// ganesha that outlived the controller), and logs each call.
type loggingGanesha struct {
	served map[uint16]string // export id -> export file path
	log    *[]string
}

func (g *loggingGanesha) ApplyExport(_ context.Context, confPath string, id uint16) error {
	g.served[id] = confPath
	*g.log = append(*g.log, "apply "+filepath.Base(confPath))
	return nil
}

func (g *loggingGanesha) RemoveExport(_ context.Context, id uint16) error {
	*g.log = append(*g.log, "remove "+filepath.Base(g.served[id]))
	delete(g.served, id)
	return nil
}

func (g *loggingGanesha) Exports(context.Context) ([]ganesha.ExportInfo, error) {
	var out []ganesha.ExportInfo
	for id, p := range g.served {
		out = append(out, ganesha.ExportInfo{ID: id, Path: p})
	}
	return out, nil
}

// A start serves only the volumes published to some node: only their
// storage is restored and only they are exported. Every other volume is
// made usable and exported at its first publish, storage before export,
// and the rest of its life works as before.
func TestStartServesOnlyPublishedVolumes(t *testing.T) {
	ctx := context.Background()
	root, exportDir := t.TempDir(), t.TempDir()
	var log []string
	storage := loggingStorage{dirStorage{root}, &log}
	g := &loggingGanesha{served: map[uint16]string{}, log: &log}
	start := func() *nfs.Controller {
		t.Helper()
		ctrl, err := nfs.NewController(ctx, nfs.Config{Storage: storage, ExportDir: exportDir, Server: "10.0.0.1"})
		if err != nil {
			t.Fatal(err)
		}
		if err := ctrl.Start(ctx, g); err != nil {
			t.Fatal(err)
		}
		return ctrl
	}
	ctrl := start()
	node := accessmode.Attachment{NodeID: nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.11"}.String(), Mode: accessmode.MultiNodeMultiWriter}
	ids := map[string]volumeid.ID{}
	for _, name := range []string{"held", "idle", "idle2"} {
		ids[name] = createMultiWriter(t, ctx, ctrl, name)
	}
	if _, err := ctrl.SetAttachments(ctx, ids["held"], []accessmode.Attachment{node}); err != nil {
		t.Fatal(err)
	}
	rel := func(name string) string { return "volumes/" + ids[name].FileName() }
	conf := func(name string) string { return ids[name].FileName() + ".conf" }

	log = nil
	ctrl = start()
	want := []string{"restore " + rel("held"), "remove " + conf("idle"), "remove " + conf("idle2"), "apply " + conf("held")}
	got := slices.Clone(log)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("a start did %q; want exactly %q (only the published volume restored and exported, the idle ones' stale exports removed)", got, want)
	}
	for name, wantFile := range map[string]bool{"held": true, "idle": false, "idle2": false} {
		if _, err := os.Stat(filepath.Join(exportDir, conf(name))); (err == nil) != wantFile {
			t.Errorf("after the start, the export file of %s: %v; want it there: %v", name, err, wantFile)
		}
	}

	// The first publish of an idle volume: storage first, then its export.
	log = nil
	if _, err := ctrl.SetAttachments(ctx, ids["idle"], []accessmode.Attachment{node}); err != nil {
		t.Fatal(err)
	}
	if want := []string{"ensure " + rel("idle"), "apply " + conf("idle")}; !slices.Equal(log, want) {
		t.Errorf("first publish of an idle volume did %q, want %q", log, want)
	}
	// Served from then on: the next change is an export update only.
	log = nil
	if _, err := ctrl.SetAttachments(ctx, ids["idle"], nil); err != nil {
		t.Fatal(err)
	}
	if want := []string{"apply " + conf("idle")}; !slices.Equal(log, want) {
		t.Errorf("unpublish of a served volume did %q, want %q", log, want)
	}

	// The other idle volume lives on without being served: expanded,
	// checked, snapshotted and deleted.
	if _, err := ctrl.ExpandVolume(ctx, ids["idle2"], 2<<20); err != nil {
		t.Errorf("expanding a volume not served since the start: %v", err)
	}
	if h, err := ctrl.VolumeHealth(ctx, ids["idle2"]); err != nil || h.Abnormal {
		t.Errorf("health of a volume not served since the start: %+v, %v; want healthy (no export file is expected)", h, err)
	}
	snap, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "s"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.CreateSnapshot(ctx, snap, "s", ids["idle2"]); err != nil {
		t.Errorf("snapshot of a volume not served since the start: %v", err)
	}
	if err := ctrl.DeleteVolume(ctx, ids["idle2"]); err != nil {
		t.Errorf("deleting a volume not served since the start: %v", err)
	}
	if _, err := ctrl.Volume(ctx, ids["idle2"]); err == nil {
		t.Error("the deleted volume is still there")
	}
	if len(g.served) != 2 {
		t.Errorf("ganesha serves %d exports, want 2 (held and idle): %s", len(g.served), fmt.Sprint(g.served))
	}
}

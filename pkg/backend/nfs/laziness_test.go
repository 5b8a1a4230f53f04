package nfs_test

import (
	"context"
	"errors"
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

func (l loggingStorage) Idle(_ context.Context, rel string) error {
	*l.log = append(*l.log, "idle "+rel)
	return nil
}

// loggingGanesha stands in for ganesha where none can run or none is
// needed: it serves what it was given, across controller restarts (a
// ganesha that outlived the controller), and logs each call.
type loggingGanesha struct {
	served map[uint16]string // export id -> export file path
	log    *[]string
}

func newLoggingGanesha(log *[]string) *loggingGanesha {
	return &loggingGanesha{served: map[uint16]string{}, log: log}
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

// Export is not needed of this stand-in: it only logs what is served.
func (g *loggingGanesha) Export(context.Context, uint16) (ganesha.ExportInfo, error) {
	return ganesha.ExportInfo{}, errors.New("loggingGanesha does not describe exports")
}

func (g *loggingGanesha) Exports(context.Context) ([]ganesha.ExportInfo, error) {
	var out []ganesha.ExportInfo
	for id, p := range g.served {
		out = append(out, ganesha.ExportInfo{ID: id, Path: p})
	}
	return out, nil
}

// Only volumes published to some node are exported and keep their storage
// in use; every other volume and every snapshot is idle. A start restores
// and exports the published ones only (and drops exports a ganesha that
// outlived the controller still serves for others); a first publish makes
// the storage usable before exporting it; the last unpublish withdraws the
// export before letting the storage go; work on an idle volume lets it go
// again afterwards.
func TestOnlyPublishedVolumesAreServed_LoggingGanesha(t *testing.T) {
	ctx := context.Background()
	root, exportDir := t.TempDir(), t.TempDir()
	var log []string
	storage := loggingStorage{dirStorage{root}, &log}
	g := newLoggingGanesha(&log)
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
	node := accessmode.Attachment{Node: nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.11"}, Mode: accessmode.MultiNodeMultiWriter}
	ids := map[string]volumeid.ID{}
	rel := func(name string) string { return "volumes/" + ids[name].FileName() }
	conf := func(name string) string { return ids[name].FileName() + ".conf" }
	expect := func(step string, want ...string) {
		t.Helper()
		got := slices.Clone(log)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s did %q; want exactly %q", step, got, want)
		}
		log = nil
	}

	for _, name := range []string{"held", "idle", "idle2"} {
		ids[name] = createMultiWriter(t, ctx, ctrl, name)
		expect("create "+name, "idle "+rel(name))
	}
	if _, err := ctrl.SetAttachments(ctx, ids["held"], []accessmode.Attachment{node}); err != nil {
		t.Fatal(err)
	}
	expect("first publish", "ensure "+rel("held"), "apply "+conf("held"))
	// ganesha outlives the controller still serving an export for idle2
	// (export ids are handed out lowest first: held 1, idle 2, idle2 3).
	g.served[3] = filepath.Join(exportDir, conf("idle2"))

	ctrl = start()
	expect("a start", "restore "+rel("held"), "apply "+conf("held"), "remove "+conf("idle2"))
	for name, wantFile := range map[string]bool{"held": true, "idle": false, "idle2": false} {
		if _, err := os.Stat(filepath.Join(exportDir, conf(name))); (err == nil) != wantFile {
			t.Errorf("after the start, the export file of %s: %v; want it there: %v", name, err, wantFile)
		}
	}

	if _, err := ctrl.SetAttachments(ctx, ids["idle"], []accessmode.Attachment{node}); err != nil {
		t.Fatal(err)
	}
	expect("first publish after the start", "ensure "+rel("idle"), "apply "+conf("idle"))
	if _, err := ctrl.SetAttachments(ctx, ids["idle"], []accessmode.Attachment{node, {Node: nodeid.Node{Name: "n2", Zone: "zone-a", Address: "10.0.0.12"}, Mode: accessmode.MultiNodeMultiWriter}}); err != nil {
		t.Fatal(err)
	}
	expect("a second node", "apply "+conf("idle"))
	if _, err := ctrl.SetAttachments(ctx, ids["idle"], nil); err != nil {
		t.Fatal(err)
	}
	expect("the last unpublish", "remove "+conf("idle"), "idle "+rel("idle"))
	if _, err := os.Stat(filepath.Join(exportDir, conf("idle"))); !os.IsNotExist(err) {
		t.Errorf("the export file of a volume no node holds: %v, want it removed", err)
	}

	// An idle volume lives on: expanded, checked, snapshotted, cloned and
	// deleted, let go after each.
	if _, err := ctrl.ExpandVolume(ctx, ids["idle2"], 2<<20); err != nil {
		t.Errorf("expanding an idle volume: %v", err)
	}
	expect("expand", "idle "+rel("idle2"))
	if h, err := ctrl.VolumeHealth(ctx, ids["idle2"]); err != nil || h.Abnormal {
		t.Errorf("health of an idle volume: %+v, %v; want healthy (no export file is expected)", h, err)
	}
	expect("health", "idle "+rel("idle2"))
	snap, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "s"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.CreateSnapshot(ctx, snap, "s", ids["idle2"]); err != nil {
		t.Errorf("snapshot of an idle volume: %v", err)
	}
	expect("snapshot", "idle "+rel("idle2"), "idle snapshots/"+snap.FileName())
	// A published volume's storage stays in use after a snapshot of it.
	snap2, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "s2"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.CreateSnapshot(ctx, snap2, "s2", ids["held"]); err != nil {
		t.Errorf("snapshot of a published volume: %v", err)
	}
	expect("snapshot of a published volume", "idle snapshots/"+snap2.FileName())
	if err := ctrl.DeleteVolume(ctx, ids["idle2"]); err != nil {
		t.Errorf("deleting an idle volume: %v", err)
	}
	if len(g.served) != 1 {
		t.Errorf("ganesha serves %d exports, want 1 (held): %s", len(g.served), fmt.Sprint(g.served))
	}
}

package nfs_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// lyingGanesha applies exports like recordingGanesha but reports every
// client as squashed: a server that did not take a change.
type lyingGanesha struct{ *recordingGanesha }

func (l lyingGanesha) Export(ctx context.Context, id uint16) (ganesha.ExportInfo, error) {
	info, err := l.recordingGanesha.Export(ctx, id)
	for i := range info.Clients {
		info.Clients[i].Squash = ganesha.RootSquash
	}
	return info, err
}

// TestModifyRootSquashChangesTheExportLive: rootSquash set by
// ControllerModifyVolume reaches the export of a volume a node holds at
// once, is checked against what ganesha reports, is kept across a
// restart, and is what the next export of an idle volume carries. A server
// that reports another squash fails the call and gets the old export back.
func TestModifyRootSquashChangesTheExportLive(t *testing.T) {
	ctx := context.Background()
	root, exportDir := t.TempDir(), t.TempDir()
	ctrl, g := startedController(t, ctx, dirStorage{root}, exportDir)
	id := createMultiWriter(t, ctx, ctrl, "squashed")
	node := nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.11"}
	squashes := func(step string, want ganesha.Squash) {
		t.Helper()
		info, err := g.Export(ctx, 1)
		if err != nil || len(info.Clients) != 1 {
			t.Fatalf("%s: export: %+v, %v", step, info, err)
		}
		if info.Clients[0].Squash != want {
			t.Fatalf("%s: ganesha was told %s, want %s", step, info.Clients[0].Squash, want)
		}
	}

	// Idle: recorded, exported with it at the first publish.
	vol, err := ctrl.ModifyVolume(ctx, id, map[string]string{backend.AttrRootSquash: "false"})
	if err != nil {
		t.Fatal(err)
	}
	if vol.RootSquash() {
		t.Fatal("the volume still squashes root after rootSquash=false")
	}
	if len(g.applied) != 0 {
		t.Fatalf("an idle volume was exported by a modify: %v", g.applied)
	}
	if _, err := ctrl.SetAttachments(ctx, id, []accessmode.Attachment{{Node: node, Mode: accessmode.MultiNodeMultiWriter}}); err != nil {
		t.Fatal(err)
	}
	squashes("first publish after the change", ganesha.NoRootSquash)

	// Held by a node: changed live.
	if _, err := ctrl.ModifyVolume(ctx, id, map[string]string{backend.AttrRootSquash: "true"}); err != nil {
		t.Fatal(err)
	}
	squashes("modified while published", ganesha.RootSquash)

	// A server that does not take the change: refused, old export back.
	liar := lyingGanesha{g}
	ctrl2, err := nfs.NewController(ctx, nfs.Config{Storage: dirStorage{root}, ExportDir: exportDir, Server: "10.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ctrl2.Start(ctx, liar); err != nil {
		t.Fatal(err)
	}
	_, err = ctrl2.ModifyVolume(ctx, id, map[string]string{backend.AttrRootSquash: "false"})
	if err == nil || !strings.Contains(status.Convert(err).Message(), "no_root_squash") {
		t.Fatalf("modify against a server reporting root_squash: %v, want an error naming what it was told", err)
	}
	squashes("after a refused change", ganesha.RootSquash)
	if v, err := ctrl2.Volume(ctx, id); err != nil || !v.RootSquash() {
		t.Fatalf("the record says rootSquash=%v after a refused change (%v)", !v.RootSquash(), err)
	}
	data, err := os.ReadFile(filepath.Join(exportDir, id.FileName()+".conf"))
	if err != nil || strings.Contains(string(data), "no_root_squash") {
		t.Fatalf("export file after a refused change: %v\n%s", err, data)
	}

	// A restart keeps the attribute.
	ctrl3, err := nfs.NewController(ctx, nfs.Config{Storage: dirStorage{root}, ExportDir: exportDir, Server: "10.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ctrl3.Start(ctx, g); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl3.ModifyVolume(ctx, id, map[string]string{backend.AttrRootSquash: "false"}); err != nil {
		t.Fatal(err)
	}
	ctrl4, err := nfs.NewController(ctx, nfs.Config{Storage: dirStorage{root}, ExportDir: exportDir, Server: "10.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ctrl4.Start(ctx, g); err != nil {
		t.Fatal(err)
	}
	if v, err := ctrl4.Volume(ctx, id); err != nil || v.RootSquash() || v.MutableParameters[backend.AttrRootSquash] != "false" {
		t.Fatalf("after a restart: %+v, %v; want rootSquash=false kept", v, err)
	}
	squashes("after a restart", ganesha.NoRootSquash)
}

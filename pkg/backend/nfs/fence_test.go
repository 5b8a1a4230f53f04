package nfs_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// TestWriterLeavingReleasesItsState: ganesha keeps a client's NFSv4 opens
// and locks through an UpdateExport that drops the client and frees them
// when the export goes. So when a volume's only permitted writer leaves
// (unpublished, perhaps force-detached) and other nodes stay, the export is
// removed and added again rather than updated; when anyone else leaves, or
// one of several writers, it is updated. What ganesha is told is checked
// here with a recording stand-in for its bus (TestKernelNFSFenceOfAMountedClient
// in test/vm/nfs checks the effect with kernel clients and a real ganesha).
func TestWriterLeavingReleasesItsState(t *testing.T) {
	node := func(name, addr string) accessmode.Attachment {
		return accessmode.Attachment{Node: nodeid.Node{Name: name, Zone: "zone-a", Address: addr}}
	}
	w, r1, r2 := node("w", "10.0.0.1"), node("r1", "10.0.0.2"), node("r2", "10.0.0.3")
	as := func(a accessmode.Attachment, m accessmode.Mode, ro bool) accessmode.Attachment {
		a.Mode, a.ReadOnly = m, ro
		return a
	}
	mnsw, rwx := accessmode.MultiNodeSingleWriter, accessmode.MultiNodeMultiWriter
	tests := []struct {
		name     string
		mode     accessmode.Mode
		from, to []accessmode.Attachment
		want     []string // the calls after the first export; %d is the export id
	}{
		{"MNSW writer leaves and readers stay", mnsw,
			[]accessmode.Attachment{as(w, mnsw, false), as(r1, mnsw, true), as(r2, mnsw, true)},
			[]accessmode.Attachment{as(r1, mnsw, true), as(r2, mnsw, true)},
			[]string{"remove %d", "apply %d"}},
		{"MNSW reader leaves", mnsw,
			[]accessmode.Attachment{as(w, mnsw, false), as(r1, mnsw, true)},
			[]accessmode.Attachment{as(w, mnsw, false)},
			[]string{"apply %d"}},
		{"one of two RWX writers leaves", rwx,
			[]accessmode.Attachment{as(w, rwx, false), as(r1, rwx, false)},
			[]accessmode.Attachment{as(r1, rwx, false)},
			[]string{"apply %d"}},
		{"the last node leaves", mnsw,
			[]accessmode.Attachment{as(w, mnsw, false)},
			nil,
			[]string{"remove %d"}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			ctrl, g := startedController(t, ctx, dirStorage{t.TempDir()}, t.TempDir())
			id := createWithMode(t, ctx, ctrl, "v"+strconv.Itoa(i), tt.mode)
			if _, err := ctrl.SetAttachments(ctx, id, tt.from); err != nil {
				t.Fatal(err)
			}
			exportID := exportIDOf(t, g)
			g.ops = nil
			if _, err := ctrl.SetAttachments(ctx, id, tt.to); err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, op := range tt.want {
				want = append(want, strings.ReplaceAll(op, "%d", strconv.Itoa(exportID)))
			}
			if !slices.Equal(g.ops, want) {
				t.Errorf("%s of %s: ganesha was told %q, want %q", tt.name, id, g.ops, want)
			}
		})
	}

	t.Run("ganesha refuses the removal", func(t *testing.T) {
		ctx := context.Background()
		ctrl, g := startedController(t, ctx, dirStorage{t.TempDir()}, t.TempDir())
		id := createWithMode(t, ctx, ctrl, "refused", mnsw)
		both := []accessmode.Attachment{as(w, mnsw, false), as(r1, mnsw, true)}
		if _, err := ctrl.SetAttachments(ctx, id, both); err != nil {
			t.Fatal(err)
		}
		g.ops, g.failRemove = nil, errors.New("bus gone")
		_, err := ctrl.SetAttachments(ctx, id, both[1:])
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "writer that left") {
			t.Fatalf("unpublishing the writer while ganesha refuses the removal: %v, want UNAVAILABLE saying why", err)
		}
		// The record keeps the writer, for the retry; ganesha is not told
		// to serve anything again, least of all to the writer.
		if len(g.ops) != 0 {
			t.Errorf("after the refused removal ganesha was told %q, want nothing", g.ops)
		}
		vol, err := ctrl.Volume(ctx, id)
		if err != nil || len(vol.Attachments) != 2 {
			t.Fatalf("after the refused removal the volume records %v (%v), want both nodes for the retry", vol, err)
		}
		g.failRemove = nil
		if _, err := ctrl.SetAttachments(ctx, id, both[1:]); err != nil {
			t.Fatalf("the retry: %v", err)
		}
		if n := exportIDOf(t, g); !slices.Equal(g.ops, []string{"remove " + strconv.Itoa(n), "apply " + strconv.Itoa(n)}) {
			t.Errorf("the retry told ganesha %q, want the export removed and added", g.ops)
		}
	})
}

// exportIDOf is the id of the only export the recording ganesha serves.
func exportIDOf(t *testing.T, g *recordingGanesha) int {
	t.Helper()
	if len(g.applied) != 1 {
		t.Fatalf("ganesha serves %d exports, want 1", len(g.applied))
	}
	for id := range g.applied {
		return int(id)
	}
	return 0
}

// createWithMode creates a 1 MiB volume named name with one access mode.
func createWithMode(t *testing.T, ctx context.Context, ctrl *nfs.Controller, name string, mode accessmode.Mode) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.CreateVolume(ctx, backend.VolumeSpec{ID: id, Name: name, CapacityBytes: 1 << 20,
		AccessType: accessmode.Mount, Modes: []accessmode.Mode{mode}}); err != nil {
		t.Fatal(err)
	}
	return id
}

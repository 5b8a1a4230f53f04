package nfs_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// dirStorage keeps each object as a plain directory, without size limits:
// enough for the controller's bookkeeping, which is all these tests look at.
type dirStorage struct{ root string }

func (d dirStorage) Root() string   { return d.root }
func (d dirStorage) MinSize() int64 { return 1 << 20 }
func (d dirStorage) Create(_ context.Context, rel string, _ uint32, _ int64) error {
	return os.MkdirAll(filepath.Join(d.root, rel), 0o755)
}
func (d dirStorage) Grow(context.Context, string, uint32, int64) error { return nil }
func (d dirStorage) Copy(ctx context.Context, _, dst string, p uint32, l int64) error {
	return d.Create(ctx, dst, p, l)
}
func (d dirStorage) Remove(_ context.Context, rel string, _ uint32) error {
	return os.RemoveAll(filepath.Join(d.root, rel))
}
func (d dirStorage) Usage(context.Context, string, uint32) (int64, int64, error) { return 0, 0, nil }
func (d dirStorage) Free() (int64, error)                                        { return 1 << 30, nil }
func (d dirStorage) Size() (int64, error)                                        { return 2 << 30, nil }
func (d dirStorage) Restore(context.Context, []string) error                     { return nil }
func (d dirStorage) Ensure(context.Context, string) error                        { return nil }
func (d dirStorage) Idle(context.Context, string) error                          { return nil }
func (d dirStorage) Prune(context.Context, map[string]bool) ([]string, error)    { return nil, nil }
func (d dirStorage) Release() error                                              { return nil }
func (d dirStorage) CopiesAtOnePoint() bool                                      { return true }

// walkingStorage copies as the quota storage does: file by file, not as of
// one instant; unlike it, it cannot copy while the server is held still
// (it is no PausedCopier).
type walkingStorage struct{ dirStorage }

func (walkingStorage) CopiesAtOnePoint() bool { return false }

// flakyGanesha fails the operations it is told to.
type flakyGanesha struct {
	failApply, failList bool
	removeErr           error
	served              []ganesha.ExportInfo
}

var errBusGone = errors.New("dbus: connection closed")

func (f *flakyGanesha) ApplyExport(context.Context, string, uint16) error {
	if f.failApply {
		return errBusGone
	}
	return nil
}
func (f *flakyGanesha) RemoveExport(context.Context, uint16) error { return f.removeErr }
func (f *flakyGanesha) Export(context.Context, uint16) (ganesha.ExportInfo, error) {
	return ganesha.ExportInfo{}, errBusGone
}
func (f *flakyGanesha) Exports(context.Context) ([]ganesha.ExportInfo, error) {
	if f.failList {
		return nil, errBusGone
	}
	return f.served, nil
}

// Every failure to tell ganesha something is counted by operation in
// modeguard_nfs_control_errors_total; "no such export" on removal is not a
// failure.
func TestControlErrorsAreCounted(t *testing.T) {
	ctx := context.Background()
	m := metrics.New("test", []string{"controller", "node"})
	exportDir := t.TempDir()
	storage := dirStorage{t.TempDir()}
	ctrl, err := nfs.NewController(ctx, nfs.Config{
		Storage: storage, ExportDir: exportDir, Server: "127.0.0.1",
		ControlFailed: m.NFSControlFailed,
		WhyRefused: func(path string) string {
			return "resolve_posix_filesystem(" + path + ") returned No such file or directory (2)"
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	m.SetSources(metrics.Sources{Controllers: map[accessmode.Backend]backend.Controller{accessmode.BackendNFS: ctrl}})
	count := func(op string) float64 {
		t.Helper()
		families, err := m.Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() != "modeguard_nfs_control_errors_total" {
				continue
			}
			for _, s := range f.GetMetric() {
				if l := s.GetLabel(); len(l) == 1 && l[0].GetValue() == op {
					return s.GetCounter().GetValue()
				}
			}
		}
		t.Fatalf("no modeguard_nfs_control_errors_total{operation=%q}", op)
		return 0
	}
	for _, op := range []string{nfs.OpApplyExport, nfs.OpRemoveExport, nfs.OpExports} {
		if c := count(op); c != 0 {
			t.Fatalf("%s errors = %v before any call", op, c)
		}
	}

	g := &flakyGanesha{failList: true}
	if err := ctrl.Start(ctx, g); err == nil {
		t.Fatal("Start succeeded although ganesha could not list its exports")
	}
	g = &flakyGanesha{served: []ganesha.ExportInfo{{ID: 77, Path: "/stale"}}, removeErr: errBusGone}
	if err := ctrl.Start(ctx, g); err == nil {
		t.Fatal("Start succeeded although a stale export could not be removed")
	}
	if count(nfs.OpExports) != 1 || count(nfs.OpRemoveExport) != 1 {
		t.Fatalf("after two failed starts: Exports %v, RemoveExport %v, want 1 and 1", count(nfs.OpExports), count(nfs.OpRemoveExport))
	}
	g = &flakyGanesha{}
	if err := ctrl.Start(ctx, g); err != nil {
		t.Fatal(err)
	}

	id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "v"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.CreateVolume(ctx, backend.VolumeSpec{
		ID: id, Name: "v", CapacityBytes: 1 << 20, AccessType: accessmode.Mount,
		Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter},
	}); err != nil {
		t.Fatal(err)
	}
	g.failApply = true
	node := accessmode.Attachment{Node: nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.11"}, Mode: accessmode.MultiNodeMultiWriter}
	_, err = ctrl.SetAttachments(ctx, id, []accessmode.Attachment{node})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a publish with ganesha refusing the export: %v, want UNAVAILABLE", err)
	}
	// The refusal names the volume, the path ganesha was to export, and
	// what ganesha's log says of it.
	path := filepath.Join(storage.Root(), "volumes", id.FileName())
	if msg := status.Convert(err).Message(); !strings.Contains(msg, id.String()) || !strings.Contains(msg, "from "+path+":") ||
		!strings.Contains(msg, "ganesha's log says: resolve_posix_filesystem("+path+")") {
		t.Errorf("the refusal %q does not name the volume, its path %s and ganesha's reason", msg, path)
	}
	if c := count(nfs.OpApplyExport); c != 1 {
		t.Errorf("ApplyExport errors = %v, want 1", c)
	}
	if v, err := ctrl.Volume(ctx, id); err != nil || len(v.Attachments) != 0 {
		t.Errorf("after the refused publish the volume records %+v (%v), want no attachment", v, err)
	}
	// A refused first export leaves no file a restarted ganesha would read.
	if _, err := os.Stat(filepath.Join(exportDir, id.FileName()+".conf")); !os.IsNotExist(err) {
		t.Errorf("the export file of a refused first export is there: %v", err)
	}
	g.failApply = false

	// Ganesha no longer knows the export: removal is done, not failed.
	g.removeErr = &ganesha.Error{Method: "RemoveExport", Name: "org.freedesktop.DBus.Error.InvalidArgs", Message: "Export id not found"}
	if err := ctrl.DeleteVolume(ctx, id); err != nil {
		t.Fatal(err)
	}
	if c := count(nfs.OpRemoveExport); c != 1 {
		t.Errorf("RemoveExport errors = %v after a not-found removal, want still 1", c)
	}
}

package block

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPublishAndRecordOrder: an image is in place, durably, before its
// metadata is, so that no crash leaves metadata naming a missing image; a
// failed publish leaves neither metadata nor temporary files, and metadata
// that cannot be written takes the published image with it.
func TestPublishAndRecordOrder(t *testing.T) {
	start := func(t *testing.T) *imageInProgress {
		dir := t.TempDir()
		m := &imageInProgress{tmp: filepath.Join(dir, ".vol.img"+tempMarker+"1"), final: filepath.Join(dir, "vol.img"),
			meta: filepath.Join(dir, "vol.json"), dir: dir}
		if err := os.WriteFile(m.tmp, []byte("image"), 0o600); err != nil {
			t.Fatal(err)
		}
		return m
	}
	exists := func(path string) bool {
		_, err := os.Stat(path)
		return err == nil
	}
	temporaries := func(t *testing.T, dir string) []string {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var left []string
		for _, e := range entries {
			if strings.Contains(e.Name(), tempMarker) {
				left = append(left, e.Name())
			}
		}
		return left
	}

	t.Run("published, then recorded", func(t *testing.T) {
		m := start(t)
		var imageFirst, metaFirst bool
		perr, rerr := m.publishAndRecord(map[string]string{"id": "vol"}, func() {
			imageFirst, metaFirst = exists(m.final), exists(m.meta)
		})
		if perr != nil || rerr != nil {
			t.Fatalf("publish %v, record %v", perr, rerr)
		}
		if !imageFirst || metaFirst {
			t.Errorf("when published ran: image in place %v (want true), metadata in place %v (want false)", imageFirst, metaFirst)
		}
		if b, err := os.ReadFile(m.meta); err != nil || !strings.Contains(string(b), `"id": "vol"`) {
			t.Errorf("metadata %q, %v", b, err)
		}
		if left := temporaries(t, m.dir); len(left) > 0 {
			t.Errorf("temporary files left: %v", left)
		}
	})
	t.Run("publish fails", func(t *testing.T) {
		m := start(t)
		if err := os.Remove(m.tmp); err != nil {
			t.Fatal(err)
		}
		called := false
		perr, _ := m.publishAndRecord(map[string]string{"id": "vol"}, func() { called = true })
		if !errors.Is(perr, os.ErrNotExist) {
			t.Errorf("publish of a missing image: %v", perr)
		}
		if called || exists(m.meta) {
			t.Errorf("after a failed publish: published ran %v, metadata written %v", called, exists(m.meta))
		}
		if left := temporaries(t, m.dir); len(left) > 0 {
			t.Errorf("temporary files left: %v", left)
		}
	})
	t.Run("record fails", func(t *testing.T) {
		m := start(t)
		// A directory where the metadata goes: the rename over it fails.
		if err := os.Mkdir(m.meta, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(m.meta, "x"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		perr, rerr := m.publishAndRecord(map[string]string{"id": "vol"}, func() {})
		if perr != nil || rerr == nil {
			t.Fatalf("publish %v, record %v: want the record to fail", perr, rerr)
		}
		if exists(m.final) {
			t.Error("the image stayed without its metadata")
		}
		if left := temporaries(t, m.dir); len(left) > 0 {
			t.Errorf("temporary files left: %v", left)
		}
	})
}

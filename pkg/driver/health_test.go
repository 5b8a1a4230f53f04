package driver_test

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// imageOfVolume is a block volume's image in the env's pool.
func (e *env) imageOfVolume(t *testing.T, volID string) string {
	t.Helper()
	id, err := volumeid.Parse(volID)
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(e.pool, "volumes", id.FileName()+".img")
}

// TestVolumeHealthConditions: a volume whose image is gone is DATA_LOSS, a
// volume its pool cannot hold any more is DEGRADED, and
// ControllerListVolumeHealth lists those and not the healthy ones, page by
// page.
func TestVolumeHealthConditions(t *testing.T) {
	e := newEnv(t, 0)
	c := blockCap(accessmode.SingleNodeWriter)
	var ids []string
	for _, name := range []string{"healthy-1", "lost", "healthy-2", "also-lost"} {
		ids = append(ids, e.createVolume(t, name, c))
	}
	healthy1, lost, healthy2, alsoLost := ids[0], ids[1], ids[2], ids[3]
	for _, id := range []string{lost, alsoLost} {
		img := e.imageOfVolume(t, id)
		if err := os.Rename(img, img+".aside"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.Rename(img+".aside", img) }) // so that DeleteVolume finds it
	}
	statusOf := func(id string) []csi.VolumeHealthErrorType {
		t.Helper()
		r, err := e.ctrl.ControllerGetVolumeHealth(ctx(t), &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
		if err != nil {
			t.Fatal(err)
		}
		var out []csi.VolumeHealthErrorType
		for _, s := range r.GetVolumeHealth().GetHealthStatuses() {
			out = append(out, s.GetStatus())
		}
		return out
	}
	if got := statusOf(lost); !slices.Equal(got, []csi.VolumeHealthErrorType{csi.VolumeHealthErrorType_DATA_LOSS}) {
		t.Fatalf("a volume without its image: %v, want DATA_LOSS", got)
	}
	if got := statusOf(healthy1); len(got) != 0 {
		t.Fatalf("a healthy volume: %v", got)
	}

	// Paged one by one, the list walks the two unwell volumes and only them.
	var listed []string
	token := ""
	for range 10 {
		r, err := e.ctrl.ControllerListVolumeHealth(ctx(t), &csi.ControllerListVolumeHealthRequest{MaxEntries: 1, StartingToken: token})
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range r.GetEntries() {
			listed = append(listed, h.GetVolumeId())
		}
		if token = r.GetNextToken(); token == "" {
			break
		}
	}
	want := []string{lost, alsoLost}
	slices.Sort(want)
	if !slices.Equal(listed, want) {
		t.Fatalf("ControllerListVolumeHealth listed %v, want the unwell %v (not %s, %s)", listed, want, healthy1, healthy2)
	}

	// Fill the pool's filesystem: a sparse volume may then no longer write
	// what its capacity promises.
	filler := filepath.Join(e.root, "filler")
	f, err := os.Create(filler)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filler) })
	chunk := make([]byte, 1<<20)
	for {
		if _, err := f.Write(chunk); err != nil {
			break // ENOSPC: the tmpfs is full
		}
	}
	f.Close()
	if got := statusOf(healthy2); !slices.Equal(got, []csi.VolumeHealthErrorType{csi.VolumeHealthErrorType_DEGRADED}) {
		t.Fatalf("a volume its full pool cannot hold: %v, want DEGRADED", got)
	}
}

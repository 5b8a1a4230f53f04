package nfs

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestChooseStorage(t *testing.T) {
	tests := []struct {
		asked, recorded string
		quota           bool
		want            string
		errPart         string
	}{
		{"auto", "", true, "quota", ""},
		{"auto", "", false, "images", ""},
		{"", "", false, "images", ""},
		{"images", "", true, "images", ""},
		{"quota", "", false, "", "no xfs quota support"},
		{"auto", "images", true, "images", ""}, // quota support came later: the volumes are still images
		{"auto", "quota", true, "quota", ""},
		{"auto", "quota", false, "", "no xfs quota support"}, // never silently images
		{"quota", "images", true, "", "holds images storage"},
		{"images", "quota", true, "", "holds quota storage"},
		{"images", "images", false, "images", ""},
		{"disks", "", true, "", "not one of auto, quota, images"},
		{"auto", "tape", true, "", "does not know"},
	}
	for _, tt := range tests {
		got, err := chooseStorage(tt.asked, tt.recorded, tt.quota)
		switch {
		case tt.errPart != "" && (err == nil || !strings.Contains(err.Error(), tt.errPart)):
			t.Errorf("chooseStorage(%q, %q, %t) = %q, %v; want an error saying %q", tt.asked, tt.recorded, tt.quota, got, err, tt.errPart)
		case tt.errPart == "" && (err != nil || got != tt.want):
			t.Errorf("chooseStorage(%q, %q, %t) = %q, %v; want %q", tt.asked, tt.recorded, tt.quota, got, err, tt.want)
		}
	}
}

// TestStorageChoiceIsRecorded: the first start records its storage in the
// export root; a later start that asks for the other one explicitly is
// refused before it touches anything, and auto follows the record.
func TestStorageChoiceIsRecorded(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the image storage mounts")
	}
	ctx := context.Background()
	root := t.TempDir()
	s, err := openStorage(ctx, Options{Storage: "images", ExportRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(); err != nil {
		t.Fatal(err)
	}
	if rec, err := recordedStorage(root); err != nil || rec != "images" {
		t.Fatalf("recorded storage %q, %v; want images", rec, err)
	}
	if _, err := os.Stat(filepath.Join(root, storageRecordName)); err != nil {
		t.Fatalf("no record of the choice: %v", err)
	}
	if _, err := openStorage(ctx, Options{Storage: "quota", ExportRoot: root}); err == nil || !strings.Contains(err.Error(), "holds images storage") {
		t.Fatalf("a start asking for quota storage on an images root: %v, want a refusal naming the record", err)
	}
	s, err = openStorage(ctx, Options{Storage: "auto", ExportRoot: root})
	if err != nil {
		t.Fatalf("auto on a root that records images: %v", err)
	}
	if err := s.Release(); err != nil {
		t.Fatal(err)
	}
	// A root made before the record was kept is recognised by its layout.
	if err := os.Remove(filepath.Join(root, storageRecordName)); err != nil {
		t.Fatal(err)
	}
	if rec, err := recordedStorage(root); err != nil || rec != "images" {
		t.Fatalf("storage of an unrecorded images root: %q, %v", rec, err)
	}
}

// TestSetupRefusesAPauseBudgetPastTheLease: a client that hears nothing
// for a lease may take the server for restarted, so a budget that long is
// refused before anything is prepared or started.
func TestSetupRefusesAPauseBudgetPastTheLease(t *testing.T) {
	root := t.TempDir()
	for _, budget := range []time.Duration{-time.Second, 20 * time.Second, time.Minute} {
		_, _, err := Setup(context.Background(), Options{ExportRoot: root, Server: "10.0.0.1", PauseBudget: budget})
		if err == nil || !strings.Contains(err.Error(), "--nfs-pause-budget") || !strings.Contains(err.Error(), "lease") {
			t.Errorf("Setup with a pause budget of %v: %v, want it refused naming the flag and the lease", budget, err)
		}
	}
	if entries, err := os.ReadDir(root); err != nil || len(entries) != 0 {
		t.Errorf("the refused Setups left %v (%v) in the export root", entries, err)
	}
}

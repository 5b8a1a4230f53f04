package imagestore

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// --- tests that need nothing special ---

var hostileRels = []string{"../x", "/abs", "a/../../b", "", ".", "..", "a/.", "a//b", "a/", "a b/c", "a/b\x00", "a/b/../c"}

func TestCheckRel(t *testing.T) {
	for _, rel := range append(hostileRels,
		"volumes",          // one element
		"volumes/a/b",      // three
		"vol_umes/a",       // underscore in the group: ambiguous image name
		"images/a",         // the images directory
		"volumes/a b",      // space
		"volumes/ä",        // not ASCII
		"volumes/a*",       // glob
		"volumes/a\nb.img", // newline
	) {
		if err := checkRel(rel); err == nil {
			t.Errorf("checkRel(%q) accepted it", rel)
		}
	}
	for _, rel := range []string{"volumes/nfs__vol-0123abcd", "snapshots/nfs__snap-ff", "v/_a_", "v/a.img", "v/.x", "v.x/y", "v:1/__", "v-2/a__b__c"} {
		if err := checkRel(rel); err != nil {
			t.Errorf("checkRel(%q): %v", rel, err)
		}
	}
}

func TestImageNames(t *testing.T) {
	if got := imageName("volumes/nfs__vol-1"); got != "volumes__nfs__vol-1.img" {
		t.Errorf("imageName = %q", got)
	}
	if got := imageName("snapshots/nfs__snap-2"); got != "snapshots__nfs__snap-2.img" {
		t.Errorf("imageName = %q", got)
	}
	// Every valid rel comes back from its image name, and distinct rels
	// have distinct names.
	rels := []string{"volumes/nfs__vol-1", "v/_a_", "v/a.img", "v/.x", "v.x/y", "v:1/__", "v-2/a__b__c", "v/__b", "v/b__", "v/a_", "v-2/a"}
	seen := map[string]string{}
	for _, rel := range rels {
		name := imageName(rel)
		if other, dup := seen[name]; dup {
			t.Errorf("%q and %q share the image name %q", rel, other, name)
		}
		seen[name] = rel
		back, ok := relOfImage(name)
		if !ok || back != rel {
			t.Errorf("relOfImage(%q) = %q, %v; want %q", name, back, ok, rel)
		}
		if isTempName(name) {
			t.Errorf("image name %q taken for a temporary file", name)
		}
		tmp := strings.Replace(tempPattern(rel), "*", "123456", 1)
		if !isTempName(tmp) {
			t.Errorf("temporary name %q not recognized", tmp)
		}
		if _, ok := relOfImage(tmp); ok {
			t.Errorf("temporary name %q taken for an image", tmp)
		}
	}
	// Names no rel has: Prune must leave them alone.
	for _, name := range []string{"volumes.img", "vol_umes__a.img", "images__a.img", "volumes__a", "volumes__.img", "__a.img", "volumes__a b.img", "notes.txt", ".volumes__a.img.tmp-"} {
		if rel, ok := relOfImage(name); ok {
			t.Errorf("relOfImage(%q) = %q", name, rel)
		}
	}
	for _, name := range []string{"notes.txt", "volumes__a.img", "a.tmp-1", ".a.img"} {
		if isTempName(name) {
			t.Errorf("isTempName(%q)", name)
		}
	}
}

// Every method that takes a rel refuses a bad one before touching
// anything, so this needs no real store.
func TestMethodsRefuseBadRels(t *testing.T) {
	root := t.TempDir()
	s := &Store{root: root, images: filepath.Join(root, ImagesDirName)}
	if err := os.Mkdir(s.images, imagesDirMode); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, rel := range append(hostileRels, "volumes", "a/b/c", "images/x", "a_b/c") {
		if err := s.Create(ctx, rel, XFS.MinSize()); err == nil {
			t.Errorf("Create(%q) accepted it", rel)
		}
		if err := s.Grow(ctx, rel, XFS.MinSize()); err == nil {
			t.Errorf("Grow(%q) accepted it", rel)
		}
		if err := s.Copy(ctx, rel, "volumes/ok", XFS.MinSize()); err == nil {
			t.Errorf("Copy(src %q) accepted it", rel)
		}
		if err := s.Copy(ctx, "volumes/ok", rel, XFS.MinSize()); err == nil {
			t.Errorf("Copy(dst %q) accepted it", rel)
		}
		if err := s.Remove(ctx, rel); err == nil {
			t.Errorf("Remove(%q) accepted it", rel)
		}
		if err := s.Restore(ctx, rel); err == nil {
			t.Errorf("Restore(%q) accepted it", rel)
		}
		if _, _, err := s.Usage(ctx, rel); err == nil {
			t.Errorf("Usage(%q) accepted it", rel)
		}
	}
	for _, limit := range []int64{-1, 0, 1 << 20, XFS.MinSize() - 1} {
		err := s.Create(ctx, "volumes/small", limit)
		if err == nil || !strings.Contains(err.Error(), "minimum") {
			t.Errorf("Create with %d bytes: %v", limit, err)
		}
	}
	if err := s.Copy(ctx, "volumes/a", "volumes/a", XFS.MinSize()); err == nil {
		t.Error("Copy onto itself accepted")
	}
	entries, err := os.ReadDir(root)
	if err != nil || len(entries) != 1 {
		t.Errorf("refused calls left something behind: %v %v", entries, err)
	}
	if entries, _ := os.ReadDir(s.images); len(entries) != 0 {
		t.Errorf("refused calls left files in the images directory: %v", entries)
	}
}

func TestFreezeIoctlNumbers(t *testing.T) {
	// <linux/fs.h> on x86_64 and arm64.
	if fiFreeze != 0xc0045877 || fiThaw != 0xc0045878 {
		t.Errorf("FIFREEZE %#x, FITHAW %#x", fiFreeze, fiThaw)
	}
}

package fsutil

import (
	"path/filepath"
	"strings"
	"testing"
)

// FuzzJoinWithin: when JoinWithin accepts a name, the result sits directly
// in base (its parent is base, cleaned) and its last element is the name
// itself, untouched by cleaning.
func FuzzJoinWithin(f *testing.F) {
	for _, s := range []struct{ base, name string }{
		{"/var/lib/modeguard", "state.json"},
		{"/var/lib/modeguard", ".."},
		{"/var/lib/modeguard", "../etc"},
		{"/", "x"},
		{"", "x"},
		{"rel/../dir", "..."},
	} {
		f.Add(s.base, s.name)
	}
	f.Fuzz(func(t *testing.T, base, name string) {
		got, err := JoinWithin(base, name)
		if err != nil {
			if got != "" {
				t.Fatalf("JoinWithin(%q, %q) = %q with error %v", base, name, got, err)
			}
			return
		}
		if dir := filepath.Dir(got); dir != filepath.Clean(base) {
			t.Fatalf("JoinWithin(%q, %q) = %q, whose parent is %q, not %q", base, name, got, dir, filepath.Clean(base))
		}
		if filepath.Base(got) != name {
			t.Fatalf("JoinWithin(%q, %q) = %q, whose last element is %q", base, name, got, filepath.Base(got))
		}
		if name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
			t.Fatalf("JoinWithin accepted the name %q", name)
		}
	})
}

// FuzzCheckCOPath: what CheckCOPath accepts is absolute, not the root,
// free of NUL, and already what filepath.Clean would make of it, so
// filepath.Dir and filepath.Base of it name its parent and last element.
func FuzzCheckCOPath(f *testing.F) {
	for _, s := range []string{
		"/var/lib/kubelet/pods/x/volumes/mount",
		"/a/../b",
		"/a//b",
		"/a/b/",
		"//",
		"/",
		"relative",
		"/a\x00b",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if err := CheckCOPath("target_path", p); err != nil {
			if !strings.Contains(err.Error(), "target_path") {
				t.Fatalf("CheckCOPath(%q) error %q does not name the field", p, err)
			}
			return
		}
		if !filepath.IsAbs(p) {
			t.Fatalf("CheckCOPath accepted relative %q", p)
		}
		if filepath.Clean(p) != p {
			t.Fatalf("CheckCOPath accepted %q, which cleans to %q", p, filepath.Clean(p))
		}
		if p == "/" || strings.ContainsRune(p, 0) {
			t.Fatalf("CheckCOPath accepted %q", p)
		}
		if filepath.Join(filepath.Dir(p), filepath.Base(p)) != p || filepath.Dir(p) == p {
			t.Fatalf("CheckCOPath accepted %q, which does not split into parent and last element", p)
		}
	})
}

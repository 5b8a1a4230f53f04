package backend

import (
	"strings"
	"testing"

	"github.com/modeguard/modeguard/test/testfiles"
)

func TestCheckMountFlags(t *testing.T) {
	tests := []struct {
		name  string
		flags []string
		ok    bool
	}{
		{"plain flags", []string{"noatime", "discard"}, true},
		{"SELinux context as the kubelet passes it", []string{`context="system_u:object_r:container_file_t:s0:c12,c345"`}, true},
		{"the other SELinux context options", []string{`fscontext="system_u:object_r:x_t:s0"`, `defcontext="a:b:c:s0"`, `rootcontext="a:b:c:s0-s0:c0.c1023"`}, true},
		{"a quote elsewhere", []string{`x-a="b`}, false},
		{"a context left open", []string{`context="system_u:object_r:x_t:s0,ro`}, false},
		{"two quoted values", []string{`context="a:b:c:s0","rw"`}, false},
		{"a quote inside the label", []string{`context="a:b"c:s0"`}, false},
		{"another option quoted", []string{`uid="0"`}, false},
		{"a context with a space", []string{`context="a b"`}, false},
		{"an empty context", []string{`context=""`}, false},
		{"a control character", []string{"noatime\n"}, false},
		{"a context after a plain flag stays checked", []string{"noatime", `context="a:b:c:s0"x`}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := CheckMountFlags(tt.flags); (err == nil) != tt.ok {
				t.Fatalf("CheckMountFlags(%q) = %v, want ok=%t", tt.flags, err, tt.ok)
			}
		})
	}
}

// FuzzCheckMountFlags: whatever a flag the check lets through holds (a
// comma makes it several options, as the CO meant), an option after it
// stays an option of its own: an accepted quote never swallows what the
// backend appends.
func FuzzCheckMountFlags(f *testing.F) {
	f.Add(`context="system_u:object_r:container_file_t:s0:c1,c2"`)
	f.Add(`fscontext="a:b:c:s0"`)
	f.Add(`context="a:b:c:s0`)
	f.Add(`noatime`)
	f.Add(`x="y",z`)
	f.Fuzz(func(t *testing.T, flag string) {
		if CheckMountFlags([]string{flag}) != nil {
			return
		}
		opts, ok := testfiles.MountSplit(flag + ",ro")
		if !ok || len(opts) < 2 || opts[len(opts)-1] != "ro" || strings.Join(opts[:len(opts)-1], ",") != flag {
			t.Fatalf("accepted flag %q: mount(8) reads %q,ro as %q (balanced: %t)", flag, flag, opts, ok)
		}
	})
}

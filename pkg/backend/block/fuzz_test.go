package block

import (
	"slices"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/test/testfiles"
)

// FuzzMountOptions: for mount flags the driver lets through
// (backend.CheckMountFlags), the options keep the CO's flags unchanged and
// first, and mount(8) reads the driver's own options after them as separate
// options: on a read-only stage "ro" is the last word on ro/rw, whatever
// the flags say, and the journal is left alone only where a writer may
// hold the volume (fs's top bit says none may).
func FuzzMountOptions(f *testing.F) {
	f.Add(uint8(0), false, uint8(1), "noatime", "", "")
	f.Add(uint8(1), true, uint8(2), `context="system_u:object_r:container_file_t:s0:c1,c2"`, "rw", "")
	f.Add(uint8(0), true, uint8(1), "rw", "", "")
	f.Add(uint8(1), true, uint8(2), "noatime,rw", "discard", "")
	f.Add(uint8(1), false, uint8(0), "", "", "")
	f.Add(uint8(0), true, uint8(3), "rw", "x-a=\"b", "c\"")
	f.Add(uint8(2), true, uint8(1), "errors=remount-ro", "", "")
	f.Fuzz(func(t *testing.T, fs uint8, readOnly bool, n uint8, f1, f2, f3 string) {
		writable := fs&0x80 == 0
		fsType := []string{fsExt4, fsXFS, ""}[fs%3]
		flags := []string{f1, f2, f3}[:n%4]
		if backend.CheckMountFlags(flags) != nil {
			return
		}
		opts := mountOptions(fsType, readOnly, writable, flags)
		if !slices.Equal(opts[:len(flags)], flags) {
			t.Fatalf("mountOptions(%q, %t, %q) = %q: the CO's flags are not first and unchanged", fsType, readOnly, flags, opts)
		}
		var own []string
		if fsType == fsXFS {
			own = append(own, "nouuid")
		}
		if readOnly {
			own = append(own, "ro")
		}
		if readOnly && writable {
			switch fsType {
			case fsExt4:
				own = append(own, "noload")
			case fsXFS:
				own = append(own, "norecovery")
			}
		}
		if !slices.Equal(opts[len(flags):], own) {
			t.Fatalf("mountOptions(%q, %t, %q) = %q: the driver's options are not %q", fsType, readOnly, flags, opts, own)
		}
		optstr := strings.Join(opts, ",")
		seen, ok := testfiles.MountSplit(optstr)
		if !ok || !slices.Equal(seen[len(seen)-len(own):], own) {
			t.Fatalf("mountOptions(%q, %t, %q) = %q, which mount(8) reads as %q", fsType, readOnly, flags, opts, seen)
		}
		last := ""
		for _, o := range seen {
			if o == "ro" || o == "rw" {
				last = o
			}
		}
		if readOnly && last != "ro" {
			t.Fatalf("read-only mount options %q end with %q", optstr, last)
		}
	})
}

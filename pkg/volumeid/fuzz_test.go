package volumeid

import (
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// FuzzParse: whatever Parse accepts renders back to exactly the same string,
// parses again to the same ID, and names a file that is one safe path
// element. Whatever it refuses yields the zero ID.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"block:zone-a:vol-" + key,
		"nfs::snap-" + key2,
		"block::vol-" + key,
		"block:zone-a:vol-../x",
		"../../etc",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := Parse(s)
		if err != nil {
			if id != (ID{}) {
				t.Fatalf("Parse(%q) failed (%v) but returned %+v", s, err, id)
			}
			return
		}
		if got := id.String(); got != s {
			t.Fatalf("Parse(%q).String() = %q", s, got)
		}
		again, err := Parse(id.String())
		if err != nil || again != id {
			t.Fatalf("Parse(String()) of %+v = %+v, %v", id, again, err)
		}
		if _, err := ParseKind(s, id.Kind); err != nil {
			t.Fatalf("ParseKind(%q, %s): %v", s, id.Kind, err)
		}
		if built, err := New(id.Backend, id.Zone, id.Kind, id.Key); err != nil || built != id {
			t.Fatalf("New(%+v) = %+v, %v", id, built, err)
		}
		if id.Backend != accessmode.BackendBlock && id.Backend != accessmode.BackendNFS {
			t.Fatalf("Parse(%q): backend %q", s, id.Backend)
		}
		if id.Backend == accessmode.BackendBlock && id.Zone == "" {
			t.Fatalf("Parse(%q): a block id without a zone", s)
		}
		if strings.ContainsAny(s, "/\x00\\\"'{};#$ \t\n") {
			t.Fatalf("Parse(%q) accepted a character no id may carry", s)
		}
		fn := id.FileName()
		if fn == "" || fn == "." || fn == ".." || strings.ContainsAny(fn, "/\x00") {
			t.Fatalf("FileName of %q = %q: not a single safe path element", s, fn)
		}
	})
}

// FuzzFileNameDistinct: two different ids never share a file name.
func FuzzFileNameDistinct(f *testing.F) {
	f.Add("block:a_b:vol-"+key, "block:a:vol-"+key)
	f.Add("nfs::vol-"+key, "nfs::snap-"+key)
	f.Add("nfs:block:vol-"+key, "block:nfs:vol-"+key)
	f.Fuzz(func(t *testing.T, a, b string) {
		x, errA := Parse(a)
		y, errB := Parse(b)
		if errA != nil || errB != nil || x == y {
			return
		}
		if x.FileName() == y.FileName() {
			t.Fatalf("%q and %q share FileName %q", a, b, x.FileName())
		}
	})
}

package volumeid

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

const (
	key  = "0123456789abcdef0123456789abcdef"
	key2 = "fedcba9876543210fedcba9876543210"
)

func TestParseAccepts(t *testing.T) {
	tests := []struct {
		in   string
		want ID
		file string
	}{
		{"block:zone-a:vol-" + key, ID{accessmode.BackendBlock, "zone-a", Volume, key}, "block_zone-a_vol-" + key},
		{"block:zone-a:snap-" + key, ID{accessmode.BackendBlock, "zone-a", Snapshot, key}, "block_zone-a_snap-" + key},
		{"nfs::vol-" + key, ID{accessmode.BackendNFS, "", Volume, key}, "nfs__vol-" + key},
		{"nfs::snap-" + key2, ID{accessmode.BackendNFS, "", Snapshot, key2}, "nfs__snap-" + key2},
		{"block:zone-a:grp-" + key, ID{accessmode.BackendBlock, "zone-a", GroupSnapshot, key}, "block_zone-a_grp-" + key},
		{"nfs:eu-west-1b:vol-" + key, ID{accessmode.BackendNFS, "eu-west-1b", Volume, key}, "nfs_eu-west-1b_vol-" + key},
		{"block:a:vol-" + key, ID{accessmode.BackendBlock, "a", Volume, key}, "block_a_vol-" + key},
		{"block:Rack_3.row-B:vol-" + key, ID{accessmode.BackendBlock, "Rack_3.row-B", Volume, key}, "block_Rack_3.row-B_vol-" + key},
		{"block:" + strings.Repeat("z", 63) + ":vol-" + key, ID{accessmode.BackendBlock, strings.Repeat("z", 63), Volume, key}, "block_" + strings.Repeat("z", 63) + "_vol-" + key},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			id, err := Parse(tt.in)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if id != tt.want {
				t.Errorf("Parse = %+v, want %+v", id, tt.want)
			}
			if s := id.String(); s != tt.in {
				t.Errorf("String() = %q, want %q", s, tt.in)
			}
			if f := id.FileName(); f != tt.file {
				t.Errorf("FileName() = %q, want %q", f, tt.file)
			}
			built, err := New(tt.want.Backend, tt.want.Zone, tt.want.Kind, tt.want.Key)
			if err != nil || built != tt.want {
				t.Errorf("New(%+v) = %+v, %v", tt.want, built, err)
			}
		})
	}
}

func TestParseRejects(t *testing.T) {
	tests := []struct {
		name string
		in   string
	}{
		{"empty", ""},
		{"path traversal", "../../etc"},
		{"path traversal in the key", "block:zone-a:vol-../x"},
		{"traversal with the right length", "block:zone-a:vol-../../../../../../../etc/passwd0"},
		{"block without a zone", "block::vol-" + key},
		{"uppercase hex", "block:zone-a:vol-" + strings.ToUpper(key)},
		{"one uppercase digit", "nfs::vol-" + key[:31] + "F"},
		{"key too short", "block:zone-a:vol-" + key[:31]},
		{"key too long", "block:zone-a:vol-" + key + "0"},
		{"empty key", "block:zone-a:vol-"},
		{"not hex", "block:zone-a:vol-" + strings.Repeat("g", 32)},
		{"full sha256", "block:zone-a:vol-" + key + key},
		{"extra colon at the end", "block:zone-a:vol-" + key + ":"},
		{"extra colon in the middle", "block:zone:a:vol-" + key},
		{"two colons", "nfs:::vol-" + key},
		{"no colons", "vol-" + key},
		{"one colon", "nfs:vol-" + key},
		{"NUL in the key", "block:zone-a:vol-" + key[:16] + "\x00" + key[17:]},
		{"NUL after the key", "block:zone-a:vol-" + key + "\x00"},
		{"NUL in the zone", "block:zone\x00a:vol-" + key},
		{"slash in the zone", "block:zone/a:vol-" + key},
		{"dot-dot zone", "block:..:vol-" + key},
		{"dot zone", "nfs:.:vol-" + key},
		{"zone starting with a dash", "block:-zone:vol-" + key},
		{"zone ending with a dot", "block:zone.:vol-" + key},
		{"zone with a space", "block:zone a:vol-" + key},
		{"zone of 64 characters", "block:" + strings.Repeat("z", 64) + ":vol-" + key},
		{"zone with a newline", "block:zone\n:vol-" + key},
		{"newline after the key", "block:zone-a:vol-" + key + "\n"},
		{"unknown backend", "ceph:zone-a:vol-" + key},
		{"empty backend", ":zone-a:vol-" + key},
		{"capitalised backend", "NFS::vol-" + key},
		{"unknown kind", "block:zone-a:volume-" + key},
		{"empty kind", "block:zone-a:-" + key},
		{"capitalised kind", "block:zone-a:VOL-" + key},
		{"no dash", "block:zone-a:vol" + key},
		{"dash inside the key", "block:zone-a:vol-" + key[:16] + "-" + key[17:]},
		{"leading space", " nfs::vol-" + key},
		{"ganesha config characters", `nfs::vol-0123456789abcdef0123456789ab"};`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := Parse(tt.in)
			if err == nil {
				t.Fatalf("Parse(%q) = %+v, want an error", tt.in, id)
			}
			if id != (ID{}) {
				t.Errorf("Parse(%q) returned %+v alongside the error, want the zero ID", tt.in, id)
			}
			if !strings.Contains(err.Error(), "id ") {
				t.Errorf("error %q does not say which id", err)
			}
		})
	}
}

func TestNewRejects(t *testing.T) {
	tests := []struct {
		name    string
		backend accessmode.Backend
		zone    string
		kind    Kind
		key     string
		mention string
	}{
		{"block without zone", accessmode.BackendBlock, "", Volume, key, "zone"},
		{"bad zone on nfs", accessmode.BackendNFS, "a/b", Volume, key, "zone"},
		{"unknown backend", "lvm", "zone-a", Volume, key, "backend"},
		{"unknown kind", accessmode.BackendNFS, "", "backup", key, "kind"},
		{"short key", accessmode.BackendNFS, "", Volume, "abc", "key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.backend, tt.zone, tt.kind, tt.key)
			if err == nil {
				t.Fatalf("New = nil error")
			}
			if !strings.Contains(err.Error(), tt.mention) {
				t.Errorf("error %q does not mention %s", err, tt.mention)
			}
		})
	}
}

func TestValidZone(t *testing.T) {
	good := []string{"a", "Z", "0", "zone-a", "us-east-1a", "a_b.c-d", strings.Repeat("x", 63)}
	bad := []string{"", "-a", "a-", ".a", "a.", "_a", "a_", "a/b", "a b", "a:b", "ä", strings.Repeat("x", 64), "a\x00"}
	for _, z := range good {
		if !ValidZone(z) {
			t.Errorf("ValidZone(%q) = false", z)
		}
	}
	for _, z := range bad {
		if ValidZone(z) {
			t.Errorf("ValidZone(%q) = true", z)
		}
	}
}

func TestParseKind(t *testing.T) {
	vol := "nfs::vol-" + key
	snap := "block:zone-a:snap-" + key
	if id, err := ParseKind(vol, Volume); err != nil || id.Kind != Volume {
		t.Errorf("ParseKind(%q, vol) = %+v, %v", vol, id, err)
	}
	if id, err := ParseKind(snap, Snapshot); err != nil || id.Kind != Snapshot {
		t.Errorf("ParseKind(%q, snap) = %+v, %v", snap, id, err)
	}
	for _, c := range []struct {
		in   string
		want Kind
	}{{vol, Snapshot}, {snap, Volume}} {
		id, err := ParseKind(c.in, c.want)
		if err == nil {
			t.Errorf("ParseKind(%q, %s) = %+v, want an error", c.in, c.want, id)
			continue
		}
		if id != (ID{}) || !strings.Contains(err.Error(), string(c.want)) {
			t.Errorf("ParseKind(%q, %s) = %+v, %q", c.in, c.want, id, err)
		}
	}
	if _, err := ParseKind("../../etc", Volume); err == nil {
		t.Error("ParseKind accepted a malformed id")
	}
}

// FileName must be one safe path element and distinct for distinct ids.
func TestFileName(t *testing.T) {
	var ids []ID
	for _, b := range []accessmode.Backend{accessmode.BackendBlock, accessmode.BackendNFS} {
		for _, z := range []string{"", "a", "a_vol", "a_b", "b", "zone-a", "nfs", "block", "a.b", strings.Repeat("q", 63)} {
			for _, k := range []Kind{Volume, Snapshot} {
				for _, key := range []string{key, key2} {
					if id, err := New(b, z, k, key); err == nil {
						ids = append(ids, id)
					}
				}
			}
		}
	}
	if len(ids) < 70 {
		t.Fatalf("only %d ids built", len(ids))
	}
	seen := map[string]ID{}
	for _, id := range ids {
		f := id.FileName()
		checkSafeElement(t, id, f)
		if other, dup := seen[f]; dup {
			t.Errorf("FileName %q is shared by %v and %v", f, other, id)
		}
		seen[f] = id
	}
}

func checkSafeElement(t *testing.T, id ID, f string) {
	t.Helper()
	if f == "" || f == "." || f == ".." || strings.ContainsAny(f, "/\x00") {
		t.Errorf("FileName of %v = %q: not a single safe path element", id, f)
	}
	if filepath.Base(f) != f || filepath.Join("/base", f) != "/base/"+f {
		t.Errorf("FileName of %v = %q: does not stay one element under a base directory", id, f)
	}
}

func TestKeyFor(t *testing.T) {
	const driver = "modeguard.example.com"
	k := KeyFor(driver, Volume, "pvc-1234")
	if len(k) != KeyLength {
		t.Fatalf("KeyFor length %d, want %d", len(k), KeyLength)
	}
	if _, err := New(accessmode.BackendNFS, "", Volume, k); err != nil {
		t.Fatalf("KeyFor gave a key New refuses: %v", err)
	}
	if again := KeyFor(driver, Volume, "pvc-1234"); again != k {
		t.Errorf("KeyFor is not deterministic: %q then %q", k, again)
	}
	// Golden value, computed outside Go as
	//   printf 'modeguard.example.com\0vol\0pvc-1234' | sha256sum | cut -c1-32
	// The key is part of on-disk names, so it must never change between
	// releases.
	if want := "d302e40fff8b9ccddf43ce6d65831648"; k != want {
		t.Errorf("KeyFor(%q, vol, pvc-1234) = %q, want %q (existing volumes would be lost)", driver, k, want)
	}
	others := map[string]string{
		"other name":      KeyFor(driver, Volume, "pvc-1235"),
		"other kind":      KeyFor(driver, Snapshot, "pvc-1234"),
		"other driver":    KeyFor("other.example.com", Volume, "pvc-1234"),
		"empty name":      KeyFor(driver, Volume, ""),
		"name with space": KeyFor(driver, Volume, "pvc-1234 "),
		"upper-case name": KeyFor(driver, Volume, "PVC-1234"),
		"name moved":      KeyFor(driver+"pvc-1234", Volume, ""),
	}
	seen := map[string]string{k: "the original"}
	for what, o := range others {
		if len(o) != KeyLength || !keyPattern.MatchString(o) {
			t.Errorf("%s: key %q is not %d lower-case hex digits", what, o, KeyLength)
		}
		if prev, dup := seen[o]; dup {
			t.Errorf("%s gives the same key as %s: %q", what, prev, o)
		}
		seen[o] = what
	}
}

package nodeid

import (
	"net/netip"
	"strings"
	"testing"
)

// labelValue reports whether s is what the package documents for a name
// or a zone: a non-empty Kubernetes label value.
func labelValue(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }
	for i := 0; i < len(s); i++ {
		if !alnum(s[i]) && s[i] != '-' && s[i] != '_' && s[i] != '.' {
			return false
		}
	}
	return alnum(s[0]) && alnum(s[len(s)-1])
}

// FuzzParse: whatever Parse accepts validates, renders (and marshals) back
// to exactly the string it came from and parses again to the same Node;
// UnmarshalText agrees with Parse; its name and zone
// are label values, so they can carry no '@', path separator, NUL, space or
// line break, and can never be "." or "..". Whatever it refuses yields the
// zero Node.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"worker-1@zone-a",
		"worker-1@zone-a@10.99.0.11",
		"n@z@2001:db8::1",
		"worker-1@..",
		"..@zone-a",
		"a..b@zone-a",
		"worker/1@zone-a",
		"worker@zone-a@10.0.0.1@x",
		"worker@zone-a@fe80::1%eth0",
		"worker@zone-a@::ffff:10.0.0.1",
		"worker\x00@zone-a",
		"worker@zone-a\n",
		"worker 1@zone-a",
		"@",
		"worker@zone-a@10.0.0.1@64",
		"worker@zone-a@@64",
		"worker@zone-a@@064",
		"worker@zone-a@@+64",
		"worker@zone-a@@0",
		"worker@zone-a@@",
		"worker@zone-a@@@iqn.2026-11.io.example:worker",
		"worker@zone-a@10.0.0.1@64@iqn.1993-08.org.debian:01:56e0e55b7367",
		"worker@zone-a@@@",
		"worker@zone-a@@@@",
		"worker@zone-a@@0@iqn.2026-11.io.example",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := Parse(s)
		var loaded Node
		if uerr := loaded.UnmarshalText([]byte(s)); (uerr == nil) != (err == nil) || loaded != n {
			t.Fatalf("UnmarshalText(%q) = %+v, %v; Parse says %+v, %v", s, loaded, uerr, n, err)
		}
		if err != nil {
			if n != (Node{}) {
				t.Fatalf("Parse(%q) failed (%v) but returned %+v", s, err, n)
			}
			return
		}
		if text, err := n.MarshalText(); err != nil || string(text) != s {
			t.Fatalf("MarshalText of Parse(%q) = %q, %v", s, text, err)
		}
		if err := n.Validate(); err != nil {
			t.Fatalf("Parse(%q) = %+v, which does not validate: %v", s, n, err)
		}
		if got := n.String(); got != s {
			t.Fatalf("Parse(%q).String() = %q", s, got)
		}
		again, err := Parse(n.String())
		if err != nil || again != n {
			t.Fatalf("Parse(String()) of %+v = %+v, %v", n, again, err)
		}
		for _, part := range []string{n.Name, n.Zone} {
			if !labelValue(part) {
				t.Fatalf("Parse(%q) accepted %q, which is not a label value", s, part)
			}
			if part == "." || part == ".." || strings.ContainsAny(part, "@/\\\x00\n\r\t ") {
				t.Fatalf("Parse(%q) accepted the name or zone %q", s, part)
			}
		}
		if n.Address != "" {
			a, err := netip.ParseAddr(n.Address)
			if err != nil || a.Zone() != "" || a.String() != n.Address {
				t.Fatalf("Parse(%q) accepted the address %q", s, n.Address)
			}
		}
		if n.MaxVolumes < 0 {
			t.Fatalf("Parse(%q) accepted the negative limit %d", s, n.MaxVolumes)
		}
		if len(s) > MaxLength {
			t.Fatalf("Parse accepted an id of %d bytes", len(s))
		}
		if n.Initiator != "" && (strings.ContainsAny(n.Initiator, "@ \x00\n") || !strings.HasPrefix(n.Initiator, "iqn.")) {
			t.Fatalf("Parse(%q) accepted the initiator name %q", s, n.Initiator)
		}
		if KeyOf(s) != n.Name {
			t.Fatalf("KeyOf(%q) = %q, Parse says the key is %q", s, KeyOf(s), n.Name)
		}
	})
}

// FuzzStringParse: a Node that Validate accepts renders to an id that Parse
// reads back to the same Node, so a node plugin never reports an id the
// controller cannot read; a Node it refuses never renders to a valid id of
// itself.
func FuzzStringParse(f *testing.F) {
	f.Add("worker-1", "zone-a", "", int64(0))
	f.Add("worker-1", "zone-a", "10.99.0.11", int64(0))
	f.Add("worker-1", "zone-a", "10.99.0.11", int64(64))
	f.Add("worker-1", "zone-a", "", int64(64))
	f.Add("worker-1", "zone-a", "", int64(-1))
	f.Add("w@x", "z", "", int64(0))
	f.Add("w", "z@10.0.0.1", "", int64(0))
	f.Add("w", "z", "10.0.0.1@x", int64(0))
	f.Add("w", "z", "2001:DB8::1", int64(0))
	f.Add("w", "z", "fe80::1%lo", int64(0))
	f.Fuzz(func(t *testing.T, name, zone, address string, limit int64) {
		n := Node{Name: name, Zone: zone, Address: address, MaxVolumes: limit}
		got, err := Parse(n.String())
		if n.Validate() != nil {
			if err == nil && got == n {
				t.Fatalf("Validate refuses %+v but Parse reads it from %q", n, n.String())
			}
			return
		}
		if err != nil || got != n {
			t.Fatalf("Parse(%q) = %+v, %v; want %+v", n.String(), got, err, n)
		}
	})
}

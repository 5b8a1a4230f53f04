package nodeid

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestParseStringRoundTrip(t *testing.T) {
	tests := []struct {
		in   string
		want Node
	}{
		{"worker-1@zone-a", Node{Name: "worker-1", Zone: "zone-a"}},
		{"worker-1@zone-a@10.99.0.11", Node{Name: "worker-1", Zone: "zone-a", Address: "10.99.0.11"}},
		{"n@z@2001:db8::1", Node{Name: "n", Zone: "z", Address: "2001:db8::1"}},
		{"Node_1.example@eu-west-1b", Node{Name: "Node_1.example", Zone: "eu-west-1b"}},
		{strings.Repeat("a", 63) + "@" + strings.Repeat("b", 63), Node{Name: strings.Repeat("a", 63), Zone: strings.Repeat("b", 63)}},
		{"worker-1@zone-a@10.99.0.11@64", Node{Name: "worker-1", Zone: "zone-a", Address: "10.99.0.11", MaxVolumes: 64}},
		{"worker-1@zone-a@@1", Node{Name: "worker-1", Zone: "zone-a", MaxVolumes: 1}},
		{"worker-1@zone-a@10.99.0.11@64@iqn.1993-08.org.debian:01:56e0e55b7367",
			Node{Name: "worker-1", Zone: "zone-a", Address: "10.99.0.11", MaxVolumes: 64, Initiator: "iqn.1993-08.org.debian:01:56e0e55b7367"}},
		{"worker-1@zone-a@@@iqn.2026-11.io.example:worker-1", Node{Name: "worker-1", Zone: "zone-a", Initiator: "iqn.2026-11.io.example:worker-1"}},
		{"worker-1@zone-a@10.99.0.11@@iqn.2026-11.io.example", Node{Name: "worker-1", Zone: "zone-a", Address: "10.99.0.11", Initiator: "iqn.2026-11.io.example"}},
		{"worker-1@zone-a@@8@iqn.2026-11.io.example", Node{Name: "worker-1", Zone: "zone-a", MaxVolumes: 8, Initiator: "iqn.2026-11.io.example"}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := Parse(tt.in)
			if err != nil {
				t.Fatalf("Parse(%q): %v", tt.in, err)
			}
			if got != tt.want {
				t.Errorf("Parse(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
			if s := got.String(); s != tt.in {
				t.Errorf("Parse(%q).String() = %q", tt.in, s)
			}
			if err := got.Validate(); err != nil {
				t.Errorf("Validate of a parsed node: %v", err)
			}
			// And the other way round: a valid Node renders to an id that
			// parses back to the same Node.
			again, err := Parse(tt.want.String())
			if err != nil || again != tt.want {
				t.Errorf("Parse(%q) = %+v, %v; want %+v", tt.want.String(), again, err, tt.want)
			}
		})
	}
}

func TestParseRefusesHostileIDs(t *testing.T) {
	tests := []struct{ name, in string }{
		{"empty", ""},
		{"no zone", "worker-1"},
		{"empty name", "@zone-a"},
		{"empty zone", "worker-1@"},
		{"empty both", "@"},
		{"empty address", "worker-1@zone-a@"},
		{"empty zone with address", "worker-1@@10.0.0.1"},
		{"only separators", "@@"},
		{"limit not a number", "worker-1@zone-a@10.0.0.1@x"},
		{"initiator not an IQN", "worker-1@zone-a@10.0.0.1@64@x"},
		{"too many @", "worker-1@zone-a@10.0.0.1@64@iqn.2026-11.io.example@x"},
		{"empty initiator", "worker-1@zone-a@10.0.0.1@64@"},
		{"upper case initiator", "worker-1@zone-a@@@iqn.2026-11.io.Example:a"},
		{"EUI initiator", "worker-1@zone-a@@@eui.02004567A425678D"},
		{"initiator option", "worker-1@zone-a@@@--login"},
		{"longer than a CO takes", strings.Repeat("a", 63) + "@" + strings.Repeat("b", 63) + "@10.0.0.1@64@iqn.2026-11.io.example:" + strings.Repeat("c", 100)},
		{"empty limit", "worker-1@zone-a@10.0.0.1@"},
		{"empty address and limit", "worker-1@zone-a@@"},
		{"zero limit", "worker-1@zone-a@@0"},
		{"negative limit", "worker-1@zone-a@@-1"},
		{"signed limit", "worker-1@zone-a@@+4"},
		{"leading zero limit", "worker-1@zone-a@@04"},
		{"limit overflows", "worker-1@zone-a@@9223372036854775808"},
		{"four empty parts", "@@@"},
		{"slash in name", "../etc@zone-a"},
		{"slash in zone", "worker-1@zone/a"},
		{"dotdot zone", "worker-1@.."},
		{"leading dash", "-worker@zone-a"},
		{"trailing dot", "worker.@zone-a"},
		{"space", "worker 1@zone-a"},
		{"NUL", "worker\x00@zone-a"},
		{"newline", "worker@zone-a\n"},
		{"name too long", strings.Repeat("a", 64) + "@zone-a"},
		{"zone too long", "worker@" + strings.Repeat("z", 64)},
		{"bad IPv4", "worker@zone-a@10.0.0.256"},
		{"IPv4 with port", "worker@zone-a@10.0.0.1:2049"},
		{"IPv4 leading zero", "worker@zone-a@010.0.0.1"},
		{"hostname as address", "worker@zone-a@nfs.example.com"},
		{"IPv6 zone suffix", "worker@zone-a@fe80::1%eth0"},
		{"IPv6 non-canonical", "worker@zone-a@2001:DB8:0:0::1"},
		{"IPv6 bracketed", "worker@zone-a@[2001:db8::1]"},
		{"address with slash", "worker@zone-a@10.0.0.0/8"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := Parse(tt.in)
			if err == nil {
				t.Fatalf("Parse(%q) = %+v, want an error", tt.in, n)
			}
			if n != (Node{}) {
				t.Errorf("Parse(%q) failed but returned %+v", tt.in, n)
			}
			if !strings.Contains(err.Error(), "node") {
				t.Errorf("error %q does not say what was wrong", err)
			}
		})
	}
}

func TestValidateNode(t *testing.T) {
	tests := []struct {
		n  Node
		ok bool
	}{
		{Node{Name: "w", Zone: "z"}, true},
		{Node{Name: "w", Zone: "z", Address: "192.0.2.1"}, true},
		{Node{Name: "", Zone: "z"}, false},
		{Node{Name: "w", Zone: ""}, false},
		{Node{Name: "w@x", Zone: "z"}, false},
		{Node{Name: "w", Zone: "z@y"}, false},
		{Node{Name: "w", Zone: "z", Address: "fe80::1%lo"}, false},
		{Node{Name: "w", Zone: "z", Address: " 192.0.2.1"}, false},
		{Node{Name: "w", Zone: "z", Initiator: "iqn.2026-11.io.example:w"}, true},
		{Node{Name: "w", Zone: "z", Initiator: "iqn.2026-11.io.example:w@z"}, false},
		{Node{Name: "w", Zone: "z", Initiator: "iqn.2026-11.io.example:" + strings.Repeat("w", 200)}, true},
		{Node{Name: strings.Repeat("w", 63), Zone: "z", Initiator: "iqn.2026-11.io.example:" + strings.Repeat("w", 200)}, false},
	}
	for _, tt := range tests {
		err := tt.n.Validate()
		if (err == nil) != tt.ok {
			t.Errorf("Validate(%+v) = %v, want ok=%t", tt.n, err, tt.ok)
		}
	}
}

func TestKey(t *testing.T) {
	long := strings.Repeat("node-", 50) + "x" // 251 characters, a DNS subdomain
	tests := []struct {
		name string
		want string // "" for: a hashed key
	}{
		{"worker-1", "worker-1"},
		{"Node_1.example", "Node_1.example"},
		{strings.Repeat("a", 63), strings.Repeat("a", 63)},
		{strings.Repeat("a", 64), ""},
		{"ip-10-0-0-1." + strings.Repeat("compute.", 7) + "internal", ""},
		{long, ""},
	}
	seen := map[string]string{}
	for _, tt := range tests {
		if !ValidName(tt.name) {
			t.Fatalf("ValidName(%q) = false", tt.name)
		}
		k := Key(tt.name)
		if tt.want != "" && k != tt.want {
			t.Errorf("Key(%q) = %q, want %q", tt.name, k, tt.want)
		}
		if !ValidKey(k) || len(k) > 63 {
			t.Errorf("Key(%q) = %q, not a label value", tt.name, k)
		}
		if Key(tt.name) != k {
			t.Errorf("Key(%q) is not stable", tt.name)
		}
		if other, dup := seen[k]; dup {
			t.Errorf("Key(%q) = Key(%q) = %q", tt.name, other, k)
		}
		seen[k] = tt.name
		n := Node{Name: k, Zone: "zone-a", Address: "10.0.0.1", MaxVolumes: 128}
		id := n.String()
		if got, err := Parse(id); err != nil || got != n {
			t.Errorf("Parse(%q) = %+v, %v", id, got, err)
		}
		// Kubernetes keeps a CSI node id of at most 192 bytes.
		if len(id) > 192 {
			t.Errorf("node id %q is %d bytes long", id, len(id))
		}
	}
	// Two long names that share their first 63 characters get two keys.
	a, b := strings.Repeat("a", 70)+".one", strings.Repeat("a", 70)+".two"
	if Key(a) == Key(b) {
		t.Errorf("Key(%q) = Key(%q)", a, b)
	}
}

func TestValidName(t *testing.T) {
	for _, n := range []string{"w", "worker-1", "Worker_1", strings.Repeat("a", 63) + "." + strings.Repeat("b", 63) + "." + strings.Repeat("c", 63) + "." + strings.Repeat("d", 61)} {
		if !ValidName(n) {
			t.Errorf("ValidName(%q) = false", n)
		}
	}
	for _, n := range []string{"", "-w", "w-", "a..b." + strings.Repeat("x", 70), strings.Repeat("a", 64) + "_b",
		strings.Repeat("a", 63) + "." + strings.Repeat("b", 63) + "." + strings.Repeat("c", 63) + "." + strings.Repeat("d", 62),
		"w@z", "w/x" + strings.Repeat("y", 70), strings.Repeat("A", 64), strings.Repeat("a", 64) + ".", "."} {
		if ValidName(n) {
			t.Errorf("ValidName(%q) = true", n)
		}
	}
}

func TestKeyOf(t *testing.T) {
	for in, want := range map[string]string{
		"worker-1@zone-a":                "worker-1",
		"worker-1@zone-a@10.0.0.1@64":    "worker-1",
		"worker-1":                       "worker-1",
		"":                               "",
		"@zone-a":                        "",
		"some-node-id-from-a-test@x@y@z": "some-node-id-from-a-test",
	} {
		if got := KeyOf(in); got != want {
			t.Errorf("KeyOf(%q) = %q, want %q", in, got, want)
		}
	}
}

// A record holds a Node as the id string, the form records held before the
// node was typed: an id in that form loads and is written back unchanged;
// one that does not parse does not load, and a Node that does not validate
// is not written.
func TestNodeInRecords(t *testing.T) {
	type record struct {
		Node Node `json:"nodeID"`
	}
	for _, in := range []string{
		`{"nodeID":"worker-1@zone-a"}`,
		`{"nodeID":"worker-1@zone-a@10.99.0.11@64"}`,
		`{"nodeID":"n@z@2001:db8::1"}`,
		`{"nodeID":"worker-1@zone-a@@@iqn.2026-11.io.example:worker-1"}`,
	} {
		var r record
		if err := json.Unmarshal([]byte(in), &r); err != nil {
			t.Errorf("loading %s: %v", in, err)
			continue
		}
		if out, err := json.Marshal(r); err != nil || string(out) != in {
			t.Errorf("%s is written back as %s (%v)", in, out, err)
		}
	}
	for _, in := range []string{`{"nodeID":"worker-1"}`, `{"nodeID":""}`, `{"nodeID":"worker-1@zone-a@"}`, `{"nodeID":["w","z"]}`} {
		var r record
		if err := json.Unmarshal([]byte(in), &r); err == nil {
			t.Errorf("%s loads as %+v", in, r.Node)
		}
	}
	for _, n := range []Node{{}, {Name: "w"}, {Name: "w", Zone: "z", Address: "10.0.0.1/8"}} {
		if out, err := json.Marshal(record{n}); err == nil {
			t.Errorf("%+v is written as %s", n, out)
		}
	}
}

func TestMustParse(t *testing.T) {
	if n := MustParse("worker-1@zone-a@10.0.0.1"); n != (Node{Name: "worker-1", Zone: "zone-a", Address: "10.0.0.1"}) {
		t.Errorf("MustParse = %+v", n)
	}
	defer func() {
		if recover() == nil {
			t.Error("MustParse of a bad id does not panic")
		}
	}()
	MustParse("worker-1")
}

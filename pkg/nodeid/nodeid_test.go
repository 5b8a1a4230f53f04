package nodeid

import (
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
		{"too many @", "worker-1@zone-a@10.0.0.1@x"},
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
	}
	for _, tt := range tests {
		err := tt.n.Validate()
		if (err == nil) != tt.ok {
			t.Errorf("Validate(%+v) = %v, want ok=%t", tt.n, err, tt.ok)
		}
	}
}

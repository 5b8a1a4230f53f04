package accessmode

import (
	"strings"
	"testing"
)

// Short names so the tables below fit on a line and read like the spec's.
const (
	SNW  = SingleNodeWriter
	SNRO = SingleNodeReaderOnly
	MNRO = MultiNodeReaderOnly
	MNSW = MultiNodeSingleWriter
	MNMW = MultiNodeMultiWriter
	SNSW = SingleNodeSingleWriter
	SNMW = SingleNodeMultiWriter
)

// Modes that are not among the seven: the proto's zero value and numbers
// beyond the enum.
var invalidModes = []Mode{Mode(0), Mode(8), Mode(-1), Mode(99)}

func TestAllListsTheSevenModesInSpecOrder(t *testing.T) {
	want := []Mode{SNW, SNRO, MNRO, MNSW, MNMW, SNSW, SNMW}
	if len(All) != len(want) {
		t.Fatalf("All has %d modes, want %d", len(All), len(want))
	}
	for i, m := range want {
		if All[i] != m {
			t.Errorf("All[%d] = %v, want %v", i, All[i], m)
		}
		if int(All[i]) != i+1 {
			t.Errorf("All[%d] = %d, want spec number %d", i, All[i], i+1)
		}
	}
}

func TestValid(t *testing.T) {
	for _, m := range All {
		if !Valid(m) {
			t.Errorf("Valid(%v) = false", m)
		}
	}
	for _, m := range invalidModes {
		if Valid(m) {
			t.Errorf("Valid(%d) = true", m)
		}
	}
}

// The modes' properties, stated from the spec's comments in csi.proto.
func TestModeProperties(t *testing.T) {
	tests := []struct {
		mode           Mode
		readOnly       bool // no writer at all
		multiNode      bool // more than one node at once
		singleWorkload bool // one target path per node
	}{
		{SNW, false, false, true}, // same within-node rule as SNSW (second table)
		{SNRO, true, false, true},
		{MNRO, true, true, false},
		{MNSW, false, true, false},
		{MNMW, false, true, false},
		{SNSW, false, false, true},
		{SNMW, false, false, false},
	}
	if len(tests) != len(All) {
		t.Fatalf("table covers %d modes, want all %d", len(tests), len(All))
	}
	for _, tt := range tests {
		t.Run(Name(tt.mode), func(t *testing.T) {
			if got := IsReadOnly(tt.mode); got != tt.readOnly {
				t.Errorf("IsReadOnly = %t, want %t", got, tt.readOnly)
			}
			if got := IsMultiNode(tt.mode); got != tt.multiNode {
				t.Errorf("IsMultiNode = %t, want %t", got, tt.multiNode)
			}
			if got := SingleWorkload(tt.mode); got != tt.singleWorkload {
				t.Errorf("SingleWorkload = %t, want %t", got, tt.singleWorkload)
			}
		})
	}
	for _, m := range invalidModes {
		if IsReadOnly(m) || IsMultiNode(m) || SingleWorkload(m) {
			t.Errorf("mode %d: an invalid mode must have no property (IsReadOnly=%t IsMultiNode=%t SingleWorkload=%t)",
				m, IsReadOnly(m), IsMultiNode(m), SingleWorkload(m))
		}
	}
}

func TestWithin(t *testing.T) {
	// Row: the narrow mode; column: the wide mode; "y": every use the
	// narrow mode allows is allowed by the wide one.
	cols := []Mode{SNW, SNRO, MNRO, MNSW, MNMW, SNSW, SNMW}
	rows := []struct {
		narrow Mode
		wide   string // one letter per column above
	}{
		//     SNW  SNRO MNRO MNSW MNMW SNSW SNMW
		{SNW, " y    -    -    y    y    y    y"},
		{SNRO, "y    y    y    y    y    y    y"},
		{MNRO, "-    -    y    y    y    -    -"},
		{MNSW, "-    -    -    y    y    -    -"},
		{MNMW, "-    -    -    -    y    -    -"},
		{SNSW, "y    -    -    y    y    y    y"},
		{SNMW, "-    -    -    y    y    -    y"},
	}
	if len(rows) != len(All) {
		t.Fatalf("table covers %d modes, want all %d", len(rows), len(All))
	}
	for _, r := range rows {
		cells := strings.Fields(r.wide)
		if len(cells) != len(cols) {
			t.Fatalf("row %v has %d cells, want %d", r.narrow, len(cells), len(cols))
		}
		for i, wide := range cols {
			want := cells[i] == "y"
			if got := Within(r.narrow, wide); got != want {
				t.Errorf("Within(%v, %v) = %t, want %t", r.narrow, wide, got, want)
			}
		}
	}

	// The ones the driver's users depend on, spelled out.
	named := []struct {
		narrow, wide Mode
		want         bool
		why          string
	}{
		{SNSW, SNMW, true, "an RWO volume may later be used as RWOP"},
		{SNMW, SNSW, false, "RWOP holds one workload; RWO may hold many"},
		{MNRO, SNMW, false, "a single-node volume may not be read from many nodes"},
		{SNW, SNSW, true, "old COs' SINGLE_NODE_WRITER equals SINGLE_NODE_SINGLE_WRITER"},
		{SNSW, SNW, true, "and the other way round"},
	}
	for _, n := range named {
		if got := Within(n.narrow, n.wide); got != n.want {
			t.Errorf("Within(%v, %v) = %t, want %t: %s", n.narrow, n.wide, got, n.want, n.why)
		}
	}
	for _, m := range All {
		if !Within(m, MNMW) {
			t.Errorf("Within(%v, MULTI_NODE_MULTI_WRITER) = false; everything is within it", m)
		}
		if !Within(m, m) {
			t.Errorf("Within(%v, %v) = false; a mode is within itself", m, m)
		}
		for _, bad := range invalidModes {
			if Within(m, bad) || Within(bad, m) {
				t.Errorf("Within with invalid mode %d and %v = true", bad, m)
			}
		}
	}
}

func TestWithinAny(t *testing.T) {
	tests := []struct {
		m     Mode
		modes []Mode
		want  bool
	}{
		{SNSW, nil, false},
		{SNSW, []Mode{MNRO}, false},
		{SNSW, []Mode{MNRO, SNMW}, true},
		{MNSW, []Mode{SNW, SNSW, SNMW, MNRO}, false},
		{MNSW, []Mode{SNW, MNMW}, true},
		{Mode(0), All, false},
	}
	for _, tt := range tests {
		if got := WithinAny(tt.m, tt.modes); got != tt.want {
			t.Errorf("WithinAny(%v, %v) = %t, want %t", tt.m, tt.modes, got, tt.want)
		}
	}
}

func TestParse(t *testing.T) {
	tests := []struct {
		in   string
		want Mode
	}{
		// The spec's names.
		{"SINGLE_NODE_WRITER", SNW},
		{"SINGLE_NODE_READER_ONLY", SNRO},
		{"MULTI_NODE_READER_ONLY", MNRO},
		{"MULTI_NODE_SINGLE_WRITER", MNSW},
		{"MULTI_NODE_MULTI_WRITER", MNMW},
		{"SINGLE_NODE_SINGLE_WRITER", SNSW},
		{"SINGLE_NODE_MULTI_WRITER", SNMW},
		// Their numbers.
		{"1", SNW},
		{"2", SNRO},
		{"3", MNRO},
		{"4", MNSW},
		{"5", MNMW},
		{"6", SNSW},
		{"7", SNMW},
		// Nomad's names.
		{"single-node-writer", SNW},
		{"single-node-reader-only", SNRO},
		{"multi-node-reader-only", MNRO},
		{"multi-node-single-writer", MNSW},
		{"multi-node-multi-writer", MNMW},
		{"single-node-single-writer", SNSW},
		{"single-node-multi-writer", SNMW},
		// Tolerated spellings.
		{"single_node_writer", SNW},
		{"  MULTI_NODE_READER_ONLY\n", MNRO},
		{" 5 ", MNMW},
	}
	for _, tt := range tests {
		got, err := Parse(tt.in)
		if err != nil {
			t.Errorf("Parse(%q) error: %v", tt.in, err)
			continue
		}
		if got != tt.want {
			t.Errorf("Parse(%q) = %v, want %v", tt.in, got, tt.want)
		}
	}

	junk := []string{
		"", " ", "UNKNOWN", "unknown", "0", "8", "-1", "+", "5x", "0x5",
		"4294967301", // 5 modulo 2^32: must not wrap around to MULTI_NODE_MULTI_WRITER
		"ReadWriteOnce", "RWX", "single node writer", "SINGLE_NODE", "MULTI_NODE_...",
		"SINGLE_NODE_WRITER,MULTI_NODE_READER_ONLY", "single-node-writer\x00",
	}
	for _, in := range junk {
		got, err := Parse(in)
		if err == nil {
			t.Errorf("Parse(%q) = %v, want an error", in, got)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, "accepted") {
			t.Errorf("Parse(%q) error %q does not say what is accepted", in, msg)
		}
		for _, m := range All {
			if !strings.Contains(msg, m.String()) {
				t.Errorf("Parse(%q) error %q does not list %s", in, msg, m)
			}
		}
	}
}

func TestParseRoundTripsName(t *testing.T) {
	for _, m := range All {
		got, err := Parse(Name(m))
		if err != nil || got != m {
			t.Errorf("Parse(Name(%v)) = %v, %v", m, got, err)
		}
	}
}

func TestEffectiveReadOnly(t *testing.T) {
	readOnlyModes := map[Mode]bool{SNRO: true, MNRO: true}
	for _, m := range All {
		for _, requested := range []bool{false, true} {
			for _, attached := range []bool{false, true} {
				want := readOnlyModes[m] || requested || attached
				if got := EffectiveReadOnly(m, requested, attached); got != want {
					t.Errorf("EffectiveReadOnly(%v, requested=%t, attached=%t) = %t, want %t",
						m, requested, attached, got, want)
				}
			}
		}
	}
	// A writer mode stays writable only when nobody asked otherwise.
	if EffectiveReadOnly(MNSW, false, false) {
		t.Error("MULTI_NODE_SINGLE_WRITER writer must be read/write")
	}
	if !EffectiveReadOnly(MNSW, false, true) {
		t.Error("MULTI_NODE_SINGLE_WRITER reader attached read-only must mount read-only")
	}
}

func TestWorkloadString(t *testing.T) {
	tests := []struct {
		w    Workload
		want string
	}{
		{Workload{}, "an unnamed workload"},
		{Workload{Namespace: "ns", UID: "u"}, "an unnamed workload"},
		{Workload{Name: "web-0"}, "pod web-0"},
		{Workload{Name: "web-0", Namespace: "prod", UID: "u"}, "pod prod/web-0"},
	}
	for _, tt := range tests {
		if got := tt.w.String(); got != tt.want {
			t.Errorf("%#v.String() = %q, want %q", tt.w, got, tt.want)
		}
	}
}

func TestAllReadOnly(t *testing.T) {
	tests := []struct {
		modes []Mode
		want  bool
	}{
		{nil, false},
		{[]Mode{MultiNodeReaderOnly}, true},
		{[]Mode{SingleNodeReaderOnly, MultiNodeReaderOnly}, true},
		{[]Mode{MultiNodeReaderOnly, SingleNodeWriter}, false},
		{[]Mode{MultiNodeSingleWriter}, false},
		{[]Mode{Mode(99)}, false},
	}
	for _, tt := range tests {
		if got := AllReadOnly(tt.modes); got != tt.want {
			t.Errorf("AllReadOnly(%v) = %t, want %t", tt.modes, got, tt.want)
		}
	}
}

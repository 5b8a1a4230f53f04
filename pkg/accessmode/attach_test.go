package accessmode

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/nodeid"
)

// node is the node of key name in zone-a: its id is name@zone-a.
func node(name string) nodeid.Node { return nodeid.Node{Name: name, Zone: "zone-a"} }

// at is one node's hold, read/write ("rw") or read-only ("ro").
func at(name string, m Mode, rw string) Attachment {
	if rw != "rw" && rw != "ro" {
		panic("at: rw must be rw or ro, not " + rw)
	}
	return Attachment{Node: node(name), Mode: m, ReadOnly: rw == "ro", Fingerprint: "mount/ext4"}
}

// atID is the hold of the node whose whole id is id.
func atID(id string, m Mode, rw string) Attachment {
	a := at("", m, rw)
	a.Node = nodeid.MustParse(id)
	return a
}

func holds(a ...Attachment) []Attachment { return a }

// A record holds an attachment's node as the id string the node plugin
// reported, as records written before the node was typed do: such a record
// loads to the parsed node and is written back byte for byte.
func TestAttachmentRecordHoldsTheNodeID(t *testing.T) {
	tests := []struct {
		record string
		want   nodeid.Node
	}{
		{`{"nodeID":"worker-1@zone-a","mode":1,"readOnly":false,"fingerprint":"mount/ext4"}`,
			nodeid.Node{Name: "worker-1", Zone: "zone-a"}},
		{`{"nodeID":"worker-2@zone-a@10.0.0.12@64","mode":5,"readOnly":true,"fenced":true}`,
			nodeid.Node{Name: "worker-2", Zone: "zone-a", Address: "10.0.0.12", MaxVolumes: 64}},
		{`{"nodeID":"worker-3@zone-b@@@iqn.2026-11.io.example:worker-3","mode":3,"readOnly":true,"fingerprint":"block/"}`,
			nodeid.Node{Name: "worker-3", Zone: "zone-b", Initiator: "iqn.2026-11.io.example:worker-3"}},
	}
	for _, tt := range tests {
		var a Attachment
		if err := json.Unmarshal([]byte(tt.record), &a); err != nil {
			t.Fatalf("loading %s: %v", tt.record, err)
		}
		if a.Node != tt.want {
			t.Errorf("%s loads the node %+v, want %+v", tt.record, a.Node, tt.want)
		}
		out, err := json.Marshal(a)
		if err != nil || string(out) != tt.record {
			t.Errorf("%s is written back as %s (%v)", tt.record, out, err)
		}
	}
}

// A record whose node id does not parse does not load: what it says about
// the node cannot be trusted, and a node that matched no attachment could
// be let in beside it. Nor is a node that does not validate written.
func TestAttachmentRecordWithABadNodeID(t *testing.T) {
	for _, record := range []string{
		`{"nodeID":"worker-1","mode":1,"readOnly":false}`,
		`{"nodeID":"","mode":1,"readOnly":false}`,
		`{"nodeID":"worker-1@zone-a@10.0.0.1@x","mode":1,"readOnly":false}`,
		`{"nodeID":"../etc@zone-a","mode":1,"readOnly":false}`,
		`{"nodeID":7,"mode":1,"readOnly":false}`,
		`{"nodeID":null,"mode":1,"readOnly":false}`,
		`{"mode":1,"readOnly":false}`,
	} {
		var a Attachment
		err := json.Unmarshal([]byte(record), &a)
		if err == nil {
			t.Errorf("%s loads: %+v", record, a)
		} else if !strings.Contains(err.Error(), "node") {
			t.Errorf("%s: error %q does not say the node id is at fault", record, err)
		}
	}
	if out, err := json.Marshal(Attachment{Node: nodeid.Node{Name: "worker-1"}, Mode: SNW}); err == nil {
		t.Errorf("an attachment to a node without a zone is written as %s", out)
	}
}

// TestCheckAttach is ControllerPublishVolume across nodes: may req join the
// nodes that already hold the volume?
func TestCheckAttach(t *testing.T) {
	tests := []struct {
		name     string
		existing []Attachment
		req      Attachment
		want     codes.Code
		idem     bool
		mention  []string // the message must contain each
		reason   string   // the refusal's Reason ("" when allowed)
	}{
		// SINGLE_NODE_*: "Volume published to another node" ->
		// FAILED_PRECONDITION naming the node that holds it.
		{"SNW second node", holds(at("node-a", SNW, "rw")), at("node-b", SNW, "rw"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"SNSW second node", holds(at("node-a", SNSW, "rw")), at("node-b", SNSW, "rw"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"SNMW second node", holds(at("node-a", SNMW, "rw")), at("node-b", SNMW, "rw"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"SNRO second node", holds(at("node-a", SNRO, "ro")), at("node-b", SNRO, "ro"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"SNW second node read-only", holds(at("node-a", SNW, "rw")), at("node-b", SNW, "ro"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"SNSW after SNW on another node", holds(at("node-a", SNW, "rw")), at("node-b", SNSW, "rw"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},

		// MULTI_NODE_READER_ONLY: any number of readers.
		{"MNRO fourth reader", holds(at("node-a", MNRO, "ro"), at("node-b", MNRO, "ro"), at("node-c", MNRO, "ro")), at("node-d", MNRO, "ro"), OK, false, nil, ""},
		{"MNRO writer among readers", holds(at("node-a", MNRO, "ro")), at("node-b", MNRO, "rw"), FP, false, []string{`"node-a@zone-a"`}, "WriterLimit"},

		// MULTI_NODE_SINGLE_WRITER: many readers, at most one writer.
		{"MNSW reader after writer", holds(at("node-a", MNSW, "rw")), at("node-b", MNSW, "ro"), OK, false, nil, ""},
		{"MNSW readers after writer", holds(at("node-a", MNSW, "rw"), at("node-b", MNSW, "ro"), at("node-c", MNSW, "ro")), at("node-d", MNSW, "ro"), OK, false, nil, ""},
		{"MNSW writer after readers", holds(at("node-b", MNSW, "ro"), at("node-c", MNSW, "ro")), at("node-a", MNSW, "rw"), OK, false, nil, ""},
		{"MNSW second writer", holds(at("node-a", MNSW, "rw"), at("node-b", MNSW, "ro")), at("node-c", MNSW, "rw"), FP, false, []string{`"node-a@zone-a"`, "MULTI_NODE_SINGLE_WRITER", "read-only"}, "WriterLimit"},
		{"MNSW second writer, writer listed last", holds(at("node-b", MNSW, "ro"), at("node-c", MNSW, "ro"), at("node-a", MNSW, "rw")), at("node-d", MNSW, "rw"), FP, false, []string{`"node-a@zone-a"`}, "WriterLimit"},

		// MULTI_NODE_MULTI_WRITER: anything.
		{"MNMW fourth writer", holds(at("node-a", MNMW, "rw"), at("node-b", MNMW, "rw"), at("node-c", MNMW, "ro")), at("node-d", MNMW, "rw"), OK, false, nil, ""},
		{"MNMW reader", holds(at("node-a", MNMW, "rw"), at("node-b", MNMW, "rw")), at("node-c", MNMW, "ro"), OK, false, nil, ""},

		// The same node again: idempotent, or "Volume published but is
		// incompatible" -> ALREADY_EXISTS.
		{"same node same args", holds(at("node-a", MNSW, "rw"), at("node-b", MNSW, "ro")), at("node-b", MNSW, "ro"), OK, true, nil, ""},
		{"same single-node holder again", holds(at("node-a", SNSW, "rw")), at("node-a", SNSW, "rw"), OK, true, nil, ""},
		// A node is its key: the same node under a new address (or zone,
		// or limit) is the same holder, not a second node.
		{"same node under a new address", holds(atID("node-a@zone-a@10.0.0.1", SNSW, "rw")), atID("node-a@zone-a@10.0.0.2", SNSW, "rw"), OK, true, nil, ""},
		{"same node new address other args", holds(atID("node-a@zone-a@10.0.0.1", SNSW, "rw")), atID("node-a@zone-a@10.0.0.2", SNSW, "ro"), codes.AlreadyExists, false, []string{`"node-a@zone-a@10.0.0.1"`}, "PublishedWithOtherArguments"},
		{"other node same address", holds(atID("node-a@zone-a@10.0.0.1", SNW, "rw")), atID("node-b@zone-a@10.0.0.1", SNW, "rw"), FP, false, []string{`"node-a@zone-a@10.0.0.1"`, `"node-b@zone-a@10.0.0.1"`}, "HeldByOtherNode"},
		{"same node other mode", holds(at("node-a", SNSW, "rw")), at("node-a", SNMW, "rw"), AE, false, []string{`"node-a@zone-a"`}, "PublishedWithOtherArguments"},
		{"same node other readonly", holds(at("node-a", MNMW, "rw")), at("node-a", MNMW, "ro"), AE, false, []string{`"node-a@zone-a"`}, "PublishedWithOtherArguments"},
		{"same node other fingerprint", holds(at("node-a", SNW, "rw")), Attachment{Node: node("node-a"), Mode: SNW, Fingerprint: "block"}, AE, false, []string{`"node-a@zone-a"`}, "PublishedWithOtherArguments"},
		// The same node is judged before the other nodes: its repeat is
		// fine even if, as a new request, it would be refused.
		{"same node repeat among conflicts", holds(at("node-a", MNSW, "rw"), at("node-b", MNSW, "rw")), at("node-b", MNSW, "rw"), OK, true, nil, ""},

		// Mixing modes across nodes.
		{"multi-node request after single-node holder", holds(at("node-a", SNW, "rw")), at("node-b", MNMW, "rw"), FP, false, []string{`"node-a@zone-a"`, "SINGLE_NODE_WRITER"}, "HeldByOtherNode"},
		{"multi-node reader after single-node reader", holds(at("node-a", SNRO, "ro")), at("node-b", MNRO, "ro"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"single-node request after multi-node holder", holds(at("node-a", MNMW, "rw")), at("node-b", SNMW, "rw"), FP, false, []string{`"node-a@zone-a"`}, "HeldByOtherNode"},
		{"MNMW writer while MNRO reader holds it", holds(at("node-a", MNRO, "ro")), at("node-b", MNMW, "rw"), FP, false, []string{`"node-a@zone-a"`, "MULTI_NODE_READER_ONLY"}, "WriterLimit"},
		{"MNSW writer while MNRO reader holds it", holds(at("node-a", MNRO, "ro")), at("node-b", MNSW, "rw"), FP, false, []string{`"node-a@zone-a"`, "MULTI_NODE_READER_ONLY"}, "WriterLimit"},
		{"MNMW reader while MNRO reader holds it", holds(at("node-a", MNRO, "ro")), at("node-b", MNMW, "ro"), OK, false, nil, ""},
		{"MNMW second writer while MNSW writer holds it", holds(at("node-a", MNSW, "rw")), at("node-b", MNMW, "rw"), FP, false, []string{`"node-a@zone-a"`, "MULTI_NODE_SINGLE_WRITER"}, "WriterLimit"},
		{"MNRO reader while a writer holds it", holds(at("node-a", MNMW, "rw")), at("node-b", MNRO, "ro"), FP, false, []string{`"node-a@zone-a"`, "MULTI_NODE_READER_ONLY"}, "WriterLimit"},
		{"MNSW reader while two writers hold it", holds(at("node-a", MNMW, "rw"), at("node-b", MNMW, "rw")), at("node-c", MNSW, "ro"), FP, false, []string{"MULTI_NODE_SINGLE_WRITER"}, "WriterLimit"},
		{"writer blocked by a reader-only holder listed after a writer", holds(at("node-a", MNMW, "ro"), at("node-b", MNRO, "ro")), at("node-c", MNMW, "rw"), FP, false, []string{`"node-b@zone-a"`, "MULTI_NODE_READER_ONLY"}, "WriterLimit"},

		// Not a mode at all.
		{"invalid mode", nil, Attachment{Node: node("node-a"), Mode: Mode(0)}, INV, false, nil, "InvalidMode"},
		{"invalid mode among holders", holds(at("node-a", MNMW, "rw")), Attachment{Node: node("node-b"), Mode: Mode(42)}, INV, false, nil, "InvalidMode"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := CheckAttach(tt.existing, tt.req)
			if d.Code != tt.want {
				t.Fatalf("code = %v (%q), want %v", d.Code, d.Message, tt.want)
			}
			if d.Allowed() != (tt.want == OK) {
				t.Errorf("Allowed() = %t with code %v", d.Allowed(), d.Code)
			}
			if d.Idempotent != tt.idem {
				t.Errorf("Idempotent = %t, want %t", d.Idempotent, tt.idem)
			}
			if (d.Message == "") != (tt.want == OK) {
				t.Errorf("message %q with code %v", d.Message, d.Code)
			}
			if d.Reason != tt.reason {
				t.Errorf("reason = %q, want %q", d.Reason, tt.reason)
			}
			for _, s := range tt.mention {
				if !strings.Contains(d.Message, s) {
					t.Errorf("message %q does not contain %s", d.Message, s)
				}
			}
		})
	}
}

func TestCheckAttachFirstNode(t *testing.T) {
	for _, m := range All {
		for _, rw := range []string{"rw", "ro"} {
			if IsReadOnly(m) && rw == "rw" {
				continue // the caller passes the effective readonly
			}
			d := CheckAttach(nil, at("node-a", m, rw))
			if !d.Allowed() || d.Idempotent {
				t.Errorf("%v %s on an unheld volume: %+v, want plain OK", m, rw, d)
			}
		}
	}
}

// The spec: for a volume without MULTI_NODE capability, a second node gets
// FAILED_PRECONDITION and the message SHOULD carry the node_id of the node
// that holds it. Whatever the first node's mode.
func TestCheckAttachSingleNodeNamesHolder(t *testing.T) {
	singleNode := []Mode{SNW, SNRO, SNSW, SNMW}
	for _, asked := range singleNode {
		for _, held := range All {
			rw := "rw"
			if IsReadOnly(held) {
				rw = "ro"
			}
			holder := at("worker-7.example.com", held, rw)
			d := CheckAttach(holds(holder), at("worker-9", asked, "ro"))
			if d.Code != FP {
				t.Errorf("%v held, %v asked: code = %v, want FAILED_PRECONDITION", held, asked, d.Code)
				continue
			}
			if !strings.Contains(d.Message, "worker-7.example.com") {
				t.Errorf("%v held, %v asked: message %q does not name the holding node", held, asked, d.Message)
			}
			if d.Reason != ReasonHeldByOtherNode {
				t.Errorf("%v held, %v asked: reason %q, want %s", held, asked, d.Reason, ReasonHeldByOtherNode)
			}
		}
	}
}

// Whether two nodes may hold a volume together must not depend on which of
// them asked first: otherwise a reader that promised "nobody writes" could
// join a writer it would have kept out.
func TestCheckAttachOrderDoesNotMatter(t *testing.T) {
	var all []Attachment
	for _, m := range All {
		if !IsReadOnly(m) {
			all = append(all, Attachment{Mode: m, ReadOnly: false})
		}
		all = append(all, Attachment{Mode: m, ReadOnly: true})
	}
	for _, x := range all {
		for _, y := range all {
			x.Node, y.Node = node("node-x"), node("node-y")
			xy := CheckAttach(holds(x), y)
			yx := CheckAttach(holds(y), x)
			if xy.Allowed() != yx.Allowed() {
				t.Errorf("%s then %s: %v %q; the other way round: %v %q",
					describe(x), describe(y), xy.Code, xy.Message, yx.Code, yx.Message)
			}
		}
	}
}

// Three nodes, in every order: each allowed set of three is allowed whichever
// node comes last, and no refused request slips in through another order.
func TestCheckAttachThreeNodesOrderDoesNotMatter(t *testing.T) {
	var all []Attachment
	for _, m := range []Mode{MNRO, MNSW, MNMW} {
		if !IsReadOnly(m) {
			all = append(all, Attachment{Mode: m})
		}
		all = append(all, Attachment{Mode: m, ReadOnly: true})
	}
	build := func(order []Attachment) bool {
		var held []Attachment
		for _, a := range order {
			if !CheckAttach(held, a).Allowed() {
				return false
			}
			held = append(held, a)
		}
		return true
	}
	for _, a := range all {
		for _, b := range all {
			for _, c := range all {
				a.Node, b.Node, c.Node = node("node-a"), node("node-b"), node("node-c")
				orders := [][]Attachment{{a, b, c}, {a, c, b}, {b, a, c}, {b, c, a}, {c, a, b}, {c, b, a}}
				first := build(orders[0])
				for _, o := range orders[1:] {
					if build(o) != first {
						t.Errorf("%s, %s, %s: order %s,%s,%s gives %t, the first order %t",
							describe(a), describe(b), describe(c), o[0].Node.Name, o[1].Node.Name, o[2].Node.Name, build(o), first)
					}
				}
			}
		}
	}
}

// With MULTI_NODE_SINGLE_WRITER the number of writer nodes never exceeds
// one, whatever sequence of requests arrives.
func TestCheckAttachNeverTwoWriters(t *testing.T) {
	var held []Attachment
	for i := 0; i < 20; i++ {
		rw := "ro"
		if i%3 == 0 {
			rw = "rw"
		}
		req := at(fmt.Sprintf("node-%02d", i), MNSW, rw)
		if CheckAttach(held, req).Allowed() {
			held = append(held, req)
		}
	}
	writers := 0
	for _, h := range held {
		if !h.ReadOnly {
			writers++
		}
	}
	if writers != 1 {
		t.Errorf("%d writer nodes hold a MULTI_NODE_SINGLE_WRITER volume, want exactly 1", writers)
	}
	if len(held) != 1+13 {
		t.Errorf("%d nodes hold it, want the first writer and all 13 readers", len(held))
	}
}

func describe(a Attachment) string {
	rw := "rw"
	if a.ReadOnly {
		rw = "ro"
	}
	return a.Node.Name + ":" + Name(a.Mode) + ":" + rw
}

// fenced marks an attachment fenced.
func fenced(a Attachment) Attachment { a.Fenced = true; return a }

// TestServed: the storage serves every attachment but the fenced, in order.
func TestServed(t *testing.T) {
	a, b, c := at("a", MultiNodeMultiWriter, "rw"), fenced(at("b", MultiNodeMultiWriter, "rw")), at("c", MultiNodeMultiWriter, "ro")
	tests := []struct {
		name string
		in   []Attachment
		want []Attachment
	}{
		{"none", nil, nil},
		{"none fenced", holds(a, c), holds(a, c)},
		{"one fenced", holds(a, b, c), holds(a, c)},
		{"all fenced", holds(b), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Served(tt.in); !slices.Equal(got, tt.want) {
				t.Errorf("Served(%v) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

// TestSoleWriterLeft: which attachment changes must make a server drop the
// open files and locks of a volume's clients.
func TestSoleWriterLeft(t *testing.T) {
	tests := []struct {
		name     string
		old, now []Attachment
		want     bool
	}{
		{"RWO writer unpublished", holds(at("a", SingleNodeWriter, "rw")), nil, true},
		{"RWOP writer unpublished", holds(at("a", SingleNodeSingleWriter, "rw")), nil, true},
		{"single-node multi-writer unpublished", holds(at("a", SingleNodeMultiWriter, "rw")), nil, true},
		{"RWO published read-only, unpublished", holds(at("a", SingleNodeWriter, "ro")), nil, false},
		{"single-node reader unpublished", holds(at("a", SingleNodeReaderOnly, "ro")), nil, false},
		{"ROX reader leaves, others stay", holds(at("a", MultiNodeReaderOnly, "ro"), at("b", MultiNodeReaderOnly, "ro")),
			holds(at("b", MultiNodeReaderOnly, "ro")), false},
		{"MNSW writer leaves, reader stays", holds(at("w", MultiNodeSingleWriter, "rw"), at("r", MultiNodeSingleWriter, "ro")),
			holds(at("r", MultiNodeSingleWriter, "ro")), true},
		{"MNSW reader leaves, writer stays", holds(at("w", MultiNodeSingleWriter, "rw"), at("r", MultiNodeSingleWriter, "ro")),
			holds(at("w", MultiNodeSingleWriter, "rw")), false},
		{"MNSW reader joins", holds(at("w", MultiNodeSingleWriter, "rw")),
			holds(at("w", MultiNodeSingleWriter, "rw"), at("r", MultiNodeSingleWriter, "ro")), false},
		{"MNSW writer now read-only", holds(at("w", MultiNodeSingleWriter, "rw")),
			holds(at("w", MultiNodeSingleWriter, "ro")), true},
		{"the writer's node under a new address is the same writer", holds(atID("w@zone-a@10.0.0.1", MultiNodeSingleWriter, "rw")),
			holds(atID("w@zone-a@10.0.0.2", MultiNodeSingleWriter, "rw")), false},
		{"RWX writer leaves, another stays", holds(at("a", MultiNodeMultiWriter, "rw"), at("b", MultiNodeMultiWriter, "rw")),
			holds(at("b", MultiNodeMultiWriter, "rw")), false},
		{"last RWX writer leaves", holds(at("a", MultiNodeMultiWriter, "rw")), nil, false},
		{"first publish", nil, holds(at("a", SingleNodeWriter, "rw")), false},
		{"nothing changes", holds(at("a", SingleNodeWriter, "rw")), holds(at("a", SingleNodeWriter, "rw")), false},
		{"unknown mode", holds(Attachment{Node: node("a"), Mode: Mode(99)}), nil, false},
		{"RWO writer fenced", holds(at("a", SingleNodeWriter, "rw")), holds(fenced(at("a", SingleNodeWriter, "rw"))), true},
		{"fenced RWO writer unpublished", holds(fenced(at("a", SingleNodeWriter, "rw"))), nil, false},
		{"fenced RWO writer unfenced", holds(fenced(at("a", SingleNodeWriter, "rw"))), holds(at("a", SingleNodeWriter, "rw")), false},
		{"MNSW reader fenced, writer stays", holds(at("w", MultiNodeSingleWriter, "rw"), at("r", MultiNodeSingleWriter, "ro")),
			holds(at("w", MultiNodeSingleWriter, "rw"), fenced(at("r", MultiNodeSingleWriter, "ro"))), false},
		{"MNSW writer fenced, reader stays", holds(at("w", MultiNodeSingleWriter, "rw"), at("r", MultiNodeSingleWriter, "ro")),
			holds(fenced(at("w", MultiNodeSingleWriter, "rw")), at("r", MultiNodeSingleWriter, "ro")), true},
		{"one RWX writer fenced, another stays", holds(at("a", MultiNodeMultiWriter, "rw"), at("b", MultiNodeMultiWriter, "rw")),
			holds(fenced(at("a", MultiNodeMultiWriter, "rw")), at("b", MultiNodeMultiWriter, "rw")), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := SoleWriterLeft(tt.old, tt.now); got != tt.want {
				t.Errorf("SoleWriterLeft(%v, %v) = %t, want %t", tt.old, tt.now, got, tt.want)
			}
		})
	}
}

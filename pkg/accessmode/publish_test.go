package accessmode

import (
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

const (
	target1 = "/var/lib/kubelet/pods/1111/volumes/kubernetes.io~csi/pv-a/mount"
	target2 = "/var/lib/kubelet/pods/2222/volumes/kubernetes.io~csi/pv-a/mount"
)

var (
	OK  = codes.OK
	AE  = codes.AlreadyExists
	FP  = codes.FailedPrecondition
	INV = codes.InvalidArgument
)

func holder(target string, m Mode, readOnly bool, fingerprint string) Holder {
	return Holder{
		TargetPath:  target,
		Mode:        m,
		ReadOnly:    readOnly,
		Fingerprint: fingerprint,
		Workload:    Workload{Name: "first-0", Namespace: "team-a", UID: "1111"},
		Since:       time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
	}
}

// TestCheckPublish is the spec's second NodePublishVolume table (a plugin
// that advertises SINGLE_NODE_MULTI_WRITER): what a second NodePublishVolume
// of the same volume on the same node gets. T is the target path, P every
// other argument (the fingerprint; the readonly flag is part of it).
func TestCheckPublish(t *testing.T) {
	table := []struct {
		mode  Mode
		cells string // the four columns, "|"-separated, as the spec writes them
	}{
		//                        T1=T2, P1=P2    | T1=T2, P1!=P2  | T1!=T2, P1=P2       | T1!=T2, P1!=P2
		{SingleNodeSingleWriter, "OK (idempotent) | ALREADY_EXISTS | FAILED_PRECONDITION | FAILED_PRECONDITION"},
		{SingleNodeMultiWriter, " OK (idempotent) | ALREADY_EXISTS | OK                  | OK"},
		{MultiNodeReaderOnly, "   OK (idempotent) | ALREADY_EXISTS | OK                  | OK"},
		{MultiNodeSingleWriter, " OK (idempotent) | ALREADY_EXISTS | OK                  | OK"},
		{MultiNodeMultiWriter, "  OK (idempotent) | ALREADY_EXISTS | OK                  | OK"},
		// "Non MULTI_NODE_...": SINGLE_NODE_WRITER is accepted "subject to
		// the processing rules above", so it is held to one workload too.
		{SingleNodeWriter, "      OK (idempotent) | ALREADY_EXISTS | FAILED_PRECONDITION | FAILED_PRECONDITION"},
		{SingleNodeReaderOnly, "  OK (idempotent) | ALREADY_EXISTS | FAILED_PRECONDITION | FAILED_PRECONDITION"},
	}
	parse := func(cell string) (code codes.Code, idempotent bool) {
		switch strings.TrimSpace(cell) {
		case "OK (idempotent)":
			return OK, true
		case "OK":
			return OK, false
		case "ALREADY_EXISTS":
			return AE, false
		case "FAILED_PRECONDITION":
			return FP, false
		}
		t.Fatalf("bad cell %q", cell)
		return 0, false
	}
	covered := map[Mode]bool{}
	for _, row := range table {
		covered[row.mode] = true
		m := row.mode
		cells := strings.Split(row.cells, "|")
		if len(cells) != 4 {
			t.Fatalf("%v: %d cells, want 4", m, len(cells))
		}
		first := holder(target1, m, false, "fp-rw")
		columns := []struct {
			name string
			req  Holder
		}{
			{"T1=T2,P1=P2", holder(target1, m, false, "fp-rw")},
			{"T1=T2,P1!=P2", holder(target1, m, true, "fp-ro")},
			{"T1!=T2,P1=P2", holder(target2, m, false, "fp-rw")},
			{"T1!=T2,P1!=P2", holder(target2, m, true, "fp-ro")},
		}
		for i, col := range columns {
			want, wantIdem := parse(cells[i])
			t.Run(Name(m)+"/"+col.name, func(t *testing.T) {
				d := CheckPublish([]Holder{first}, col.req)
				if d.Code != want {
					t.Fatalf("code = %v (%q), want %v", d.Code, d.Message, want)
				}
				if d.Allowed() != (want == OK) {
					t.Errorf("Allowed() = %t with code %v", d.Allowed(), d.Code)
				}
				// Only a repeat at the same target with the same
				// arguments is idempotent: OK for another target
				// means "mount it there too".
				if d.Idempotent != wantIdem {
					t.Errorf("Idempotent = %t, want %t", d.Idempotent, wantIdem)
				}
				if (d.Message == "") != (want == OK) {
					t.Errorf("message %q with code %v: refusals explain themselves, OK says nothing", d.Message, d.Code)
				}
				if want != OK && !strings.Contains(d.Message, target1) {
					t.Errorf("message %q does not name the holder's target path %s", d.Message, target1)
				}
				wantReason := map[codes.Code]string{
					OK: "", AE: "PublishedWithOtherArguments", FP: "HeldByOtherWorkload",
				}[want]
				if d.Reason != wantReason {
					t.Errorf("reason = %q, want %q", d.Reason, wantReason)
				}
			})
		}
	}
	for _, m := range All {
		if !covered[m] {
			t.Errorf("the table has no row for %v", m)
		}
	}
}

func TestCheckPublishFirstPublishIsAllowed(t *testing.T) {
	for _, m := range All {
		for _, ro := range []bool{false, true} {
			d := CheckPublish(nil, holder(target1, m, ro, "fp"))
			if !d.Allowed() || d.Idempotent || d.Message != "" || d.Reason != "" {
				t.Errorf("%v readonly=%t on a node with no holder: %+v, want plain OK", m, ro, d)
			}
		}
	}
}

// COs SHOULD NOT publish one volume with two capabilities on one node; if it
// happens the plugin SHOULD return FAILED_PRECONDITION, whatever the modes.
func TestCheckPublishSecondTargetWithAnotherMode(t *testing.T) {
	for _, held := range All {
		for _, asked := range All {
			if held == asked {
				continue
			}
			t.Run(Name(held)+"_then_"+Name(asked), func(t *testing.T) {
				d := CheckPublish([]Holder{holder(target1, held, false, "fp-1")}, holder(target2, asked, false, "fp-2"))
				if d.Code != FP {
					t.Fatalf("code = %v (%q), want FAILED_PRECONDITION", d.Code, d.Message)
				}
				if !strings.Contains(d.Message, target1) {
					t.Errorf("message %q does not name the holder's target %s", d.Message, target1)
				}
				if !strings.Contains(d.Message, Name(held)) && !strings.Contains(d.Message, Name(asked)) {
					t.Errorf("message %q names neither mode", d.Message)
				}
				// One workload per node is the stronger rule and is named
				// first; otherwise the two modes are what is wrong.
				wantReason := "OtherAccessMode"
				if SingleWorkload(held) || SingleWorkload(asked) {
					wantReason = "HeldByOtherWorkload"
				}
				if d.Reason != wantReason {
					t.Errorf("reason = %q, want %q", d.Reason, wantReason)
				}
			})
		}
	}
}

func TestCheckPublishMessagesNameTheHolder(t *testing.T) {
	tests := []struct {
		name     string
		workload Workload
		want     string
	}{
		{"namespaced pod", Workload{Name: "db-0", Namespace: "prod", UID: "u-1"}, "pod prod/db-0"},
		{"pod without namespace", Workload{Name: "db-0"}, "pod db-0"},
		{"no pod info on mount", Workload{}, "an unnamed workload"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := holder(target1, SingleNodeSingleWriter, false, "fp")
			h.Workload = tt.workload
			req := holder(target2, SingleNodeSingleWriter, false, "fp")
			req.Workload = Workload{Name: "intruder", Namespace: "prod"}
			d := CheckPublish([]Holder{h}, req)
			if d.Code != FP || d.Reason != ReasonHeldByOtherWorkload {
				t.Fatalf("code = %v, reason %q, want FAILED_PRECONDITION, %s", d.Code, d.Reason, ReasonHeldByOtherWorkload)
			}
			for _, s := range []string{target1, tt.want, Name(SingleNodeSingleWriter)} {
				if !strings.Contains(d.Message, s) {
					t.Errorf("message %q does not contain %q", d.Message, s)
				}
			}
			if strings.Contains(d.Message, target2) {
				t.Errorf("message %q names the refused target, not the holder's", d.Message)
			}
		})
	}
}

// When one side allows a single workload and the other allows many, the
// message must blame the mode that actually forbids the second workload.
func TestCheckPublishMessageBlamesTheSingleWorkloadMode(t *testing.T) {
	tests := []struct{ held, asked, blamed Mode }{
		{SingleNodeSingleWriter, SingleNodeMultiWriter, SingleNodeSingleWriter},
		{SingleNodeMultiWriter, SingleNodeSingleWriter, SingleNodeSingleWriter},
		{SingleNodeReaderOnly, MultiNodeReaderOnly, SingleNodeReaderOnly},
		{MultiNodeMultiWriter, SingleNodeWriter, SingleNodeWriter},
	}
	for _, tt := range tests {
		d := CheckPublish([]Holder{holder(target1, tt.held, false, "a")}, holder(target2, tt.asked, false, "b"))
		if d.Code != FP {
			t.Errorf("%v then %v: code = %v, want FAILED_PRECONDITION", tt.held, tt.asked, d.Code)
			continue
		}
		if !strings.Contains(d.Message, Name(tt.blamed)+" allows one workload") {
			t.Errorf("%v then %v: message %q should say %s allows one workload", tt.held, tt.asked, d.Message, Name(tt.blamed))
		}
	}
}

func TestCheckPublishInvalidMode(t *testing.T) {
	for _, m := range invalidModes {
		for _, holders := range [][]Holder{nil, {holder(target1, m, false, "fp")}} {
			d := CheckPublish(holders, holder(target1, m, false, "fp"))
			if d.Code != INV {
				t.Errorf("mode %d with %d holders: code = %v, want INVALID_ARGUMENT", m, len(holders), d.Code)
			}
			if d.Message == "" || d.Idempotent || d.Reason != "InvalidMode" {
				t.Errorf("mode %d: %+v, want a message and reason InvalidMode", m, d)
			}
		}
	}
}

func TestCheckPublishManyHolders(t *testing.T) {
	target3 := "/var/lib/kubelet/pods/3333/volumes/kubernetes.io~csi/pv-a/mount"
	for _, m := range []Mode{SingleNodeMultiWriter, MultiNodeMultiWriter, MultiNodeSingleWriter, MultiNodeReaderOnly} {
		holders := []Holder{holder(target1, m, false, "fp-1"), holder(target2, m, true, "fp-2")}
		if d := CheckPublish(holders, holder(target3, m, false, "fp-3")); !d.Allowed() || d.Idempotent {
			t.Errorf("%v, third target: %+v, want OK", m, d)
		}
		// A repeat of the second holder is found, not mistaken for a
		// third workload.
		if d := CheckPublish(holders, holder(target2, m, true, "fp-2")); !d.Allowed() || !d.Idempotent {
			t.Errorf("%v, repeat of the second holder: %+v, want OK idempotent", m, d)
		}
		if d := CheckPublish(holders, holder(target2, m, false, "fp-1")); d.Code != AE || !strings.Contains(d.Message, target2) || d.Reason != ReasonPublishedWithOtherArguments {
			t.Errorf("%v, second target with other arguments: %+v, want ALREADY_EXISTS naming %s", m, d, target2)
		}
	}
}

// TestCheckWithinNode: what a node may allow is bounded by the mode the
// volume holds there. Read off the three limits of each mode (nodes, writer
// nodes, workloads per node): a request is within when it allows no more of
// any of them.
func TestCheckWithinNode(t *testing.T) {
	within := map[Mode][]Mode{
		SingleNodeWriter:       {SingleNodeWriter, SingleNodeReaderOnly, SingleNodeSingleWriter},
		SingleNodeReaderOnly:   {SingleNodeReaderOnly},
		MultiNodeReaderOnly:    {SingleNodeReaderOnly, MultiNodeReaderOnly},
		MultiNodeSingleWriter:  {SingleNodeWriter, SingleNodeReaderOnly, MultiNodeReaderOnly, MultiNodeSingleWriter, SingleNodeSingleWriter, SingleNodeMultiWriter},
		MultiNodeMultiWriter:   All,
		SingleNodeSingleWriter: {SingleNodeWriter, SingleNodeReaderOnly, SingleNodeSingleWriter},
		SingleNodeMultiWriter:  {SingleNodeWriter, SingleNodeReaderOnly, SingleNodeSingleWriter, SingleNodeMultiWriter},
	}
	for _, held := range All {
		for _, req := range All {
			d := CheckWithinNode(held, "attached", req)
			want := slices.Contains(within[held], req)
			if d.Allowed() != want {
				t.Errorf("held %s, asked %s: allowed=%t, want %t (%s)", Name(held), Name(req), d.Allowed(), want, d.Message)
			}
			if !want {
				if d.Code != codes.FailedPrecondition || d.Reason != ReasonBeyondNodeMode ||
					!strings.Contains(d.Message, Name(held)) || !strings.Contains(d.Message, Name(req)) {
					t.Errorf("held %s, asked %s: %+v; want FailedPrecondition naming both modes", Name(held), Name(req), d)
				}
			}
		}
	}
	if d := CheckWithinNode(0, "staged", SingleNodeWriter); d.Allowed() || d.Code != codes.FailedPrecondition {
		t.Errorf("an unknown held mode must refuse: %+v", d)
	}
	if d := CheckWithinNode(SingleNodeWriter, "staged", 99); d.Code != codes.InvalidArgument {
		t.Errorf("an undefined requested mode: %+v, want InvalidArgument", d)
	}
	// The whole publish rule: the attached and staged modes first, then
	// the spec's table.
	h := Holder{TargetPath: "/t/1", Mode: SingleNodeSingleWriter, Fingerprint: "a"}
	if d := CheckNodePublish(SingleNodeSingleWriter, SingleNodeSingleWriter, nil, Holder{TargetPath: "/t/1", Mode: SingleNodeMultiWriter}); d.Reason != ReasonBeyondNodeMode {
		t.Errorf("SINGLE_NODE_MULTI_WRITER publish of an RWOP attachment: %+v", d)
	}
	if d := CheckNodePublish(SingleNodeMultiWriter, SingleNodeSingleWriter, nil, Holder{TargetPath: "/t/1", Mode: SingleNodeMultiWriter}); d.Reason != ReasonBeyondNodeMode || !strings.Contains(d.Message, "staged") {
		t.Errorf("publish beyond the staged mode: %+v", d)
	}
	if d := CheckNodePublish(SingleNodeSingleWriter, SingleNodeSingleWriter, []Holder{h}, Holder{TargetPath: "/t/2", Mode: SingleNodeSingleWriter, Fingerprint: "a"}); d.Reason != ReasonHeldByOtherWorkload {
		t.Errorf("second RWOP workload: %+v", d)
	}
	if d := CheckNodePublish(SingleNodeSingleWriter, SingleNodeSingleWriter, []Holder{h}, h); !d.Allowed() || !d.Idempotent {
		t.Errorf("repeated publish: %+v", d)
	}
}

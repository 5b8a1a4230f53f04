package accessmode

import (
	"regexp"
	"slices"
	"testing"
)

// Reasons become metric labels: every refusal must carry one of the listed
// reasons, each CamelCase and listed once, and no allowed request one.
func TestReasonsAreBounded(t *testing.T) {
	camel := regexp.MustCompile(`^[A-Z][a-z]+(?:[A-Z][a-z]*)*$`)
	seen := map[string]bool{}
	for _, r := range Reasons {
		if !camel.MatchString(r) {
			t.Errorf("reason %q is not CamelCase", r)
		}
		if seen[r] {
			t.Errorf("reason %q listed twice", r)
		}
		seen[r] = true
	}
	check := func(what string, d Decision) {
		t.Helper()
		if d.Allowed() {
			if d.Reason != "" {
				t.Errorf("%s: allowed with reason %q", what, d.Reason)
			}
			return
		}
		if !slices.Contains(Reasons, d.Reason) {
			t.Errorf("%s: refused with reason %q, not one of %v", what, d.Reason, Reasons)
		}
	}
	modes := append(slices.Clone(All), invalidModes...)
	for _, x := range modes {
		for _, y := range modes {
			for _, ro := range []bool{false, true} {
				held := Attachment{Node: node("node-x"), Mode: x}
				check("attach, other node", CheckAttach([]Attachment{held}, Attachment{Node: node("node-y"), Mode: y, ReadOnly: ro}))
				check("attach, same node", CheckAttach([]Attachment{held}, Attachment{Node: node("node-x"), Mode: y, ReadOnly: ro}))
				h := Holder{TargetPath: "/t1", Mode: x, Fingerprint: "a"}
				check("publish, other target", CheckPublish([]Holder{h}, Holder{TargetPath: "/t2", Mode: y, ReadOnly: ro, Fingerprint: "b"}))
				check("publish, same target", CheckPublish([]Holder{h}, Holder{TargetPath: "/t1", Mode: y, ReadOnly: ro, Fingerprint: "b"}))
			}
		}
	}
}

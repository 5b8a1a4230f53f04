package accessmode

import (
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParse: whatever Parse accepts is one of the seven modes, and that
// mode's spec name, its number and Nomad's dashed name all parse back to
// it. An accepted ASCII input is one of those spellings (any case, '-' or
// '_', surrounding white space) and never a list or a padded-out value.
// Whatever it refuses yields 0 and an error listing what is accepted.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"SINGLE_NODE_WRITER",
		"single-node-writer",
		"Multi_Node-Reader_only",
		" 5 ",
		"0",
		"8",
		"+5",
		"4294967301",
		"SINGLE_NODE_WRITER,MULTI_NODE_READER_ONLY",
		"single node writer",
		"single-node-writer\x00",
		"UNKNOWN",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := Parse(s)
		if err != nil {
			if m != 0 {
				t.Fatalf("Parse(%q) failed (%v) but returned %v", s, err, m)
			}
			for _, want := range All {
				if !strings.Contains(err.Error(), Name(want)) {
					t.Fatalf("Parse(%q) error %q does not list %s", s, err, Name(want))
				}
			}
			return
		}
		if !Valid(m) {
			t.Fatalf("Parse(%q) = %v, not a defined mode", s, m)
		}
		dashed := strings.ToLower(strings.ReplaceAll(Name(m), "_", "-"))
		for _, spelling := range []string{Name(m), strconv.Itoa(int(m)), dashed} {
			if again, err := Parse(spelling); err != nil || again != m {
				t.Fatalf("Parse(%q) = %v, %v; want %v (from %q)", spelling, again, err, m, s)
			}
		}
		trimmed := strings.TrimSpace(s)
		if strings.ContainsAny(trimmed, ", \t\n\r\x00") {
			t.Fatalf("Parse(%q) = %v: accepted a list or a padded-out value", s, m)
		}
		if !isASCII(s) {
			return
		}
		norm := strings.ToUpper(strings.ReplaceAll(trimmed, "-", "_"))
		if n, err := strconv.ParseInt(trimmed, 10, 32); err == nil {
			if Mode(n) != m {
				t.Fatalf("Parse(%q) = %v, not mode number %d", s, m, n)
			}
		} else if norm != Name(m) {
			t.Fatalf("Parse(%q) = %v, but %q is no spelling of %s", s, m, trimmed, Name(m))
		}
	})
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

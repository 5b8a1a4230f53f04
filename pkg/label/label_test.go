package label

import (
	"strings"
	"testing"
)

func TestValidValue(t *testing.T) {
	tests := []struct {
		in string
		ok bool
	}{
		{"zone-a", true},
		{"a", true},
		{"Node_1.example", true},
		{strings.Repeat("a", 63), true},
		{"", false},
		{strings.Repeat("a", 64), false},
		{"-a", false},
		{"a.", false},
		{"a@b", false},
		{"a/b", false},
		{"..", false},
		{"a b", false},
		{"a\n", false},
	}
	for _, tt := range tests {
		if got := ValidValue(tt.in); got != tt.ok {
			t.Errorf("ValidValue(%q) = %t, want %t", tt.in, got, tt.ok)
		}
	}
}

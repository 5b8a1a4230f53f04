package iqn

import (
	"strings"
	"testing"
)

func TestValid(t *testing.T) {
	tests := []struct {
		in string
		ok bool
	}{
		{"iqn.1993-08.org.debian:01:56e0e55b7367", true},
		{"iqn.2026-11.io.example", true},
		{"iqn.2026-11.io.example:worker-1", true},
		{"iqn.2026-11.io.example:" + strings.Repeat("w", MaxLength-len("iqn.2026-11.io.example:")), true},
		{"iqn.2026-11.io.example:" + strings.Repeat("w", MaxLength-len("iqn.2026-11.io.example:")+1), false},
		{"", false},
		{"iqn.2026-11.io.Example:a", false},
		{"iqn.2026-13.io.example", false},
		{"iqn.2026-00.io.example", false},
		{"iqn.26-11.io.example", false},
		{"iqn.2026-11.-io.example", false},
		{"iqn.2026-11.io.example:a@b", false},
		{"iqn.2026-11.io.example:a b", false},
		{"eui.02004567A425678D", false},
		{"--login", false},
	}
	for _, tt := range tests {
		if got := Valid(tt.in); got != tt.ok {
			t.Errorf("Valid(%q) = %t, want %t", tt.in, got, tt.ok)
		}
	}
}

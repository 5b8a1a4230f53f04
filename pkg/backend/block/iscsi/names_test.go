package iscsi

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestReadInitiatorName(t *testing.T) {
	for _, tc := range []struct {
		name, file string
		want       string // the name, or part of the error when err
		err        bool
	}{
		{"Debian's file", "## DO NOT EDIT OR REMOVE THIS FILE!\n## If you remove this file, the iSCSI daemon will not start.\nInitiatorName=iqn.1993-08.org.debian:01:56e0e55b7367\n", "iqn.1993-08.org.debian:01:56e0e55b7367", false},
		{"blanks around", "  InitiatorName = iqn.2026-11.io.example:node-1  \n", "iqn.2026-11.io.example:node-1", false},
		{"commented out", "#InitiatorName=iqn.2026-11.io.example:old\nInitiatorName=iqn.2026-11.io.example:new\n", "iqn.2026-11.io.example:new", false},
		{"alias ignored", "InitiatorAlias=node-1\nInitiatorName=iqn.2026-11.io.example:node-1\n", "iqn.2026-11.io.example:node-1", false},
		{"no name", "## nothing here\n", "no InitiatorName", true},
		{"empty name", "InitiatorName=\n", "no InitiatorName", true},
		{"two names", "InitiatorName=iqn.2026-11.io.example:a\nInitiatorName=iqn.2026-11.io.example:b\n", "more than one", true},
		{"upper case", "InitiatorName=iqn.2026-11.io.Example:a\n", "not an IQN", true},
		{"generator template", "GenerateName=yes\n", "no InitiatorName", true},
		{"an EUI name", "InitiatorName=eui.02004567A425678D\n", "not an IQN", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "initiatorname.iscsi")
			if err := os.WriteFile(path, []byte(tc.file), 0o600); err != nil {
				t.Fatal(err)
			}
			got, err := ReadInitiatorName(path)
			switch {
			case tc.err && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %q, %v; want an error about %q", got, err, tc.want)
			case !tc.err && (err != nil || got != tc.want):
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	if _, err := ReadInitiatorName(filepath.Join(t.TempDir(), "missing")); err == nil || !strings.Contains(err.Error(), "open-iscsi") {
		t.Fatalf("a missing file: %v, want an error saying open-iscsi writes it", err)
	}
}

func TestValidSerial(t *testing.T) {
	for s, want := range map[string]bool{
		"6d672d766f6c2d310000000000000001": true,
		"6D672D766F6C2D310000000000000001": false, // one spelling, so serials compare as strings
		"mg-vol-a":                         false, // LIO would name it naa.6001405a...
		strings.Repeat("0", 31):            false,
		strings.Repeat("0", 33):            false,
		"":                                 false,
	} {
		if got := ValidSerial(s); got != want {
			t.Errorf("ValidSerial(%q) = %v, want %v", s, got, want)
		}
	}
}

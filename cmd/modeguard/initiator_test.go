package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A node told where open-iscsi keeps its initiator name refuses to start
// when the name is not there or is not an IQN, rather than reporting an id
// that no target's access list could hold.
func TestNodeRefusesABadInitiatorNameFile(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "initiatorname.iscsi")
	if err := os.WriteFile(bad, []byte("InitiatorName=Not-An-IQN\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, file := range map[string]string{"not an IQN": bad, "missing": filepath.Join(dir, "missing")} {
		t.Run(name, func(t *testing.T) {
			o, err := parseFlags([]string{"--roles", "node", "--node-id", "worker-1", "--zone", "zone-a",
				"--state-dir", filepath.Join(dir, "state"), "--block-pool", "zone-a=" + dir, "--iscsi-initiator-name-file", file})
			if err != nil {
				t.Fatal(err)
			}
			err = run(o)
			if err == nil || !strings.Contains(err.Error(), "initiator name") {
				t.Fatalf("run = %v, want a refusal naming the initiator name", err)
			}
		})
	}
}

// A node that reports an initiator name but has no CHAP secret to log in
// with does not start: every target would refuse it.
func TestNodeWithAnInitiatorNameNeedsItsCHAPSecret(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "initiatorname.iscsi")
	if err := os.WriteFile(name, []byte("InitiatorName=iqn.2026-11.dev.example:worker-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []string{"--roles", "node", "--node-id", "worker-1", "--zone", "zone-a",
		"--state-dir", filepath.Join(dir, "state"), "--iscsi-initiator-name-file", name}
	for _, tc := range []struct {
		name, want string
		extra      []string
	}{
		{"no secret file", "--iscsi-chap-secret-file", nil},
		{"missing secret file", "CHAP secret", []string{"--iscsi-chap-secret-file", filepath.Join(dir, "missing")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseFlags(append(append([]string{}, base...), tc.extra...))
			if err != nil {
				t.Fatal(err)
			}
			if err := run(o); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("run = %v, want a refusal naming %q", err, tc.want)
			}
		})
	}
}

func TestBlockTargetFlag(t *testing.T) {
	for _, tc := range []struct {
		arg  string
		want string // "" for accepted
	}{
		{"zone-a=10.0.0.5:9443", ""},
		{"zone-a=target.zone-a.svc:9443", ""},
		{"zone-a=[fd00::5]:9443", ""},
		{"zone-a=unix:///run/modeguard/target.sock", ""},
		{"zone-a=unix://run/target.sock", "absolute path"},
		{"zone-a=10.0.0.5", "neither HOST:PORT"},
		{"zone-a=", "want ZONE="},
		{"zone a=10.0.0.5:9443", "not a valid zone"},
	} {
		t.Run(tc.arg, func(t *testing.T) {
			_, err := parseFlags([]string{"--roles", "controller", "--block-target", tc.arg})
			if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("--block-target %s: %v, want %q", tc.arg, err, tc.want)
			}
		})
	}
	if _, err := parseFlags([]string{"--block-target", "zone-a=h:1", "--block-target", "zone-a=h:2"}); err == nil || !strings.Contains(err.Error(), "two targets") {
		t.Fatalf("two targets of one zone: %v", err)
	}
}

// A target served on TCP without the files of mutual TLS does not start:
// it would serve its pool to anyone who can reach the port.
func TestTargetOnTCPNeedsMutualTLS(t *testing.T) {
	dir := t.TempDir()
	o, err := parseFlags([]string{"--roles", "target", "--block-pool", "zone-a=" + dir, "--target-endpoint", "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := run(o); err == nil || !strings.Contains(err.Error(), "mutual TLS") {
		t.Fatalf("run = %v, want a refusal asking for mutual TLS", err)
	}
}

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

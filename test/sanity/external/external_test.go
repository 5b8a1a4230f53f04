// Package external runs csi-sanity the way other drivers are judged by it:
// the csi-sanity command of csi-test v5 (built from the module proxy at the
// version go.mod pins) against the modeguard binary serving controller and
// node on one socket, for mount and for raw block volumes.
package external

import (
	"context"
	"encoding/xml"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modeguard/modeguard/test/testenv"
)

// skippedFor are the only specs csi-sanity may skip, each for a feature the
// driver does not have (the README lists them): per-node storage health
// (NodeGetVolumeHealth is offered instead) and snapshots constrained to a
// topology (a restore may go to any zone).
var skippedFor = []string{
	"NodeGetStorageHealth",
	"creating a snapshot with accessibility requirements",
}

// junit is the part of a JUnit report this test reads.
type junit struct {
	Suites []struct {
		Cases []struct {
			Name    string    `xml:"name,attr"`
			Status  string    `xml:"status,attr"`
			Failure *struct{} `xml:"failure"`
			Error   *struct{} `xml:"error"`
			Skipped *struct{} `xml:"skipped"`
		} `xml:"testcase"`
	} `xml:"testsuite"`
}

func TestCSISanityCommand(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	tools := t.TempDir()
	sanityBin := filepath.Join(tools, "csi-sanity")
	if out, err := exec.Command("go", "build", "-o", sanityBin, "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity").CombinedOutput(); err != nil {
		t.Fatalf("building csi-sanity: %v\n%s", err, out)
	}
	for _, accessType := range []string{"mount", "block"} {
		t.Run(accessType, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			root := testenv.Tmpfs(t, "768m")
			for _, d := range []string{"pool", "state"} {
				if err := os.MkdirAll(filepath.Join(root, d), 0o700); err != nil {
					t.Fatal(err)
				}
			}
			// The host's own network namespace: nothing here needs one of
			// its own.
			driver := testenv.NewController(t, bin, "/proc/self/ns/net", root,
				"--roles", "controller,node", "--node-id", "sanity-node", "--zone", "zone-a",
				"--block-pool", "zone-a="+filepath.Join(root, "pool"), "--block-pool-filesystem=direct", "--state-dir", filepath.Join(root, "state"),
				"--max-volumes-per-node", "16")
			driver.Start(ctx)
			t.Cleanup(func() {
				driver.Stop()
				if t.Failed() {
					t.Logf("driver log:\n%s", testenv.ReadFile(driver.Log))
				}
			})
			mutable := filepath.Join(root, "mutable.yaml")
			if err := os.WriteFile(mutable, []byte("readAheadKiB: \"512\"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			report := filepath.Join(root, "junit.xml")
			cmd := exec.CommandContext(ctx, sanityBin,
				"-csi.endpoint", driver.Endpoint,
				"-csi.stagingdir", filepath.Join(root, "staging"), "-csi.mountdir", filepath.Join(root, "target"),
				"-csi.testvolumeaccesstype", accessType,
				"-csi.testvolumesize", "16777216", "-csi.testvolumeexpandsize", "33554432",
				"-csi.testvolumemutableparameters", mutable,
				"-csi.testnodevolumeattachlimit",
				"-ginkgo.junit-report", report)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("csi-sanity: %v\n%s", err, out)
			}
			data, err := os.ReadFile(report)
			if err != nil {
				t.Fatal(err)
			}
			var r junit
			if err := xml.Unmarshal(data, &r); err != nil {
				t.Fatalf("reading %s: %v", report, err)
			}
			passed := 0
			var skipped []string
			for _, s := range r.Suites {
				for _, c := range s.Cases {
					switch {
					case c.Failure != nil || c.Error != nil:
						t.Errorf("failed: %s", c.Name)
					case c.Skipped != nil || c.Status == "skipped" || c.Status == "pending":
						if c.Status != "pending" {
							skipped = append(skipped, c.Name)
						}
					default:
						passed++
					}
				}
			}
			for _, name := range skipped {
				if !slices.ContainsFunc(skippedFor, func(s string) bool { return strings.Contains(name, s) }) {
					t.Errorf("skipped a spec for a feature the driver has: %s", name)
				}
			}
			if len(skipped) > len(skippedFor) {
				t.Errorf("%d specs skipped, want at most %d: %v", len(skipped), len(skippedFor), skipped)
			}
			t.Logf("csi-sanity command, %s: %d passed, %d skipped", accessType, passed, len(skipped))
			if passed < 100 {
				t.Errorf("only %d specs passed; the suite has 100 for the features the driver offers", passed)
			}
		})
	}
}

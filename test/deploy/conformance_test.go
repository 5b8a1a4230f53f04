package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// Kubernetes' storage suites read the driver files of test/conformance as
// they are: an unknown key is ignored, a missing class file fails every spec
// at its start, and a skip nobody explains hides a failure. These tests keep
// each driver file runnable by hack/conformance/run.sh and each skip
// explained in docs/conformance.md.

// driverFile is what the suites' external driver reads of a driver file
// (k8s.io/kubernetes test/e2e/storage/external), as far as these tests look.
type driverFile struct {
	StorageClass struct {
		FromFile string
	}
	VolumeAttributesClass struct {
		FromFile string
	}
	DriverInfo struct {
		Name         string
		Capabilities map[string]bool
	}
}

// knownCapabilities are the Cap* values of Kubernetes v1.34's storage
// framework (test/e2e/storage/framework/testdriver.go): a capability spelt
// otherwise is read as false, silently.
var knownCapabilities = map[string]bool{
	"persistence": true, "block": true, "fsGroup": true, "volumeMountGroup": true, "exec": true,
	"snapshotDataSource": true, "pvcDataSource": true, "multipods": true, "RWX": true,
	"controllerExpansion": true, "nodeExpansion": true, "offlineExpansion": true,
	"onlineExpansion": true, "volumeLimits": true, "singleNodeVolume": true, "topology": true,
	"multiplePVsSameID": true, "readWriteOncePod": true, "capReadOnlyMany": true,
	"capacity": true, "groupSnapshot": true, "FSResizeFromSourceNotSupported": true,
}

// TestConformanceDriverFilesRun: every driver file names the driver, only
// capabilities the suites know, and class files that exist; run.sh accepts
// its name as DRIVER.
func TestConformanceDriverFilesRun(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(repo(t), "test", "conformance", "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	runSh := readFile(t, "hack/conformance/run.sh")
	accepted := regexp.MustCompile(`(?m)^\s*([a-z|-]+)\) ;;$`).FindStringSubmatch(runSh)
	if accepted == nil {
		t.Fatal("hack/conformance/run.sh: no case accepting the DRIVER names")
	}
	drivers := 0
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".yaml")
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var d driverFile
		if err := yaml.Unmarshal(data, &d); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if d.DriverInfo.Name == "" {
			continue // a class, not a driver file
		}
		drivers++
		t.Run(name, func(t *testing.T) {
			if d.DriverInfo.Name != "modeguard.csi.dev" {
				t.Errorf("DriverInfo.Name %q, want modeguard.csi.dev", d.DriverInfo.Name)
			}
			for c := range d.DriverInfo.Capabilities {
				if !knownCapabilities[c] {
					t.Errorf("capability %q is not one the suites know: it would be read as false", c)
				}
			}
			for _, ref := range []string{d.StorageClass.FromFile, d.VolumeAttributesClass.FromFile} {
				if ref == "" {
					continue
				}
				if _, err := os.Stat(filepath.Join(repo(t), ref)); err != nil {
					t.Errorf("it names %s (run.sh passes -repo-root, so relative to the repository): %v", ref, err)
				}
			}
			base, _, _ := strings.Cut(name, "-group")
			if !strings.Contains("|"+accepted[1]+"|", "|"+base+"|") {
				t.Errorf("hack/conformance/run.sh accepts DRIVER %s, not %s", accepted[1], base)
			}
		})
	}
	if drivers < 3 {
		t.Fatalf("found %d driver files in test/conformance, want block, nfs and iscsi at least", drivers)
	}
}

// TestConformanceSkipsAreExplained: every spec a skip file keeps from
// running is named in docs/conformance.md, where the reason is.
func TestConformanceSkipsAreExplained(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(repo(t), "test", "conformance", "skip-*.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no skip file in test/conformance")
	}
	doc := readFile(t, "docs/conformance.md")
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			line = strings.TrimSpace(line)
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if _, err := regexp.Compile(line); err != nil {
				t.Errorf("%s: %q is not a regular expression: %v", filepath.Base(f), line, err)
			}
			if !strings.Contains(doc, line) {
				t.Errorf("%s skips %q, which docs/conformance.md does not explain", filepath.Base(f), line)
			}
		}
	}
}

package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestVMStoriesRunInMakeTestE2EVM: every story of test/e2e that needs the
// VM cluster's nodes (it starts with nfsNodes or iscsiTargets, and skips
// anywhere else) is one E2E_VM_TESTS selects: a story left out of it would
// run nowhere.
func TestVMStoriesRunInMakeTestE2EVM(t *testing.T) {
	m := regexp.MustCompile(`(?m)^E2E_VM_TESTS := (.+)$`).FindStringSubmatch(readFile(t, "Makefile"))
	if m == nil {
		t.Fatal("Makefile: no E2E_VM_TESTS")
	}
	selects, err := regexp.Compile(strings.ReplaceAll(m[1], "$$", "$"))
	if err != nil {
		t.Fatalf("E2E_VM_TESTS: %v", err)
	}
	files, err := filepath.Glob(filepath.Join(repo(t), "test", "e2e", "*_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	story := regexp.MustCompile(`(?m)^func (Test\w+)\(t \*testing\.T\) \{\n\t(?:nfsNodes|iscsiTargets)\(t\)`)
	found := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range story.FindAllStringSubmatch(string(data), -1) {
			found++
			if !selects.MatchString(s[1]) {
				t.Errorf("%s (%s) needs the VM cluster, and E2E_VM_TESTS does not select it", s[1], filepath.Base(f))
			}
		}
	}
	if found < 8 {
		t.Fatalf("found %d stories that need the VM cluster, want the NFS and iSCSI ones", found)
	}
}

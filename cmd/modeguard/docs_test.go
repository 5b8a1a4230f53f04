package main

import (
	"flag"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/inspect"
)

// docsWithCommands are the documents that give modeguard command lines to
// type: the operator's README, the chart's notes and the docs.
func docsWithCommands(t *testing.T) map[string]string {
	t.Helper()
	paths := []string{"../../README.md", "../../deploy/helm/modeguard/README.md", "../../deploy/helm/modeguard/templates/NOTES.txt"}
	more, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	docs := map[string]string{}
	for _, p := range append(paths, more...) {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		// A command continued over lines is one command.
		docs[p] = strings.ReplaceAll(string(b), "\\\n", " ")
	}
	return docs
}

// flagsOf are the flags a command line gives, without their values.
func flagsOf(command string) []string {
	var out []string
	for _, f := range strings.Fields(command) {
		if !strings.HasPrefix(f, "-") || f == "-" || f == "--" {
			continue
		}
		name := strings.TrimLeft(f, "-")
		name, _, _ = strings.Cut(name, "=")
		if regexp.MustCompile(`^[a-z][a-z0-9-]*$`).MatchString(name) {
			out = append(out, name)
		}
	}
	return out
}

// TestDocumentedCommandsUseRealFlags: every `modeguard inspect` and
// `modeguard --flag` command line in the documentation uses only flags the
// binary has, so a renamed or removed flag cannot leave a recipe that
// fails when an operator pastes it.
func TestDocumentedCommandsUseRealFlags(t *testing.T) {
	serve := flagSet(&options{pools: poolFlag{}, targets: targetFlag{}})
	var o inspect.Options
	var stateDirs stringsFlag
	var asJSON bool
	inspectFlags := inspectFlagSet(&o, poolFlag{}, &stateDirs, &asJSON)
	// A command ends at a pipe, a closing backtick or quote, or the line.
	inspectCmd := regexp.MustCompile("modeguard inspect([^`|\n]*)")
	serveCmd := regexp.MustCompile("(?m)(?:^|[`$] ?)modeguard((?: +--?[a-z][^`|\n]*))")
	checked := 0
	for path, text := range docsWithCommands(t) {
		for _, m := range inspectCmd.FindAllStringSubmatch(text, -1) {
			for _, f := range flagsOf(m[1]) {
				checked++
				if inspectFlags.Lookup(f) == nil {
					t.Errorf("%s: `modeguard inspect%s` uses --%s, which modeguard inspect does not have", path, m[1], f)
				}
			}
		}
		for _, m := range serveCmd.FindAllStringSubmatch(text, -1) {
			for _, f := range flagsOf(m[1]) {
				checked++
				if serve.Lookup(f) == nil {
					t.Errorf("%s: `modeguard%s` uses --%s, which modeguard does not have", path, m[1], f)
				}
			}
		}
	}
	if checked < 10 {
		t.Fatalf("found only %d flags in the documented commands: the patterns no longer find the commands", checked)
	}
}

// TestReferenceListsEveryFlag: the reference's flag table has a row for
// each flag of modeguard, and no row for a flag it does not have.
func TestReferenceListsEveryFlag(t *testing.T) {
	b, err := os.ReadFile("../../docs/reference.md")
	if err != nil {
		t.Fatal(err)
	}
	// Rows: | `--flag`[, `--other`] | default | meaning |; Kubernetes'
	// logging flags other than the two the table has rows for are named
	// in the meaning of --logging-format's.
	row := regexp.MustCompile("(?m)^\\| (`-[^|]+) \\|(.*)$")
	documented := map[string]bool{}
	mentioned := map[string]bool{}
	for _, m := range row.FindAllStringSubmatch(string(b), -1) {
		for _, f := range regexp.MustCompile("`--?([a-z][a-z0-9-]*)").FindAllStringSubmatch(m[1], -1) {
			documented[f[1]] = true
		}
		for _, f := range regexp.MustCompile("`--?([a-z][a-z0-9-]*)`").FindAllStringSubmatch(m[2], -1) {
			mentioned[f[1]] = true
		}
	}
	var have []string
	fs := flagSet(&options{pools: poolFlag{}, targets: targetFlag{}})
	fs.VisitAll(func(f *flag.Flag) { have = append(have, f.Name) })
	for _, name := range have {
		if !documented[name] && !mentioned[name] {
			t.Errorf("docs/reference.md has no row for --%s", name)
		}
	}
	for name := range documented {
		if !slices.Contains(have, name) {
			t.Errorf("docs/reference.md has a row for --%s, which modeguard does not have", name)
		}
	}
}

// TestFailureModelNamesRealTests: every test the operator guide's failure
// model names exists, so that the table cannot promise what nothing shows.
func TestFailureModelNamesRealTests(t *testing.T) {
	guide, err := os.ReadFile("../../docs/operator-guide.md")
	if err != nil {
		t.Fatal(err)
	}
	section, ok := strings.CutPrefix(string(guide)[strings.Index(string(guide), "## Failure model"):], "## Failure model")
	if !ok {
		t.Fatal("the operator guide has no failure model")
	}
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	named := regexp.MustCompile("`(Test[A-Za-z0-9_]+)`").FindAllStringSubmatch(section, -1)
	if len(named) == 0 {
		t.Fatal("the failure model names no test")
	}
	defined := map[string]bool{}
	decl := regexp.MustCompile(`(?m)^func (Test[A-Za-z0-9_]+)\(`)
	err = filepath.WalkDir("../..", func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.IsDir() && (e.Name() == "_build" || e.Name() == ".git") {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range decl.FindAllStringSubmatch(string(src), -1) {
			defined[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range named {
		if !defined[m[1]] {
			t.Errorf("the failure model names %s, which no test file defines", m[1])
		}
	}
}

package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"sigs.k8s.io/yaml"
)

// The README is what an operator reads first; these tests keep each
// command, path, link and value it names true of the tree, so that it
// cannot go stale silently. (The flags of the modeguard commands it gives
// are checked in cmd/modeguard, against the binary's own flag sets.)

func readFile(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repo(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// documents are the Markdown files operators and developers read.
func documents(t *testing.T) []string {
	t.Helper()
	docs := []string{"README.md", "deploy/helm/modeguard/README.md", "hack/local-cluster/README.md"}
	more, err := filepath.Glob(filepath.Join(repo(t), "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range more {
		docs = append(docs, filepath.Join("docs", filepath.Base(p)))
	}
	return docs
}

// TestREADMEOpensWithItsTwoCommands: the README's first code block runs
// the driver's main job here and the whole test suite, and the README
// stays a page an operator reads to the end.
func TestREADMEOpensWithItsTwoCommands(t *testing.T) {
	readme := readFile(t, "README.md")
	first := regexp.MustCompile("(?s)```sh\n(.*?)```").FindStringSubmatch(readme)
	if first == nil {
		t.Fatal("the README has no sh code block")
	}
	var commands []string
	for _, line := range strings.Split(first[1], "\n") {
		if cmd, _, _ := strings.Cut(line, "#"); strings.TrimSpace(cmd) != "" {
			commands = append(commands, strings.TrimSpace(cmd))
		}
	}
	if !slices.Equal(commands, []string{"make cluster-up", "make test"}) {
		t.Errorf("the README's first code block runs %q, want the main job (make cluster-up) and the tests (make test)", commands)
	}
	if strings.Index(readme, "```sh") > 200 {
		t.Errorf("the two commands start at byte %d of the README: they belong at its top", strings.Index(readme, "```sh"))
	}
	if n := strings.Count(readme, "\n"); n > 260 {
		t.Errorf("the README has %d lines; it is the operator's page (about 250): move reference material to docs/", n)
	}
	for _, placeholder := range regexp.MustCompile(`\b[A-Z]{3,}_[A-Z_]{3,}\b`).FindAllString(readme, -1) {
		if !strings.HasPrefix(placeholder, "KUBE") && !strings.HasPrefix(placeholder, "SINGLE_") && !strings.HasPrefix(placeholder, "MULTI_") &&
			!strings.HasPrefix(placeholder, "FAILED_") && !strings.HasPrefix(placeholder, "INVALID_") && !strings.HasPrefix(placeholder, "RESOURCE_") {
			t.Errorf("the README still holds the placeholder %s", placeholder)
		}
	}
}

// TestDocumentedMakeTargetsExist: every `make TARGET` the documents name
// is a target of the Makefile.
func TestDocumentedMakeTargetsExist(t *testing.T) {
	makefile := readFile(t, "Makefile")
	targets := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^([A-Za-z0-9_.-]+)( [A-Za-z0-9_.-]+)*:`).FindAllStringSubmatch(makefile, -1) {
		targets[m[1]] = true
	}
	use := regexp.MustCompile("(?:^|[`(;&|] *|\\$ )make ([a-z][a-z0-9-]*)")
	checked := 0
	for _, doc := range documents(t) {
		for _, line := range strings.Split(readFile(t, doc), "\n") {
			for _, m := range use.FindAllStringSubmatch(strings.TrimSpace(line), -1) {
				checked++
				if !targets[m[1]] {
					t.Errorf("%s names `make %s`, which the Makefile has no target for", doc, m[1])
				}
			}
		}
	}
	if checked < 5 {
		t.Fatalf("found only %d make targets in the documents: the pattern no longer finds them", checked)
	}
}

// slug is GitHub's anchor for a heading.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func anchors(markdown string) map[string]bool {
	out := map[string]bool{}
	inCode := false
	for _, line := range strings.Split(markdown, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
		}
		if !inCode && strings.HasPrefix(line, "#") {
			out[slug(strings.TrimSpace(strings.TrimLeft(line, "#")))] = true
		}
	}
	return out
}

// TestDocumentLinksResolve: every relative link of the documents names a
// file or directory of the tree, and every #anchor a heading of its file.
func TestDocumentLinksResolve(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, doc := range documents(t) {
		text := readFile(t, doc)
		for _, m := range link.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			resolved := doc
			if file != "" {
				resolved = filepath.Join(filepath.Dir(doc), file)
				if _, err := os.Stat(filepath.Join(repo(t), resolved)); err != nil {
					t.Errorf("%s links to %s, which does not exist", doc, target)
					continue
				}
			}
			if anchor != "" && strings.HasSuffix(resolved, ".md") && !anchors(readFile(t, resolved))[anchor] {
				t.Errorf("%s links to %s, but %s has no heading #%s", doc, target, resolved, anchor)
			}
		}
	}
}

// TestREADMEPathsExist: every path of the tree the README names in code
// exists.
func TestREADMEPathsExist(t *testing.T) {
	readme := readFile(t, "README.md")
	path := regexp.MustCompile(`(?:^|[\s` + "`" + `(])((?:cmd|pkg|deploy|hack|test|docs|\.ci)/[A-Za-z0-9_./-]*[A-Za-z0-9_/])`)
	checked := 0
	for _, m := range path.FindAllStringSubmatchIndex(readme, -1) {
		p := readme[m[2]:m[3]]
		if strings.HasSuffix(readme[:m[2]], "exec ") {
			continue // kubectl's deploy/NAME, not a path
		}
		checked++
		if _, err := os.Stat(filepath.Join(repo(t), p)); err != nil {
			t.Errorf("the README names %s, which does not exist", p)
		}
	}
	if checked < 10 {
		t.Fatalf("found only %d paths in the README: the pattern no longer finds them", checked)
	}
}

func chartValues(t *testing.T) map[string]any {
	t.Helper()
	var values map[string]any
	if err := yaml.Unmarshal([]byte(readFile(t, "deploy/helm/modeguard/values.yaml")), &values); err != nil {
		t.Fatal(err)
	}
	return values
}

// hasValue says whether a dotted key (zones[0].name allowed) is a value of
// the chart.
func hasValue(values map[string]any, key string) bool {
	var cur any = values
	for _, part := range strings.Split(key, ".") {
		name, index, isList := strings.Cut(part, "[")
		m, ok := cur.(map[string]any)
		if !ok {
			return false
		}
		if cur, ok = m[name]; !ok {
			return false
		}
		if isList {
			list, ok := cur.([]any)
			if !ok || len(list) == 0 || !strings.HasSuffix(index, "]") {
				return false
			}
			cur = list[0]
		}
	}
	return true
}

// TestREADMEValuesAreTheChartsValues: every value the README sets (with
// --set, or in the values file it shows) is one of the chart's, and every
// StorageClass it tells operators to pick is one the chart makes.
func TestREADMEValuesAreTheChartsValues(t *testing.T) {
	readme := readFile(t, "README.md")
	values := chartValues(t)
	checked := 0
	for _, m := range regexp.MustCompile(`--set '?([A-Za-z0-9_.\[\]]+)=`).FindAllStringSubmatch(readme, -1) {
		checked++
		if !hasValue(values, m[1]) {
			t.Errorf("the README sets %s, which is not a value of the chart", m[1])
		}
	}
	block := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindStringSubmatch(readme)
	if block == nil {
		t.Fatal("the README shows no values file")
	}
	var shown map[string]any
	if err := yaml.Unmarshal([]byte(block[1]), &shown); err != nil {
		t.Fatalf("the README's values file does not parse: %v", err)
	}
	var walk func(prefix string, v any)
	walk = func(prefix string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, sub := range v {
				walk(strings.TrimPrefix(prefix+"."+k, "."), sub)
			}
		case []any:
			if len(v) > 0 {
				walk(prefix+"[0]", v[0])
			}
		default:
			checked++
			if !hasValue(values, prefix) {
				t.Errorf("the README's values file sets %s, which is not a value of the chart", prefix)
			}
		}
	}
	walk("", shown)
	classes := values["storageClasses"].(map[string]any)
	var names []string
	for _, c := range classes {
		names = append(names, c.(map[string]any)["name"].(string))
	}
	for _, m := range regexp.MustCompile("\\| `(modeguard-[a-z]+)`").FindAllStringSubmatch(readme, -1) {
		checked++
		if !slices.Contains(names, m[1]) {
			t.Errorf("the README tells operators to pick StorageClass %s; the chart makes %v", m[1], names)
		}
	}
	if checked < 8 {
		t.Fatalf("found only %d values and classes in the README: the patterns no longer find them", checked)
	}
}

// TestREADMEInspectRecipeMatchesTheChart: each `kubectl exec ... modeguard
// inspect` of the README names a workload and container the chart makes,
// and reads paths that container has mounted, so that the recipe works on
// an installed release.
func TestREADMEInspectRecipeMatchesTheChart(t *testing.T) {
	// The defaults (pools in the controller, the NFS target), and the
	// storage targets of iscsi.enabled.
	objs := helmTemplate(t, "--set", "zones[0].name=zone-a", "--set", "zones[1].name=zone-b")
	for key, obj := range helmTemplate(t, "--set", "iscsi.enabled=true", "--set", "zones[0].name=zone-a",
		"--set", "zones[1].name=zone-b") {
		if strings.HasPrefix(key, "StatefulSet/modeguard/modeguard-target-") {
			objs[key] = obj
		}
	}
	readme := strings.ReplaceAll(readFile(t, "README.md"), "\\\n", " ")
	exec := regexp.MustCompile(`kubectl -n modeguard exec (\S+) -c (\S+) --\s+modeguard inspect([^` + "`" + `\n]*)`)
	recipes := exec.FindAllStringSubmatch(readme, -1)
	if len(recipes) < 4 {
		t.Fatalf("the README has %d inspect recipes; want the NFS target's, the controller's, a node's and a storage target's", len(recipes))
	}
	for _, r := range recipes {
		workload, container, args := r[1], r[2], r[3]
		var spec map[string]any
		switch {
		case strings.HasPrefix(workload, "deploy/"):
			spec = podSpecOf(t, objs, "Deployment/modeguard/"+strings.TrimPrefix(workload, "deploy/"))
		case strings.HasPrefix(workload, "statefulset/"):
			spec = podSpecOf(t, objs, "StatefulSet/modeguard/"+strings.TrimPrefix(workload, "statefulset/"))
		case workload == `"$pod"`:
			// The node plugin found by its label on a node.
			if !strings.Contains(readme, "-l app.kubernetes.io/component=node") {
				t.Fatalf("the README's node recipe does not select the node plugin by app.kubernetes.io/component=node")
			}
			spec = podSpecOf(t, objs, "DaemonSet/modeguard/modeguard-node-zone-a")
			labels := get(t, objs["DaemonSet/modeguard/modeguard-node-zone-a"], "spec", "template", "metadata", "labels").(map[string]any)
			if labels["app.kubernetes.io/component"] != "node" {
				t.Errorf("the node plugin's pods are labelled %v, not app.kubernetes.io/component=node", labels)
			}
		default:
			t.Errorf("the README execs into %s, which this test does not know", workload)
			continue
		}
		if spec == nil {
			t.Errorf("the README execs into %s, which the chart does not make", workload)
			continue
		}
		c := containersOf(spec)[container]
		if c == nil {
			t.Errorf("%s has no container %s", workload, container)
			continue
		}
		var mounts []string
		for _, m := range c["volumeMounts"].([]any) {
			mounts = append(mounts, m.(map[string]any)["mountPath"].(string))
		}
		for _, p := range regexp.MustCompile(`(?:=|\s)(/[A-Za-z0-9_./-]+)`).FindAllStringSubmatch(args, -1) {
			inside := false
			for _, m := range mounts {
				if p[1] == m || strings.HasPrefix(p[1], strings.TrimSuffix(m, "/")+"/") {
					inside = true
				}
			}
			if !inside {
				t.Errorf("the README's inspect in %s reads %s, which container %s does not mount (it mounts %v)", workload, p[1], container, mounts)
			}
		}
	}
}

func podSpecOf(t *testing.T, objs map[string]map[string]any, key string) map[string]any {
	t.Helper()
	obj, ok := objs[key]
	if !ok {
		return nil
	}
	return get(t, obj, "spec", "template", "spec").(map[string]any)
}

package deploy

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// The objects of changed-block metadata: the chart's (snapshotMetadata) and
// components/snapshot-metadata's.
const (
	smController = "Deployment/modeguard/modeguard-controller"
	smService    = "Service/modeguard/modeguard-snapshot-metadata"
	smObject     = "SnapshotMetadataService/<nil>/modeguard.csi.dev"
	smRole       = "ClusterRole/<nil>/modeguard-snapshot-metadata"
	smBinding    = "ClusterRoleBinding/<nil>/modeguard-snapshot-metadata"
)

// asTheSnapshotMetadataComponent are the values under which the chart
// renders what components/snapshot-metadata adds to the base: the sidecar
// and its objects, with the operator's certificate and caFile as its CA.
func asTheSnapshotMetadataComponent(caFile string) []string {
	return []string{"--set", "snapshotMetadata.enabled=true", "--set", "snapshotMetadata.tls.source=external",
		"--set-file", "snapshotMetadata.tls.caCert=" + caFile}
}

// TestChartSnapshotMetadataIsTheSnapshotMetadataOverlay: the chart with
// snapshotMetadata enabled and its certificate the operator's renders what
// overlays/snapshot-metadata (the base and components/snapshot-metadata)
// does, object for object: the csi-snapshot-metadata sidecar on the
// driver's socket serving the operator's certificate, the Service in front
// of its port, the SnapshotMetadataService naming that Service and handing
// out the CA of the component's ca.crt, and the sidecar's RBAC. The
// repository's ca.crt is a placeholder, no certificate; with a CA and a
// certificate made by the operator guide's openssl commands, clients of the
// SnapshotMetadataService trust the sidecar at the address it names. The
// same holds with components/csi-addons and components/iscsi as well.
func TestChartSnapshotMetadataIsTheSnapshotMetadataOverlay(t *testing.T) {
	kustomize := tool(t, "KUSTOMIZE", "kustomize")
	deploy := filepath.Join(repo(t), "deploy", "kubernetes")
	placeholder := filepath.Join(deploy, "components", "snapshot-metadata", "ca.crt")

	overlay := objects(t, run(t, kustomize, "build", filepath.Join(deploy, "overlays", "snapshot-metadata")))
	checkSnapshotMetadataWiring(t, overlay)
	want, err := os.ReadFile(placeholder)
	if err != nil {
		t.Fatal(err)
	}
	if got := caCertOf(t, overlay); string(got) != string(want) {
		t.Errorf("the SnapshotMetadataService hands out %q, not the component's ca.crt %q", got, want)
	}
	// Clients parse the CA as PEM: the placeholder must give them nothing
	// to trust, so that a forgotten replacement fails, never passes.
	if block, _ := pem.Decode(want); block != nil {
		t.Errorf("components/snapshot-metadata/ca.crt holds a PEM block (%s): it must stay a placeholder", block.Type)
	}
	compare(t, helmTemplate(t, append(slices.Clone(asTheBase), asTheSnapshotMetadataComponent(placeholder)...)...), overlay)

	t.Run("with the operator guide's certificate", func(t *testing.T) {
		if _, err := exec.LookPath("openssl"); err != nil {
			t.Skip("needs openssl:", err)
		}
		// The guide's commands, as an operator runs them.
		dir := t.TempDir()
		certs := filepath.Join(dir, "certs")
		if err := os.Mkdir(certs, 0o755); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("sh", "-eu", "-c", guideBlock(t, "docs/operator-guide.md", "openssl req -x509"))
		cmd.Dir = certs
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("the operator guide's openssl commands: %v\n%s", err, out)
		}
		// Its CA in the component's ca.crt (a copy of the component,
		// which names nothing outside its directory).
		component := filepath.Join(dir, "component")
		copyDir(t, filepath.Join(deploy, "components", "snapshot-metadata"), component)
		caPEM, err := os.ReadFile(filepath.Join(certs, "ca.crt"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(component, "ca.crt"), caPEM, 0o644); err != nil {
			t.Fatal(err)
		}
		built := objects(t, run(t, kustomize, "build", overlayOf(t, filepath.Join(dir, "overlay"), deploy, component)))
		checkSnapshotMetadataWiring(t, built)

		// What a client does: trust the CA the SnapshotMetadataService
		// hands out and dial its address, where the sidecar serves the
		// certificate of its Secret (a kubernetes.io/tls of tls.crt and
		// tls.key).
		block, _ := pem.Decode(caCertOf(t, built))
		if block == nil {
			t.Fatalf("the SnapshotMetadataService hands out no PEM: %q", caCertOf(t, built))
		}
		ca, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		pair, err := tls.LoadX509KeyPair(filepath.Join(certs, "tls.crt"), filepath.Join(certs, "tls.key"))
		if err != nil {
			t.Fatalf("the sidecar cannot load the guide's certificate and key: %v", err)
		}
		leaf, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		host, _, err := net.SplitHostPort(get(t, built[smObject], "spec", "address").(string))
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AddCert(ca)
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: host,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("a client dialling %s does not trust the sidecar's certificate under the SnapshotMetadataService's CA: %v", host, err)
		}
		compare(t, helmTemplate(t, append(slices.Clone(asTheBase),
			asTheSnapshotMetadataComponent(filepath.Join(certs, "ca.crt"))...)...), built)

		// The guide's other way, for an overlay that uses the component
		// as it is: a patch of spec.caCert after it.
		patched := overlayOf(t, filepath.Join(dir, "patched"), deploy, filepath.Join(deploy, "components", "snapshot-metadata"))
		patch := fmt.Sprintf(`patches:
  - target: {kind: SnapshotMetadataService, name: modeguard.csi.dev}
    patch: |-
      - op: replace
        path: /spec/caCert
        value: %s
`, base64.StdEncoding.EncodeToString(caPEM))
		f, err := os.OpenFile(filepath.Join(patched, "kustomization.yaml"), os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteString(patch); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if got := caCertOf(t, objects(t, run(t, kustomize, "build", patched))); string(got) != string(caPEM) {
			t.Errorf("with the patch of spec.caCert, the SnapshotMetadataService hands out %q, want the guide's CA", got)
		}
	})

	t.Run("with csi-addons and iscsi", func(t *testing.T) {
		// The three components on the base, as an overlay of an
		// operator's own would have them: the sidecar keeps its place
		// among the controller's containers.
		all := objects(t, run(t, kustomize, "build", overlayOf(t, t.TempDir(), deploy,
			filepath.Join(deploy, "components", "iscsi"), filepath.Join(deploy, "components", "csi-addons"),
			filepath.Join(deploy, "components", "snapshot-metadata"))))
		checkSnapshotMetadataWiring(t, all)
		caCertOf(t, all)
		compare(t, helmTemplate(t, append(slices.Clone(asTheBase), append([]string{
			"--set", "iscsi.enabled=true", "--set", "tls.source=external", "--set", "iscsi.chap.source=external",
			"--set", "csiAddons.enabled=true"}, asTheSnapshotMetadataComponent(placeholder)...)...)...), all)
	})
}

// overlayOf writes, in dir, an overlay of the base with components, and
// returns dir.
func overlayOf(t *testing.T, dir, deploy string, components ...string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	rel := func(p string) string {
		r, err := filepath.Rel(dir, p)
		if err != nil {
			t.Fatal(err)
		}
		return filepath.ToSlash(r)
	}
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - " + rel(filepath.Join(deploy, "base")) + "\ncomponents:\n"
	for _, c := range components {
		k += "  - " + rel(c) + "\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	entries, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(to, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			t.Fatalf("%s: %s is not a plain file", from, e.Name())
		}
		b, err := os.ReadFile(filepath.Join(from, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(to, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// guideBlock is the sh code block of a document that contains marker, its
// indentation (a block in a list item) removed.
func guideBlock(t *testing.T, doc, marker string) string {
	t.Helper()
	for _, m := range regexp.MustCompile("(?ms)^( *)```sh\n(.*?)^ *```").FindAllStringSubmatch(readFile(t, doc), -1) {
		if !strings.Contains(m[2], marker) {
			continue
		}
		var lines []string
		for _, l := range strings.Split(m[2], "\n") {
			lines = append(lines, strings.TrimPrefix(l, m[1]))
		}
		return strings.Join(lines, "\n")
	}
	t.Fatalf("%s has no sh block with %q", doc, marker)
	return ""
}

// caCertOf is the CA the SnapshotMetadataService hands out, decoded.
// kustomize breaks a base64 value it encodes into lines, which the API
// server's base64 ignores: the same bytes as the chart's single line, so
// the line breaks are taken out here, in objs, for the comparison too.
func caCertOf(t *testing.T, objs map[string]map[string]any) []byte {
	t.Helper()
	spec, _ := get(t, objs[smObject], "spec").(map[string]any)
	b64, ok := spec["caCert"].(string)
	if !ok {
		t.Fatalf("%s has no spec.caCert: %v", smObject, spec)
	}
	b64 = strings.ReplaceAll(b64, "\n", "")
	spec["caCert"] = b64
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		t.Fatalf("%s: spec.caCert is not base64, which the API server refuses: %v", smObject, err)
	}
	return raw
}

// checkSnapshotMetadataWiring checks that the sidecar and its objects fit
// together: the sidecar dials the socket the driver serves and serves the
// certificate of the Secret modeguard-snapshot-metadata-tls; the Service
// selects the controller pod and targets the sidecar's port; the
// SnapshotMetadataService names the Service at that port; and the
// sidecar's service account may do what the sidecar does for each call.
func checkSnapshotMetadataWiring(t *testing.T, objs map[string]map[string]any) {
	t.Helper()
	for _, key := range []string{smController, smService, smObject, smRole, smBinding} {
		if objs[key] == nil {
			t.Fatalf("no %s", key)
		}
	}
	template := get(t, objs[smController], "spec", "template").(map[string]any)
	spec := template["spec"].(map[string]any)
	containers := containersOf(spec)
	sidecar, driver := containers["csi-snapshot-metadata"], containers["modeguard"]
	if sidecar == nil {
		t.Fatalf("no csi-snapshot-metadata container in the controller pod: %v", sortedKeys(containers))
	}
	if image := sidecar["image"]; image != "registry.k8s.io/sig-storage/csi-snapshot-metadata:v0.2.0" {
		t.Errorf("the sidecar runs %v", image)
	}
	flag := func(c map[string]any, name string) string {
		t.Helper()
		var found []string
		args, _ := c["args"].([]any)
		for _, a := range args {
			if v, ok := strings.CutPrefix(a.(string), name+"="); ok {
				found = append(found, v)
			}
		}
		if len(found) != 1 {
			t.Fatalf("container %s has %d %s flags, want one: %v", c["name"], len(found), name, c["args"])
		}
		return found[0]
	}
	volumes := map[string]map[string]any{}
	for _, v := range spec["volumes"].([]any) {
		v := v.(map[string]any)
		volumes[v["name"].(string)] = v
	}

	// The driver's socket, in the same volume at the same place.
	socket, ok := strings.CutPrefix(flag(driver, "--endpoint"), "unix://")
	if !ok {
		t.Fatalf("the driver's --endpoint is not a unix socket: %v", driver["args"])
	}
	driverVolume, driverRel := mountOf(t, driver, socket)
	sidecarVolume, sidecarRel := mountOf(t, sidecar, strings.TrimPrefix(flag(sidecar, "--csi-address"), "unix://"))
	if driverVolume != sidecarVolume || driverRel != sidecarRel {
		t.Errorf("the sidecar dials %s in volume %s, the driver serves %s in volume %s", sidecarRel, sidecarVolume, driverRel, driverVolume)
	}
	// Its certificate and key: the files of a kubernetes.io/tls Secret.
	for f, key := range map[string]string{"--tls-cert": "tls.crt", "--tls-key": "tls.key"} {
		volume, rel := mountOf(t, sidecar, flag(sidecar, f))
		if secret := get(t, volumes[volume], "secret", "secretName"); secret != "modeguard-snapshot-metadata-tls" || rel != key {
			t.Errorf("the sidecar's %s is %s of volume %s (Secret %v), want %s of Secret modeguard-snapshot-metadata-tls", f, rel, volume, secret, key)
		}
	}

	// The Service: the controller pod's port the sidecar listens on.
	port := flag(sidecar, "--port")
	service := objs[smService]
	labels, _ := get(t, template, "metadata", "labels").(map[string]any)
	selector, _ := get(t, service, "spec", "selector").(map[string]any)
	if len(selector) == 0 {
		t.Errorf("the Service selects nothing")
	}
	for k, v := range selector {
		if labels[k] != v {
			t.Errorf("the Service selects %s=%v, the controller pod has %v", k, v, labels[k])
		}
	}
	target := get(t, service, "spec", "ports", 0, "targetPort")
	var listens bool
	for _, p := range sidecar["ports"].([]any) {
		p := p.(map[string]any)
		if p["name"] == target && fmt.Sprint(p["containerPort"]) == port {
			listens = true
		}
	}
	if !listens {
		t.Errorf("the Service targets port %v, which is not the sidecar's --port=%s: %v", target, port, sidecar["ports"])
	}

	// The SnapshotMetadataService: the Service, by its cluster name, at
	// its port; the audience clients' tokens are issued for.
	object := objs[smObject]
	wantAddress := net.JoinHostPort(fmt.Sprintf("%v.%v.svc", get(t, service, "metadata", "name"), get(t, service, "metadata", "namespace")),
		fmt.Sprint(get(t, service, "spec", "ports", 0, "port")))
	if got := get(t, object, "spec", "address"); got != wantAddress {
		t.Errorf("the SnapshotMetadataService's address is %v, want the Service's %s", got, wantAddress)
	}
	if got := get(t, object, "spec", "audience"); got != "snapshot-metadata.modeguard.csi.dev" {
		t.Errorf("the SnapshotMetadataService's audience is %v", got)
	}

	// RBAC: bound to the pod's service account; each rule the sidecar
	// needs for a call.
	binding := objs[smBinding]
	if ref := get(t, binding, "roleRef").(map[string]any); ref["kind"] != "ClusterRole" || ref["name"] != "modeguard-snapshot-metadata" {
		t.Errorf("the sidecar's ClusterRoleBinding refers to %v", ref)
	}
	var bound bool
	subjects, _ := get(t, binding, "subjects").([]any)
	for _, s := range subjects {
		s := s.(map[string]any)
		bound = bound || s["kind"] == "ServiceAccount" && s["name"] == spec["serviceAccountName"] &&
			s["namespace"] == get(t, objs[smController], "metadata", "namespace")
	}
	if !bound {
		t.Errorf("the sidecar's ClusterRoleBinding binds %v, not the controller pod's service account %v", subjects, spec["serviceAccountName"])
	}
	rules, _ := get(t, objs[smRole], "rules").([]any)
	for _, need := range []struct{ group, resource, name, verb string }{
		{"authentication.k8s.io", "tokenreviews", "", "create"},
		{"authorization.k8s.io", "subjectaccessreviews", "", "create"},
		{"cbt.storage.k8s.io", "snapshotmetadataservices", fmt.Sprint(get(t, object, "metadata", "name")), "get"},
		{"snapshot.storage.k8s.io", "volumesnapshots", "", "get"},
		{"snapshot.storage.k8s.io", "volumesnapshotcontents", "", "get"},
		{"snapshot.storage.k8s.io", "volumesnapshotclasses", "", "get"},
		{"snapshot.storage.k8s.io", "volumesnapshotclasses", "", "list"},
	} {
		if !grants(rules, need.group, need.resource, need.name, need.verb) {
			t.Errorf("the sidecar may not %s %s.%s %s", need.verb, need.resource, need.group, need.name)
		}
	}
}

// grants says whether a rule allows verb on resource of group, on the
// object name, or on every object when name is empty.
func grants(rules []any, group, resource, name, verb string) bool {
	has := func(rule map[string]any, field, value string) bool {
		list, _ := rule[field].([]any)
		return slices.Contains(list, any(value)) || slices.Contains(list, any("*"))
	}
	for _, r := range rules {
		r := r.(map[string]any)
		names, _ := r["resourceNames"].([]any)
		if has(r, "apiGroups", group) && has(r, "resources", resource) && has(r, "verbs", verb) &&
			(len(names) == 0 || name != "" && slices.Contains(names, any(name))) {
			return true
		}
	}
	return false
}

// mountOf returns the volume holding path in container c (the longest
// mount path that contains it), and path relative to that mount.
func mountOf(t *testing.T, c map[string]any, path string) (string, string) {
	t.Helper()
	volume, rel, best := "", "", -1
	mounts, _ := c["volumeMounts"].([]any)
	for _, m := range mounts {
		m := m.(map[string]any)
		mp := m["mountPath"].(string)
		r, err := filepath.Rel(mp, path)
		if err != nil || r == ".." || strings.HasPrefix(r, "../") || len(mp) <= best {
			continue
		}
		volume, rel, best = m["name"].(string), r, len(mp)
	}
	if volume == "" {
		t.Fatalf("container %s mounts nothing that holds %s", c["name"], path)
	}
	return volume, rel
}

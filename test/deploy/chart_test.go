// Package deploy checks the two ways the driver is installed against each
// other: the Helm chart (deploy/helm/modeguard) must render the same
// objects as the kustomize base (deploy/kubernetes/base) and its zone
// groups, so that neither drifts from the other.
package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/yaml"
)

// repo is the repository's root.
func repo(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// tool finds a pinned tool: the path in the environment variable make
// exports, else the one make builds under _build/tools.
func tool(t *testing.T, env, name string) string {
	t.Helper()
	p := os.Getenv(env)
	if p == "" {
		p = filepath.Join(repo(t), "_build", "tools", name)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skipf("needs %s at its pinned version (make %s builds it; or set %s): %v", name, p, env, err)
	}
	return p
}

func run(t *testing.T, bin string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(bin), strings.Join(args, " "), err, stderr.String())
	}
	return out
}

// objects decodes a YAML stream into objects keyed by kind/namespace/name.
func objects(t *testing.T, stream []byte) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(stream), 4096)
	for {
		var obj map[string]any
		err := dec.Decode(&obj)
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("decoding: %v", err)
		}
		if obj == nil {
			continue
		}
		meta, _ := obj["metadata"].(map[string]any)
		key := fmt.Sprintf("%v/%v/%v", obj["kind"], meta["namespace"], meta["name"])
		if _, dup := out[key]; dup {
			t.Fatalf("%s appears twice", key)
		}
		out[key] = obj
	}
}

// helmLabels are the labels the chart adds to every object's metadata and
// the kustomize base does not have: Helm's bookkeeping, nothing else.
var helmLabels = []string{"app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart"}

func withoutHelmLabels(t *testing.T, objs map[string]map[string]any) {
	t.Helper()
	for key, obj := range objs {
		labels, _ := obj["metadata"].(map[string]any)["labels"].(map[string]any)
		for _, l := range helmLabels {
			if _, ok := labels[l]; !ok {
				t.Errorf("chart object %s lacks the label %s", key, l)
			}
			delete(labels, l)
		}
	}
}

// compare reports every object one side has and the other lacks, and every
// object that differs, with both renderings.
func compare(t *testing.T, chart, kustomize map[string]map[string]any) {
	t.Helper()
	var keys []string
	for k := range chart {
		keys = append(keys, k)
	}
	for k := range kustomize {
		if _, ok := chart[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		c, inChart := chart[k]
		b, inBase := kustomize[k]
		switch {
		case !inChart:
			t.Errorf("%s: in the kustomize base, not rendered by the chart", k)
		case !inBase:
			t.Errorf("%s: rendered by the chart, not in the kustomize base", k)
		case !reflect.DeepEqual(c, b):
			t.Errorf("%s differs:\n%s", k, strings.Join(differences("", c, b), "\n"))
		}
	}
}

// differences lists the paths at which two decoded objects differ, with
// both values.
func differences(path string, chart, kustomize any) []string {
	switch c := chart.(type) {
	case map[string]any:
		k, ok := kustomize.(map[string]any)
		if !ok {
			break
		}
		var out []string
		keys := map[string]bool{}
		for key := range c {
			keys[key] = true
		}
		for key := range k {
			keys[key] = true
		}
		sorted := make([]string, 0, len(keys))
		for key := range keys {
			sorted = append(sorted, key)
		}
		sort.Strings(sorted)
		for _, key := range sorted {
			out = append(out, differences(path+"."+key, c[key], k[key])...)
		}
		return out
	case []any:
		k, ok := kustomize.([]any)
		if !ok || len(k) != len(c) {
			break
		}
		var out []string
		for i := range c {
			out = append(out, differences(fmt.Sprintf("%s[%d]", path, i), c[i], k[i])...)
		}
		return out
	}
	if reflect.DeepEqual(chart, kustomize) {
		return nil
	}
	return []string{fmt.Sprintf("  %s: chart %v, kustomize %v", path, chart, kustomize)}
}

func helmTemplate(t *testing.T, args ...string) map[string]map[string]any {
	t.Helper()
	helm := tool(t, "HELM", "helm")
	out := run(t, helm, append([]string{"template", "modeguard", filepath.Join(repo(t), "deploy", "helm", "modeguard"),
		"--namespace", "modeguard"}, args...)...)
	objs := objects(t, out)
	withoutHelmLabels(t, objs)
	return objs
}

// asTheBase are the values and API versions under which the chart renders
// what the kustomize base says: the namespace made by the chart, as the
// base makes it; the image the base names (modeguard:dev, not the chart's
// appVersion); a cluster that serves the snapshot CRDs, where the chart
// makes its snapshot classes as the base always does. Rendered without a
// cluster, the chart cannot pin the controller to a node (the base leaves
// that to an overlay too). The base is the layout of one controller that
// serves NFS itself (controller.replicas=1, nfs.servedBy=controller): the
// chart's default of two replicas and the NFS target is checked by
// TestChartRunsTwoControllersAndTheNFSTarget.
var asTheBase = []string{"--set", "createNamespace=true", "--set", "image.tag=dev",
	"--set", "controller.replicas=1", "--set", "nfs.servedBy=controller",
	"--api-versions", "snapshot.storage.k8s.io/v1/VolumeSnapshotClass",
	"--api-versions", "groupsnapshot.storage.k8s.io/v1/VolumeGroupSnapshotClass"}

// TestChartRendersTheKustomizeBase: with its default values (asTheBase),
// the chart renders exactly the objects of deploy/kubernetes/base.
func TestChartRendersTheKustomizeBase(t *testing.T) {
	kustomize := tool(t, "KUSTOMIZE", "kustomize")
	base := objects(t, run(t, kustomize, "build", filepath.Join(repo(t), "deploy", "kubernetes", "base")))
	compare(t, helmTemplate(t, asTheBase...), base)
}

// TestChartISCSIIsTheISCSIOverlay: the chart with iscsi.enabled renders
// what overlays/iscsi (the base and components/iscsi) does, object for
// object: a storage target and its Service for the zone, the controller
// reaching it over mutual TLS instead of holding the pool, and the node
// plugins logging in with the host's open-iscsi.
func TestChartISCSIIsTheISCSIOverlay(t *testing.T) {
	kustomize := tool(t, "KUSTOMIZE", "kustomize")
	overlay := objects(t, run(t, kustomize, "build", filepath.Join(repo(t), "deploy", "kubernetes", "overlays", "iscsi")))
	for _, key := range []string{"StatefulSet/modeguard/modeguard-target-zone-a", "Service/modeguard/modeguard-target-zone-a"} {
		if _, ok := overlay[key]; !ok {
			t.Fatalf("overlays/iscsi renders no %s", key)
		}
	}
	args := fmt.Sprint(overlay["Deployment/modeguard/modeguard-controller"]["spec"])
	if strings.Contains(args, "--block-pool") || !strings.Contains(args, "--block-target=zone-a=modeguard-target-zone-a.modeguard.svc:9443") {
		t.Fatalf("the controller of overlays/iscsi does not reach the target instead of the pool: %s", args)
	}
	compare(t, helmTemplate(t, append(slices.Clone(asTheBase), "--set", "iscsi.enabled=true",
		"--set", "tls.source=external", "--set", "iscsi.chap.source=external")...), overlay)
}

// TestChartCSIAddonsIsTheCSIAddonsOverlay: the chart with csiAddons.enabled
// renders what overlays/csi-addons (the base and components/csi-addons)
// does, object for object: the csi-addons sidecar on the driver's socket,
// the controller keeping its fence list on a host directory, the sidecar's
// RBAC and the Secret its NetworkFences name. The same holds with
// components/iscsi as well, the block transport a fence can cut off.
func TestChartCSIAddonsIsTheCSIAddonsOverlay(t *testing.T) {
	kustomize := tool(t, "KUSTOMIZE", "kustomize")
	overlay := objects(t, run(t, kustomize, "build", filepath.Join(repo(t), "deploy", "kubernetes", "overlays", "csi-addons")))
	for _, key := range []string{
		"ClusterRole/<nil>/modeguard-csi-addons", "ClusterRoleBinding/<nil>/modeguard-csi-addons",
		"Role/modeguard/modeguard-csi-addons", "RoleBinding/modeguard/modeguard-csi-addons",
		"Secret/modeguard/modeguard-networkfence",
	} {
		if _, ok := overlay[key]; !ok {
			t.Fatalf("overlays/csi-addons renders no %s", key)
		}
	}
	checkFenceWiring(t, overlay["Deployment/modeguard/modeguard-controller"])
	compare(t, helmTemplate(t, append(slices.Clone(asTheBase), "--set", "csiAddons.enabled=true")...), overlay)

	t.Run("with iscsi", func(t *testing.T) {
		// Both components on the base, as an overlay of an operator's own
		// would have them.
		dir := t.TempDir()
		deploy, err := filepath.Rel(dir, filepath.Join(repo(t), "deploy", "kubernetes"))
		if err != nil {
			t.Fatal(err)
		}
		kustomization := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %[1]s/base
components:
  - %[1]s/components/iscsi
  - %[1]s/components/csi-addons
`, filepath.ToSlash(deploy))
		if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
			t.Fatal(err)
		}
		both := objects(t, run(t, kustomize, "build", dir))
		args := fmt.Sprint(both["Deployment/modeguard/modeguard-controller"]["spec"])
		if !strings.Contains(args, "--block-target=zone-a=") || !strings.Contains(args, "--fence-file=") {
			t.Fatalf("the controller of base+iscsi+csi-addons lacks --block-target or --fence-file: %s", args)
		}
		checkFenceWiring(t, both["Deployment/modeguard/modeguard-controller"])
		compare(t, helmTemplate(t, append(slices.Clone(asTheBase), "--set", "iscsi.enabled=true", "--set", "csiAddons.enabled=true",
			"--set", "tls.source=external", "--set", "iscsi.chap.source=external")...), both)
	})
}

// checkFenceWiring checks what the comparison with the chart cannot: that
// the csi-addons sidecar dials the socket the driver serves on, through a
// volume both mount, and that the controller's fence list lies on a host
// directory mounted into the driver's container, not in the container or
// an emptyDir, which a restart would empty (and so lift every fence).
func checkFenceWiring(t *testing.T, deployment map[string]any) {
	t.Helper()
	if deployment == nil {
		t.Fatal("no controller Deployment")
	}
	spec := deployment["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
	containers := map[string]map[string]any{}
	for _, c := range spec["containers"].([]any) {
		c := c.(map[string]any)
		containers[c["name"].(string)] = c
	}
	volumes := map[string]map[string]any{}
	for _, v := range spec["volumes"].([]any) {
		v := v.(map[string]any)
		volumes[v["name"].(string)] = v
	}
	flag := func(c map[string]any, name string) string {
		var found []string
		for _, a := range c["args"].([]any) {
			if v, ok := strings.CutPrefix(a.(string), name+"="); ok {
				found = append(found, v)
			}
		}
		if len(found) != 1 {
			t.Fatalf("container %s has %d %s flags, want one: %v", c["name"], len(found), name, c["args"])
		}
		return found[0]
	}
	// mountOf returns the volume holding path in container c (the longest
	// mount path that contains it), and path relative to that mount.
	mountOf := func(c map[string]any, path string) (string, string) {
		volume, rel, best := "", "", -1
		for _, m := range c["volumeMounts"].([]any) {
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

	driver, sidecar := containers["modeguard"], containers["csi-addons"]
	if driver == nil || sidecar == nil {
		t.Fatalf("the controller pod has no modeguard or no csi-addons container: %v", sortedKeys(containers))
	}
	if image := sidecar["image"]; image != "quay.io/csiaddons/k8s-sidecar:v0.14.0" {
		t.Errorf("the csi-addons sidecar runs %v", image)
	}
	endpoint := flag(driver, "--endpoint")
	socket, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok {
		t.Fatalf("the driver's --endpoint %s is not a unix socket", endpoint)
	}
	driverVolume, driverRel := mountOf(driver, socket)
	sidecarVolume, sidecarRel := mountOf(sidecar, strings.TrimPrefix(flag(sidecar, "--csi-addons-address"), "unix://"))
	if driverVolume != sidecarVolume || driverRel != sidecarRel {
		t.Errorf("the sidecar dials %s in volume %s, the driver serves %s in volume %s", sidecarRel, sidecarVolume, driverRel, driverVolume)
	}
	// The csi-addons controller finds the sidecar by its pod: without
	// --pod and --namespace the sidecar registers no endpoint it can use.
	for _, f := range []string{"--pod", "--namespace", "--pod-uid", "--node-id", "--controller-port"} {
		flag(sidecar, f)
	}

	fenceFile := flag(driver, "--fence-file")
	if !filepath.IsAbs(fenceFile) {
		t.Fatalf("--fence-file %s is not absolute", fenceFile)
	}
	volume, _ := mountOf(driver, fenceFile)
	hostPath, _ := volumes[volume]["hostPath"].(map[string]any)
	if hostPath == nil {
		t.Fatalf("the fence file %s lies in volume %s, not a host directory: %v", fenceFile, volume, volumes[volume])
	}
	if !strings.HasPrefix(fmt.Sprint(hostPath["path"]), "/var/lib/modeguard/") {
		t.Errorf("the fence list's host directory %v is not with the controller's other state under /var/lib/modeguard", hostPath["path"])
	}
	// The driver locks the fence file's directory as it locks each of its
	// other state directories: one directory cannot be two of them.
	for _, a := range driver["args"].([]any) {
		name, value, _ := strings.Cut(a.(string), "=")
		switch name {
		case "--block-pool":
			_, value, _ = strings.Cut(value, "=")
		case "--nfs-export-root", "--nfs-ganesha-dir":
		default:
			continue
		}
		if value == filepath.Dir(fenceFile) {
			t.Errorf("the fence file %s is in the directory of %s", fenceFile, a)
		}
	}
}

func sortedKeys(m map[string]map[string]any) []string {
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// TestChartZonesAreTheZoneGroups: a second zone in the chart's values is
// the node group deploy/kubernetes/zones/zone-b adds, object for object.
func TestChartZonesAreTheZoneGroups(t *testing.T) {
	kustomize := tool(t, "KUSTOMIZE", "kustomize")
	zoneB := objects(t, run(t, kustomize, "build", filepath.Join(repo(t), "deploy", "kubernetes", "zones", "zone-b")))
	chart := helmTemplate(t, "--set", "image.tag=dev", "--set", "zones[0].name=zone-a", "--set", "zones[1].name=zone-b")
	const key = "DaemonSet/modeguard/modeguard-node-zone-b"
	if _, ok := zoneB[key]; !ok || len(zoneB) != 1 {
		t.Fatalf("zones/zone-b renders %d objects, want %s alone", len(zoneB), key)
	}
	compare(t, map[string]map[string]any{key: chart[key]}, zoneB)
	// The controller serves both zones' pools.
	args := fmt.Sprint(chart["Deployment/modeguard/modeguard-controller"]["spec"])
	for _, want := range []string{"--block-pool=zone-a=/var/lib/modeguard/pools/zone-a", "--block-pool=zone-b=/var/lib/modeguard/pools/zone-b"} {
		if !strings.Contains(args, want) {
			t.Errorf("the controller's arguments lack %s", want)
		}
	}
}

// TestChartRefusesBadValues: values.schema.json turns away values the
// driver or Kubernetes would only refuse later, each with Helm's message
// naming the value.
func TestChartRefusesBadValues(t *testing.T) {
	helm := tool(t, "HELM", "helm")
	chart := filepath.Join(repo(t), "deploy", "helm", "modeguard")
	for _, tc := range []struct{ name, set, mentions string }{
		{"no zone", "zones=null", "zones"},
		{"a zone name with a slash", "zones[0].name=zone/a", "zones"},
		{"a relative pools directory", "poolsDir=pools", "poolsDir"},
		{"a pool filesystem the driver does not keep", "poolsFilesystem=ext4", "poolsFilesystem"},
		{"an unknown filesystem", "storageClasses.block.fsType=btrfs", "fsType"},
		{"a rootSquash that is not true or false", "storageClasses.nfs.rootSquash=maybe", "rootSquash"},
		{"an unknown key", "replicas=2", "replicas"},
		{"a pull policy Kubernetes does not know", "image.pullPolicy=Sometimes", "pullPolicy"},
		{"a port out of range", "controller.metrics.port=70000", "port"},
		{"an iSCSI portal port out of range", "iscsi.portalPort=0", "portalPort"},
		{"a replacement timeout without a unit", "iscsi.replacementTimeout=30", "replacementTimeout"},
		{"a relative fence directory", "csiAddons.fenceDir=fences", "fenceDir"},
		{"a csi-addons port out of range", "csiAddons.port=0", "port"},
		{"a fence Secret name that is not a name", "csiAddons.secretName=Fence_Secret", "secretName"},
		{"a log format klog does not have", "logFormat=xml", "logFormat"},
		{"an unknown source of the TLS certificates", "tls.source=vault", "source"},
		{"an unknown source of the CHAP secrets", "iscsi.chap.source=vault", "source"},
		{"a snapshot class neither auto nor a boolean", "volumeSnapshotClass.create=maybe", "create"},
		{"an NFS node that is not a node name", "nfs.node=Node_1", "node"},
		{"a mount option that is empty", "storageClasses.block.mountOptions[0]=", "mountOptions"},
		{"a host alias without an address", "controller.hostAliases[0].hostnames[0]=modeguard-target-zone-a.modeguard.svc", "ip"},
		{"snapshot metadata neither auto nor a boolean", "snapshotMetadata.enabled=maybe", "enabled"},
		{"a snapshot metadata address without a port", "snapshotMetadata.address=backup.example.com", "address"},
		{"an external snapshot metadata certificate without its CA", "snapshotMetadata.enabled=true,snapshotMetadata.tls.source=external", "caCert"},
		{"no controller replica", "controller.replicas=0", "replicas"},
		{"NFS in the controller neither target nor controller", "nfs.servedBy=node", "servedBy"},
		{"two controllers serving NFS from their own nodes", "nfs.servedBy=controller", "nfs.servedBy=target"},
		{"two controllers keeping the fence list on their own nodes", "nfs.enabled=false,csiAddons.enabled=true", "fence list"},
		{"a sidecar lease without a unit", "controller.leaderElection.leaseDuration=10", "leaseDuration"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(helm, "template", "modeguard", chart, "--namespace", "modeguard", "--set", tc.set)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("helm template --set %s rendered:\n%s", tc.set, out)
			}
			if !strings.Contains(string(out), tc.mentions) {
				t.Fatalf("helm's refusal does not name %s:\n%s", tc.mentions, out)
			}
		})
	}
}

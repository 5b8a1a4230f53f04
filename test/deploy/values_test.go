package deploy

import (
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// get walks a decoded object along a path of map keys and list indexes.
func get(t *testing.T, obj any, path ...any) any {
	t.Helper()
	cur := obj
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := cur.(map[string]any)
			if !ok {
				return nil
			}
			cur = m[k]
		case int:
			l, ok := cur.([]any)
			if !ok || k >= len(l) {
				return nil
			}
			cur = l[k]
		}
	}
	return cur
}

// podSpecs are the pod templates of every workload the chart renders.
func podSpecs(t *testing.T, objs map[string]map[string]any) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	for key, obj := range objs {
		switch obj["kind"] {
		case "Deployment", "DaemonSet", "StatefulSet":
			out[key] = get(t, obj, "spec", "template", "spec").(map[string]any)
		}
	}
	if len(out) == 0 {
		t.Fatal("the chart rendered no workload")
	}
	return out
}

func containersOf(spec map[string]any) map[string]map[string]any {
	out := map[string]map[string]any{}
	for _, c := range spec["containers"].([]any) {
		c := c.(map[string]any)
		out[c["name"].(string)] = c
	}
	return out
}

// TestChartZonesKeepTheirDaemonSets: every zone's node plugins are a
// DaemonSet named by the zone, selecting by the zone. Renaming a zone or
// adding one leaves the DaemonSets of the other zones exactly as they were,
// so helm upgrade never has to change a selector, which Kubernetes refuses.
func TestChartZonesKeepTheirDaemonSets(t *testing.T) {
	before := helmTemplate(t, "--set", "zones[0].name=zone-a", "--set", "zones[1].name=zone-b")
	after := helmTemplate(t, "--set", "zones[0].name=zone-a", "--set", "zones[1].name=zone-c", "--set", "zones[2].name=zone-d")
	daemonSets := func(objs map[string]map[string]any) []string {
		var out []string
		for key, obj := range objs {
			if obj["kind"] == "DaemonSet" {
				out = append(out, key)
			}
		}
		sort.Strings(out)
		return out
	}
	if got, want := daemonSets(before), []string{"DaemonSet/modeguard/modeguard-node-zone-a", "DaemonSet/modeguard/modeguard-node-zone-b"}; !slices.Equal(got, want) {
		t.Fatalf("zones a, b: DaemonSets %v, want %v", got, want)
	}
	if got, want := daemonSets(after), []string{"DaemonSet/modeguard/modeguard-node-zone-a", "DaemonSet/modeguard/modeguard-node-zone-c", "DaemonSet/modeguard/modeguard-node-zone-d"}; !slices.Equal(got, want) {
		t.Fatalf("zones a, c, d: DaemonSets %v, want %v", got, want)
	}
	const kept = "DaemonSet/modeguard/modeguard-node-zone-a"
	if !reflect.DeepEqual(before[kept], after[kept]) {
		t.Errorf("zone-a's DaemonSet changed when another zone was renamed and one added:\n%s",
			strings.Join(differences("", before[kept], after[kept]), "\n"))
	}
	for _, objs := range []map[string]map[string]any{before, after} {
		for _, key := range daemonSets(objs) {
			zone := strings.TrimPrefix(key, "DaemonSet/modeguard/modeguard-node-")
			sel := get(t, objs[key], "spec", "selector", "matchLabels").(map[string]any)
			if sel["modeguard.csi.dev/zone"] != zone {
				t.Errorf("%s selects %v, not its zone %s", key, sel, zone)
			}
			if ns := get(t, objs[key], "spec", "template", "spec", "nodeSelector", "topology.kubernetes.io/zone"); ns != zone {
				t.Errorf("%s runs on nodes of zone %v, not %s", key, ns, zone)
			}
		}
	}
}

// TestChartSnapshotClassesFollowTheCRDs: the snapshot classes are made
// where the cluster serves their CRDs (a first install on a cluster without
// them succeeds), the group class in the newest version served; create
// true makes them anyway and false never.
func TestChartSnapshotClassesFollowTheCRDs(t *testing.T) {
	const single, group = "VolumeSnapshotClass/<nil>/modeguard-snapshots", "VolumeGroupSnapshotClass/<nil>/modeguard-group-snapshots"
	for _, tc := range []struct {
		name     string
		args     []string
		single   bool
		groupAPI string
	}{
		{"a bare cluster", nil, false, ""},
		{"snapshot CRDs, group CRDs v1beta2", []string{"--api-versions", "snapshot.storage.k8s.io/v1/VolumeSnapshotClass",
			"--api-versions", "groupsnapshot.storage.k8s.io/v1beta2/VolumeGroupSnapshotClass"}, true, "groupsnapshot.storage.k8s.io/v1beta2"},
		{"snapshot CRDs, group CRDs v1", []string{"--api-versions", "snapshot.storage.k8s.io/v1/VolumeSnapshotClass",
			"--api-versions", "groupsnapshot.storage.k8s.io/v1beta2/VolumeGroupSnapshotClass",
			"--api-versions", "groupsnapshot.storage.k8s.io/v1/VolumeGroupSnapshotClass"}, true, "groupsnapshot.storage.k8s.io/v1"},
		{"made anyway", []string{"--set", "volumeSnapshotClass.create=true", "--set", "volumeGroupSnapshotClass.create=true"}, true, "groupsnapshot.storage.k8s.io/v1"},
		{"never", []string{"--api-versions", "snapshot.storage.k8s.io/v1/VolumeSnapshotClass",
			"--set", "volumeSnapshotClass.create=false", "--set", "volumeGroupSnapshotClass.create=false"}, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := helmTemplate(t, tc.args...)
			if _, ok := objs[single]; ok != tc.single {
				t.Errorf("VolumeSnapshotClass rendered: %v, want %v", ok, tc.single)
			}
			g, ok := objs[group]
			switch {
			case tc.groupAPI == "" && ok:
				t.Errorf("VolumeGroupSnapshotClass rendered (%v), want none", g["apiVersion"])
			case tc.groupAPI != "" && !ok:
				t.Errorf("no VolumeGroupSnapshotClass, want one of %s", tc.groupAPI)
			case ok && g["apiVersion"] != tc.groupAPI:
				t.Errorf("VolumeGroupSnapshotClass of %v, want %s", g["apiVersion"], tc.groupAPI)
			}
		})
	}
}

// TestChartOperatorKnobs: what an operator sets reaches every object it
// should: pull secrets every pod, the node plugins' and the controller's
// placement, resources and securityContext of every sidecar, annotations
// and mount options of the StorageClasses, the log format; the driver's
// image defaults to the chart's appVersion.
func TestChartOperatorKnobs(t *testing.T) {
	values := `
imagePullSecrets: [regcred, {name: other}]
logFormat: json
zones: [{name: zone-a}, {name: zone-b}]
iscsi: {enabled: true}
csiAddons: {enabled: true, resources: {limits: {memory: 64Mi}}}
sidecars:
  resources: {requests: {cpu: 10m}}
  securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true}
  attacher: {resources: {requests: {cpu: 20m}}}
node:
  nodeSelector: {disk: ssd}
  affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: arch, operator: In, values: [amd64]}]}]}}}
controller:
  affinity: {podAntiAffinity: {preferredDuringSchedulingIgnoredDuringExecution: []}}
  hostAliases: [{ip: 10.0.0.7, hostnames: [modeguard-target-zone-a.modeguard.svc]}]
storageClasses:
  block:
    annotations: {storageclass.kubernetes.io/is-default-class: "true"}
    mountOptions: [noatime]
  nfs:
    mountOptions: [nconnect=4]
`
	file := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(file, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	objs := helmTemplate(t, "--values", file)
	chartYAML, err := os.ReadFile(filepath.Join(repo(t), "deploy", "helm", "modeguard", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(chartYAML, &chart); err != nil || chart.AppVersion == "" {
		t.Fatalf("Chart.yaml's appVersion: %q, %v", chart.AppVersion, err)
	}
	for key, spec := range podSpecs(t, objs) {
		var secrets []string
		for _, s := range get(t, spec, "imagePullSecrets").([]any) {
			secrets = append(secrets, s.(map[string]any)["name"].(string))
		}
		if !slices.Equal(secrets, []string{"regcred", "other"}) {
			t.Errorf("%s pulls with %v, want regcred and other", key, secrets)
		}
		for name, c := range containersOf(spec) {
			if name == "modeguard" {
				if img := c["image"]; img != "modeguard:"+chart.AppVersion {
					t.Errorf("%s runs the driver's image %v, want the appVersion's modeguard:%s", key, img, chart.AppVersion)
				}
				if !slices.Contains(c["args"].([]any), any("--logging-format=json")) {
					t.Errorf("%s: the driver logs without --logging-format=json: %v", key, c["args"])
				}
				continue
			}
			if get(t, c, "securityContext", "readOnlyRootFilesystem") != true {
				t.Errorf("%s: sidecar %s lacks the sidecars' securityContext: %v", key, name, c["securityContext"])
			}
			want := "10m"
			switch name {
			case "csi-attacher":
				want = "20m"
			case "csi-addons":
				if get(t, c, "resources", "limits", "memory") != "64Mi" {
					t.Errorf("%s: csi-addons' own resources are not used: %v", key, c["resources"])
				}
				continue
			}
			if got := get(t, c, "resources", "requests", "cpu"); got != want {
				t.Errorf("%s: sidecar %s requests cpu %v, want %s", key, name, got, want)
			}
		}
	}
	for _, zone := range []string{"zone-a", "zone-b"} {
		ds := objs["DaemonSet/modeguard/modeguard-node-"+zone]
		sel := get(t, ds, "spec", "template", "spec", "nodeSelector").(map[string]any)
		if sel["disk"] != "ssd" || sel["topology.kubernetes.io/zone"] != zone {
			t.Errorf("node plugins of %s select %v, want disk=ssd and their zone", zone, sel)
		}
		if get(t, ds, "spec", "template", "spec", "affinity", "nodeAffinity") == nil {
			t.Errorf("node plugins of %s lack node.affinity", zone)
		}
	}
	if get(t, objs["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec", "affinity", "podAntiAffinity") == nil {
		t.Error("the controller lacks controller.affinity")
	}
	if got := fmt.Sprint(get(t, objs["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec", "hostAliases")); got != "[map[hostnames:[modeguard-target-zone-a.modeguard.svc] ip:10.0.0.7]]" {
		t.Errorf("the controller's hostAliases: %s", got)
	}
	block := objs["StorageClass/<nil>/modeguard-block"]
	if get(t, block, "metadata", "annotations", "storageclass.kubernetes.io/is-default-class") != "true" {
		t.Errorf("modeguard-block lacks its annotation: %v", block["metadata"])
	}
	if fmt.Sprint(block["mountOptions"]) != "[noatime]" || fmt.Sprint(objs["StorageClass/<nil>/modeguard-nfs"]["mountOptions"]) != "[nconnect=4]" {
		t.Errorf("mount options: block %v, nfs %v", block["mountOptions"], objs["StorageClass/<nil>/modeguard-nfs"]["mountOptions"])
	}
}

// TestChartPinsTheNFSServer: ganesha runs on the host's network on one
// node, and NFS volumes record that node's address, so that a replaced pod
// serves every existing volume at the address it recorded. By default that
// is the NFS target's StatefulSet, and the controllers, which reach it by
// its Service, are pinned nowhere; with nfs.servedBy=controller it is the
// controller itself, as releases before ran it. nfs.node pins it (the chart
// also finds a node by itself when it renders against a cluster, which helm
// template cannot show).
func TestChartPinsTheNFSServer(t *testing.T) {
	pinned := func(t *testing.T, obj map[string]any, container string) {
		t.Helper()
		spec := get(t, obj, "spec", "template", "spec").(map[string]any)
		if spec["hostNetwork"] != true {
			t.Error("ganesha's pod is not on the host's network")
		}
		if get(t, spec, "nodeSelector", "kubernetes.io/hostname") != "worker-7" {
			t.Errorf("ganesha's pod is not pinned to nfs.node: %v", spec["nodeSelector"])
		}
		if get(t, obj, "metadata", "annotations", "modeguard.csi.dev/nfs-node") != "worker-7" {
			t.Errorf("the pinned node is not recorded for the next upgrade: %v", obj["metadata"])
		}
		c := containersOf(spec)[container]
		if !slices.Contains(c["args"].([]any), any("--nfs-server=$(HOST_IP)")) {
			t.Errorf("NFS clients are not sent to the node's address: %v", c["args"])
		}
		var hostIP bool
		for _, e := range c["env"].([]any) {
			e := e.(map[string]any)
			hostIP = hostIP || (e["name"] == "HOST_IP" && get(t, e, "valueFrom", "fieldRef", "fieldPath") == "status.hostIP")
		}
		if !hostIP {
			t.Errorf("HOST_IP is not the node's status.hostIP: %v", c["env"])
		}
		var dirs []string
		for _, v := range spec["volumes"].([]any) {
			if hp, ok := v.(map[string]any)["hostPath"].(map[string]any); ok {
				dirs = append(dirs, hp["path"].(string))
			}
		}
		for _, want := range []string{"/var/lib/modeguard/nfs", "/var/lib/modeguard/ganesha"} {
			if !slices.Contains(dirs, want) {
				t.Errorf("ganesha's pod does not keep %s on its node: %v", want, dirs)
			}
		}
	}
	unpinned := func(t *testing.T, spec map[string]any) {
		t.Helper()
		if spec["hostNetwork"] != nil || spec["nodeSelector"] != nil {
			t.Errorf("the controller is pinned or on the host's network: %v %v", spec["hostNetwork"], spec["nodeSelector"])
		}
	}

	t.Run("the NFS target", func(t *testing.T) {
		objs := helmTemplate(t, "--set", "nfs.node=worker-7")
		target := objs["StatefulSet/modeguard/modeguard-nfs"]
		if target == nil {
			t.Fatal("no NFS target")
		}
		pinned(t, target, "modeguard")
		if n := get(t, target, "spec", "replicas"); n != 1.0 && n != 1 {
			t.Errorf("the NFS target runs %v replicas", n)
		}
		d := objs["Deployment/modeguard/modeguard-controller"]
		spec := get(t, d, "spec", "template", "spec").(map[string]any)
		unpinned(t, spec)
		if _, ok := get(t, d, "metadata").(map[string]any)["annotations"]; ok {
			t.Errorf("the controller still records an NFS node: %v", d["metadata"])
		}
		for _, a := range containersOf(spec)["modeguard"]["args"].([]any) {
			if strings.HasPrefix(a.(string), "--nfs-export-root") || strings.HasPrefix(a.(string), "--nfs-ganesha-dir") {
				t.Errorf("the controller keeps NFS on its node: %s", a)
			}
		}
	})
	t.Run("served by the controller", func(t *testing.T) {
		objs := helmTemplate(t, "--set", "nfs.node=worker-7", "--set", "nfs.servedBy=controller", "--set", "controller.replicas=1")
		if objs["StatefulSet/modeguard/modeguard-nfs"] != nil {
			t.Error("an NFS target beside the controller that serves NFS")
		}
		d := objs["Deployment/modeguard/modeguard-controller"]
		pinned(t, d, "modeguard")
		if s := get(t, d, "spec", "strategy", "type"); s != "Recreate" {
			t.Errorf("the NFS-serving controller is replaced by %v, not Recreate", s)
		}
	})
	t.Run("no NFS", func(t *testing.T) {
		objs := helmTemplate(t, "--set", "nfs.enabled=false")
		unpinned(t, get(t, objs["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec").(map[string]any))
		if objs["StatefulSet/modeguard/modeguard-nfs"] != nil {
			t.Error("an NFS target without NFS")
		}
	})
}

// TestChartMakesTheISCSISecrets: with iscsi and the defaults, the chart
// makes a CA, a client certificate for the controller and a server
// certificate for each zone's target naming the Service the controller
// dials, all signed by that CA, and a CHAP Secret; cert-manager makes them
// where the operator says so and the cluster has it.
func TestChartMakesTheISCSISecrets(t *testing.T) {
	objs := helmTemplate(t, "--set", "iscsi.enabled=true", "--set", "zones[0].name=zone-a", "--set", "zones[1].name=zone-b")
	cert := func(name, key string) *x509.Certificate { return secretCert(t, objs, name, key) }
	ca := cert("modeguard-iscsi-ca", "tls.crt")
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	controller := cert("modeguard-controller-tls", "tls.crt")
	if _, err := controller.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("the controller's certificate is no client certificate of the CA: %v", err)
	}
	if !cert("modeguard-controller-tls", "ca.crt").Equal(ca) {
		t.Error("the controller's Secret carries another CA")
	}
	for _, zone := range []string{"zone-a", "zone-b"} {
		name := "modeguard-target-" + zone
		target := cert(name+"-tls", "tls.crt")
		if _, err := target.Verify(x509.VerifyOptions{Roots: pool, DNSName: name + ".modeguard.svc",
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("%s's certificate does not serve %s.modeguard.svc for the CA: %v", name, name, err)
		}
	}
	if objs["Secret/modeguard/modeguard-iscsi-chap"] == nil {
		t.Error("no CHAP Secret")
	}
	node := containersOf(get(t, objs["DaemonSet/modeguard/modeguard-node-zone-a"], "spec", "template", "spec").(map[string]any))["modeguard"]
	if !slices.Contains(node["args"].([]any), any("--iscsi-chap-secret-file=/etc/modeguard/iscsi/$(NODE_NAME)")) {
		t.Errorf("the node plugin does not read its own key of the chart's CHAP Secret: %v", node["args"])
	}

	managed := helmTemplate(t, "--set", "iscsi.enabled=true", "--set", "tls.source=cert-manager",
		"--api-versions", "cert-manager.io/v1")
	for _, key := range []string{"Issuer/modeguard/modeguard-iscsi-ca", "Certificate/modeguard/modeguard-controller-tls", "Certificate/modeguard/modeguard-target-zone-a-tls"} {
		if managed[key] == nil {
			t.Errorf("with cert-manager: no %s", key)
		}
	}
	if managed["Secret/modeguard/modeguard-controller-tls"] != nil {
		t.Error("with cert-manager the chart still makes the certificates itself")
	}
}

// TestChartREADMEListsEveryValue: the chart's README has a row for every
// value in values.yaml and for none that is not there, so that it cannot
// go stale as values come and go.
func TestChartREADMEListsEveryValue(t *testing.T) {
	dir := filepath.Join(repo(t), "deploy", "helm", "modeguard")
	raw, err := os.ReadFile(filepath.Join(dir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values map[string]any
	if err := yaml.Unmarshal(raw, &values); err != nil {
		t.Fatal(err)
	}
	var want []string
	// Maps that hold one thing (an image, Kubernetes' own objects) are one
	// row each; every other map is a row per key.
	whole := map[string]bool{"image": true, "resources": true, "securityContext": true, "affinity": true,
		"nodeSelector": true, "parameters": true, "annotations": true, "labels": true}
	var walk func(prefix string, v any)
	walk = func(prefix string, v any) {
		m, ok := v.(map[string]any)
		if !ok || len(m) == 0 || whole[prefix[strings.LastIndex(prefix, ".")+1:]] {
			want = append(want, prefix)
			return
		}
		for k, sub := range m {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			walk(p, sub)
		}
	}
	walk("", values)
	readme, err := os.ReadFile(filepath.Join(dir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	// Rows: | `key` | default | meaning |
	row := regexp.MustCompile("(?m)^\\| `([^`]+)` \\|")
	var got []string
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		got = append(got, m[1])
	}
	sort.Strings(want)
	sort.Strings(got)
	for _, k := range want {
		if !slices.Contains(got, k) {
			t.Errorf("the chart's README has no row for %s", k)
		}
	}
	for _, k := range got {
		if !slices.Contains(want, k) {
			t.Errorf("the chart's README lists %s, which values.yaml does not have", k)
		}
	}
}

// ianaServiceName is what Kubernetes accepts as a port's name.
var ianaServiceName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$`)

// TestChartServesSnapshotMetadata: where the cluster serves the
// SnapshotMetadataService CRD, the controller pod runs the
// csi-snapshot-metadata sidecar on the driver's socket, serving the chart's
// certificate, and the driver's SnapshotMetadataService tells clients the
// address to dial and the CA to trust: a CA under which the sidecar's
// certificate is valid for that address, the Service's name by default,
// the address's IP when one is set. Without the CRD, or without the
// snapshotter, nothing of it is rendered; enabled false renders nothing
// even with the CRD.
func TestChartServesSnapshotMetadata(t *testing.T) {
	const (
		crd      = "cbt.storage.k8s.io/v1alpha1/SnapshotMetadataService"
		snapshot = "snapshot.storage.k8s.io/v1/VolumeSnapshotClass"
		sms      = "SnapshotMetadataService/<nil>/modeguard.csi.dev"
	)
	for _, tc := range []struct {
		name   string
		args   []string
		served bool
	}{
		{"a bare cluster", nil, false},
		{"the snapshot CRDs only", []string{"--api-versions", snapshot}, false},
		{"the CRD, without the snapshotter", []string{"--api-versions", crd, "--set", "sidecars.snapshotter.enabled=false"}, false},
		{"the CRD, enabled false", []string{"--api-versions", crd, "--set", "snapshotMetadata.enabled=false"}, false},
		{"enabled true without the CRD", []string{"--set", "snapshotMetadata.enabled=true"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := helmTemplate(t, tc.args...)
			controller := containersOf(get(t, objs["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec").(map[string]any))
			if _, ok := controller["csi-snapshot-metadata"]; ok != tc.served {
				t.Errorf("csi-snapshot-metadata sidecar rendered: %v, want %v", ok, tc.served)
			}
			if _, ok := objs[sms]; ok != tc.served {
				t.Errorf("SnapshotMetadataService rendered: %v, want %v", ok, tc.served)
			}
		})
	}

	decodeCert := func(t *testing.T, b64 string) *x509.Certificate {
		t.Helper()
		raw, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			t.Fatal(err)
		}
		block, _ := pem.Decode(raw)
		if block == nil {
			t.Fatalf("no PEM: %q", raw)
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for _, tc := range []struct {
		name, address, wantAddress, verifyName string
	}{
		{"the Service", "", "modeguard-snapshot-metadata.modeguard.svc:50051", "modeguard-snapshot-metadata.modeguard.svc"},
		{"an address of a node", "127.0.0.1:50051", "127.0.0.1:50051", "127.0.0.1"},
		{"a name of the operator's", "backup.example.com:443", "backup.example.com:443", "backup.example.com"},
	} {
		t.Run("dialled at "+tc.name, func(t *testing.T) {
			args := []string{"--api-versions", crd}
			if tc.address != "" {
				args = append(args, "--set", "snapshotMetadata.address="+tc.address)
			}
			objs := helmTemplate(t, args...)
			service := objs[sms]
			if service == nil {
				t.Fatalf("no %s", sms)
			}
			if got := get(t, service, "spec", "address"); got != tc.wantAddress {
				t.Errorf("the SnapshotMetadataService's address is %v, want %s", got, tc.wantAddress)
			}
			if got := get(t, service, "spec", "audience"); got != "snapshot-metadata.modeguard.csi.dev" {
				t.Errorf("the SnapshotMetadataService's audience is %v", got)
			}
			ca := decodeCert(t, get(t, service, "spec", "caCert").(string))
			if caSecret := objs["Secret/modeguard/modeguard-snapshot-metadata-ca"]; caSecret == nil ||
				!decodeCert(t, get(t, caSecret, "data", "tls.crt").(string)).Equal(ca) {
				t.Error("the SnapshotMetadataService hands out another CA than the chart's modeguard-snapshot-metadata-ca")
			}
			tlsSecret := objs["Secret/modeguard/modeguard-snapshot-metadata-tls"]
			if tlsSecret == nil {
				t.Fatal("no Secret modeguard-snapshot-metadata-tls")
			}
			pool := x509.NewCertPool()
			pool.AddCert(ca)
			leaf := decodeCert(t, get(t, tlsSecret, "data", "tls.crt").(string))
			if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: tc.verifyName,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
				t.Errorf("the sidecar's certificate does not serve %s for the SnapshotMetadataService's CA: %v", tc.verifyName, err)
			}

			spec := get(t, objs["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec").(map[string]any)
			containers := containersOf(spec)
			sidecar, driver := containers["csi-snapshot-metadata"], containers["modeguard"]
			if sidecar == nil {
				t.Fatal("no csi-snapshot-metadata container in the controller pod")
			}
			if image := sidecar["image"]; image != "registry.k8s.io/sig-storage/csi-snapshot-metadata:v0.2.0" {
				t.Errorf("the sidecar runs %v", image)
			}
			for _, want := range []string{"--csi-address=/csi/csi.sock", "--port=50051",
				"--tls-cert=/etc/snapshot-metadata/tls/tls.crt", "--tls-key=/etc/snapshot-metadata/tls/tls.key"} {
				if !slices.Contains(sidecar["args"].([]any), any(want)) {
					t.Errorf("the sidecar's arguments %v lack %s", sidecar["args"], want)
				}
			}
			if !strings.Contains(fmt.Sprint(driver["args"]), "--endpoint=unix:///csi/csi.sock") {
				t.Errorf("the driver does not serve /csi/csi.sock, which the sidecar dials: %v", driver["args"])
			}
			mounts := map[string]string{}
			for _, m := range sidecar["volumeMounts"].([]any) {
				m := m.(map[string]any)
				mounts[m["mountPath"].(string)] = m["name"].(string)
			}
			if mounts["/csi"] != "socket-dir" || mounts["/etc/snapshot-metadata/tls"] != "snapshot-metadata-tls" {
				t.Errorf("the sidecar mounts %v, want socket-dir at /csi and snapshot-metadata-tls at /etc/snapshot-metadata/tls", mounts)
			}
			var secretName any
			for _, v := range spec["volumes"].([]any) {
				if v := v.(map[string]any); v["name"] == "snapshot-metadata-tls" {
					secretName = get(t, v, "secret", "secretName")
				}
			}
			if secretName != "modeguard-snapshot-metadata-tls" {
				t.Errorf("the sidecar's certificate volume is Secret %v, want modeguard-snapshot-metadata-tls", secretName)
			}
			if port := get(t, objs["Service/modeguard/modeguard-snapshot-metadata"], "spec", "ports", 0, "port"); fmt.Sprint(port) != "50051" {
				t.Errorf("the Service's port is %v", port)
			}
			// Kubernetes refuses a port name that is no IANA service name
			// (at most 15 characters), which helm template does not check.
			target := get(t, objs["Service/modeguard/modeguard-snapshot-metadata"], "spec", "ports", 0, "targetPort")
			var named bool
			for _, p := range sidecar["ports"].([]any) {
				name, _ := p.(map[string]any)["name"].(string)
				if !ianaServiceName.MatchString(name) {
					t.Errorf("the sidecar's port name %q is no IANA service name", name)
				}
				named = named || name == target
			}
			if !named {
				t.Errorf("the Service targets port %v, which the sidecar does not name", target)
			}
			subject := get(t, objs["ClusterRoleBinding/<nil>/modeguard-snapshot-metadata"], "subjects", 0, "name")
			if subject != "modeguard-controller" || spec["serviceAccountName"] != "modeguard-controller" {
				t.Errorf("the sidecar's RBAC is bound to %v, the pod runs as %v", subject, spec["serviceAccountName"])
			}
		})
	}
}

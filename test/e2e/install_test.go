package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// What the chart's install promises on a running cluster: the NFS server's
// address outlives the controller's pod, and a release that would leave a
// zone's nodes without node plugins is refused.

const (
	driverNamespace = "modeguard"
	controllerName  = "modeguard-controller"
	nfsNodeKey      = "modeguard.csi.dev/nfs-node"
)

// controllerPod is the one controller pod that is not being deleted.
func (c *cluster) controllerPod() (*corev1.Pod, error) {
	l, err := c.cs.CoreV1().Pods(driverNamespace).List(c.ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controller"})
	if err != nil {
		return nil, err
	}
	var live []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			live = append(live, p)
		}
	}
	if len(live) != 1 {
		return nil, fmt.Errorf("%d controller pods", len(live))
	}
	return &live[0], nil
}

// waitNewController waits for a ready controller pod other than old.
func (c *cluster) waitNewController(old types.UID) *corev1.Pod {
	c.t.Helper()
	var p *corev1.Pod
	c.waitFor("a new controller pod ready", 2*startTimeout, func() (bool, error) {
		var err error
		p, err = c.controllerPod()
		if err != nil {
			return false, err
		}
		return p.UID != old && podReady(p), fmt.Errorf("pod %s ready=%v", p.Name, podReady(p))
	})
	return p
}

// nfsRead reads file from the volume's export with libnfs from this host,
// retrying while a restarted ganesha is in its grace period.
func (c *cluster) nfsRead(url string) string {
	c.t.Helper()
	var out []byte
	c.waitFor("reading "+url, startTimeout, func() (bool, error) {
		var stderr bytes.Buffer
		cmd := exec.CommandContext(c.ctx, "nfs-cat", url)
		cmd.Stderr = &stderr
		var err error
		out, err = cmd.Output()
		if err != nil {
			return false, fmt.Errorf("nfs-cat: %v: %s", err, strings.TrimSpace(stderr.String()))
		}
		return true, nil
	})
	return string(out)
}

// TestNFSSurvivesItsControllerPodBeingReplaced: an NFS volume made before
// the controller's pod is replaced (a new pod template, as an upgrade
// makes; an eviction by a drain) is served afterwards at the address its
// PersistentVolume names, with its data, and attaches to a new pod. The
// address is the pinned NFS node's, so it cannot move. This machine's
// kernel has no NFS client: the data is written and read with libnfs from
// the host, whose address is the NFS node's, and the pods' own mounts are
// what test/vm covers.
func TestNFSSurvivesItsControllerPodBeingReplaced(t *testing.T) {
	for _, tool := range []string{"nfs-cp", "nfs-cat"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s (libnfs-utils) is needed to reach the export from this host: %v", tool, err)
		}
	}
	c := setup(t)
	dep, err := c.cs.AppsV1().Deployments(driverNamespace).Get(c.ctx, controllerName, metav1.GetOptions{})
	if err != nil {
		c.fatalf("the controller Deployment: %v", err)
	}
	nfsNode := dep.Annotations[nfsNodeKey]
	if nfsNode == "" {
		c.fatalf("the controller Deployment has no %s annotation: the chart did not pin the NFS server", nfsNodeKey)
	}
	if got := dep.Spec.Template.Spec.NodeSelector["kubernetes.io/hostname"]; got != nfsNode || !dep.Spec.Template.Spec.HostNetwork {
		c.fatalf("the controller runs on %q (hostNetwork %v), want pinned to the NFS node %s on the host's network",
			got, dep.Spec.Template.Spec.HostNetwork, nfsNode)
	}

	c.create(&corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "nfs-moves"},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr("modeguard-nfs"),
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: resource.MustParse("64Mi")}},
		},
	})
	pv := c.boundPV("nfs-moves")
	server, share := pv.Spec.CSI.VolumeAttributes["nfsServer"], pv.Spec.CSI.VolumeAttributes["nfsShare"]
	node, err := c.cs.CoreV1().Nodes().Get(c.ctx, nfsNode, metav1.GetOptions{})
	if err != nil {
		c.fatalf("the NFS node %s: %v", nfsNode, err)
	}
	var nodeIP string
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			nodeIP = a.Address
		}
	}
	if server == "" || server != nodeIP {
		c.fatalf("the volume records NFS server %q; want the NFS node %s's address %s", server, nfsNode, nodeIP)
	}
	url := "nfs://" + server + share + "/data?version=4"
	if port := pv.Spec.CSI.VolumeAttributes["nfsPort"]; port != "" && port != "2049" {
		url += "&nfsport=" + port
	}

	// A pod on the NFS node attaches the volume: the export opens to that
	// node's address, which is also this host's.
	pod := func(name string) *corev1.Pod { return pinnedPod(name, "nfs-moves", nfsNode) }
	c.create(pod("moves-a"))
	c.waitExportClients(pv, server+" RW")
	want := fmt.Sprintf("written before the controller moved, %s\n", time.Now().UTC().Format(time.RFC3339Nano))
	src := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(src, []byte(want), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.CommandContext(c.ctx, "nfs-cp", src, url).CombinedOutput(); err != nil {
		c.fatalf("nfs-cp %s %s: %v: %s", src, url, err, out)
	}

	check := func(after string, p *corev1.Pod) {
		c.t.Helper()
		if p.Spec.NodeName != nfsNode || p.Status.HostIP != server {
			c.fatalf("after %s the controller runs on %s at %s; its volumes name %s", after, p.Spec.NodeName, p.Status.HostIP, server)
		}
		c.waitExportClients(pv, server+" RW")
		if got := c.nfsRead(url); got != want {
			c.fatalf("after %s the volume holds %q, want %q", after, got, want)
		}
		t.Logf("after %s: served at %s%s with its data", after, server, share)
	}

	// A new pod template, as helm upgrade makes: the Deployment recreates
	// the pod.
	old, err := c.controllerPod()
	if err != nil {
		c.fatalf("%v", err)
	}
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"e2e.modeguard.csi.dev/restarted-at":%q}}}}}`, time.Now().Format(time.RFC3339Nano))
	if _, err := c.cs.AppsV1().Deployments(driverNamespace).Patch(c.ctx, controllerName, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		c.fatalf("restarting the controller: %v", err)
	}
	check("a new pod template", c.waitNewController(old.UID))

	// A drain: the node cordoned, the pod evicted. Its replacement cannot
	// go anywhere else (the data is on this node's disk) and waits for the
	// node.
	cordon := func(on bool) {
		patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, on)
		if _, err := c.cs.CoreV1().Nodes().Patch(c.ctx, nfsNode, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			c.fatalf("cordon %s = %v: %v", nfsNode, on, err)
		}
	}
	cordon(true)
	t.Cleanup(func() { cordon(false) })
	old, err = c.controllerPod()
	if err != nil {
		c.fatalf("%v", err)
	}
	if err := c.cs.PolicyV1().Evictions(driverNamespace).Evict(c.ctx, &policyv1.Eviction{
		ObjectMeta: metav1.ObjectMeta{Name: old.Name, Namespace: driverNamespace}}); err != nil {
		c.fatalf("evicting the controller: %v", err)
	}
	var pending *corev1.Pod
	c.waitFor("the evicted controller's replacement waiting for its node", startTimeout, func() (bool, error) {
		p, err := c.controllerPod()
		if err != nil {
			return false, err
		}
		pending = p
		return p.UID != old.UID && p.Spec.NodeName == "", fmt.Errorf("pod %s on %q", p.Name, p.Spec.NodeName)
	})
	time.Sleep(5 * time.Second)
	if p, err := c.controllerPod(); err != nil || p.Spec.NodeName != "" {
		c.fatalf("while %s is cordoned the controller went to %v (%v): NFS data lives on that node", nfsNode, p, err)
	}
	cordon(false)
	if p := c.waitNewController(old.UID); p.UID != pending.UID {
		c.fatalf("the controller that came up is %s, not the replacement %s that waited for %s", p.Name, pending.Name, nfsNode)
	} else {
		check("a drain", p)
	}

	// The README's recipe, in the new pod: who holds the volume.
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(c.ctx, filepath.Join(c.build, "k8s", "bin", "kubectl"), "--kubeconfig", os.Getenv("MODEGUARD_E2E_KUBECONFIG"),
		"-n", driverNamespace, "exec", "deploy/"+controllerName, "-c", "modeguard", "--", "modeguard", "inspect",
		"--nfs-export-root", "/var/lib/modeguard/nfs", "--nfs-export-config-dir", "/var/lib/modeguard/ganesha/exports", pv.Spec.CSI.VolumeHandle)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		c.fatalf("kubectl exec ... modeguard inspect: %v: %s", err, stderr.String())
	}
	if !strings.Contains(stdout.String(), "attached to: "+nfsNode+"@") || !strings.Contains(stdout.String(), server) {
		c.fatalf("inspect in the new controller does not show the volume attached to %s with its client %s:\n%s", nfsNode, server, stdout.String())
	}

	// A new pod of the claim attaches through the new controller.
	c.deletePodAndWait("moves-a")
	c.waitExportClients(pv, "")
	c.create(pod("moves-b"))
	check("a new pod of the claim", c.waitNewControllerOrSame())
	c.deletePodAndWait("moves-b")
	c.deleteClaimAndWait("nfs-moves", pv.Name)
}

// waitNewControllerOrSame is the ready controller pod, whichever it is.
func (c *cluster) waitNewControllerOrSame() *corev1.Pod {
	c.t.Helper()
	var p *corev1.Pod
	c.waitFor("a ready controller pod", startTimeout, func() (bool, error) {
		var err error
		p, err = c.controllerPod()
		return err == nil && podReady(p), err
	})
	return p
}

// TestChartRefusesToLeaveAZoneWithoutNodePlugins: an upgrade whose zones
// leave out a zone the cluster's nodes are in is refused, naming the zone,
// before anything changes (the chart reads the nodes at render time); with
// every zone listed the same upgrade renders.
func TestChartRefusesToLeaveAZoneWithoutNodePlugins(t *testing.T) {
	c := setup(t)
	helm := os.Getenv("HELM")
	if helm == "" {
		helm = filepath.Join(c.build, "tools", "helm")
	}
	values := filepath.Join(c.build, "helm-values.yaml")
	if _, err := os.Stat(values); err != nil {
		c.fatalf("the values hack/local-cluster/deploy.sh installed with: %v", err)
	}
	_, self, _, _ := runtime.Caller(0)
	chart := filepath.Join(filepath.Dir(self), "..", "..", "deploy", "helm", "modeguard")
	upgrade := func(extra ...string) (string, error) {
		args := append([]string{"upgrade", "modeguard", chart, "--namespace", driverNamespace, "--kubeconfig", os.Getenv("MODEGUARD_E2E_KUBECONFIG"),
			"--dry-run=server", "--values", values}, extra...)
		out, err := exec.CommandContext(c.ctx, helm, args...).CombinedOutput()
		return string(out), err
	}
	out, err := upgrade("--set-json", `zones=[{"name":"zone-a"}]`)
	if err == nil {
		c.fatalf("an upgrade leaving zone-b's node %s without a node plugin rendered:\n%s", nodeB, out)
	}
	for _, part := range []string{"zone-b", "allowUnservedZones"} {
		if !strings.Contains(out, part) {
			c.fatalf("the refusal does not name %q:\n%s", part, out)
		}
	}
	out, err = upgrade()
	if err != nil {
		c.fatalf("the installed values no longer render: %v\n%s", err, out)
	}
	for _, ds := range []string{"modeguard-node-zone-a", "modeguard-node-zone-b"} {
		if !strings.Contains(out, "name: "+ds+"\n") {
			c.fatalf("the upgrade does not keep DaemonSet %s:\n%s", ds, out)
		}
	}
}

package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// previousChart is the commit of the last chart whose controller served NFS
// itself (one replica, pinned to the NFS node): the release an operator
// upgrades from.
const previousChart = "8c0afeb"

// deployChart installs chart (a directory) on the VM cluster as vm-deploy.sh
// does, with values (vm-helm-values.yaml of chart's release; empty: this
// one's), and waits for every workload of the release.
func (c *cluster) deployChart(chart, values string) {
	c.t.Helper()
	dir := os.Getenv("MODEGUARD_E2E_VM_DIR")
	if dir == "" {
		c.t.Skip("no VM cluster: set MODEGUARD_E2E_VM_DIR (make test-e2e-vm does)")
	}
	cmd := exec.Command(filepath.Join("..", "..", "hack", "local-cluster", "vm-deploy.sh"))
	cmd.Env = append(os.Environ(), "CLUSTER_DIR="+filepath.Dir(dir), "CHART="+chart)
	if values != "" {
		cmd.Env = append(cmd.Env, "VM_VALUES="+values)
	}
	t0 := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		c.fatalf("vm-deploy.sh with %s: %v\n%s", chart, err, out)
	}
	c.t.Logf("installed %s in %s", chart, time.Since(t0).Round(time.Second))
}

// TestChartUpgradeMovesNFSToItsTarget: a release of the previous chart,
// whose one controller serves NFS from its node, is upgraded to this chart
// while a pod on another node appends synced lines to an NFS volume. The
// NFS target takes over on the same node, with the same directories and
// address (the volume's PersistentVolume, which cannot change, still names
// it); the pod is never restarted and loses no acknowledged line (ganesha
// restarts once, and the client reclaims its state in the grace period);
// the two new controller replicas make and attach a new NFS volume; and the
// old one moves to another node with everything the writer wrote.
func TestChartUpgradeMovesNFSToItsTarget(t *testing.T) {
	nfsNodes(t)
	c := setup(t)
	previous := t.TempDir()
	// The chart and the VM cluster's values of that release: an operator
	// upgrades with the values file they kept, which that chart's schema
	// takes.
	archive := exec.Command("sh", "-c", fmt.Sprintf("git -C ../.. archive %s deploy/helm/modeguard hack/local-cluster/vm-helm-values.yaml | tar -x -C %s",
		previousChart, previous))
	if out, err := archive.CombinedOutput(); err != nil {
		c.fatalf("the previous chart (%s): %v: %s (a clone with history is needed)", previousChart, err, out)
	}
	current, err := filepath.Abs(filepath.Join("..", "..", "deploy", "helm", "modeguard"))
	if err != nil {
		c.fatalf("%v", err)
	}
	// Whatever happens, the other stories find this chart installed.
	t.Cleanup(func() {
		if t.Failed() {
			c.deployChart(current, "")
		}
	})

	c.deployChart(filepath.Join(previous, "deploy", "helm", "modeguard"), filepath.Join(previous, "hack", "local-cluster", "vm-helm-values.yaml"))
	dep, err := c.cs.AppsV1().Deployments(driverNamespace).Get(c.ctx, controllerName, metav1.GetOptions{})
	if err != nil {
		c.fatalf("the previous release's controller: %v", err)
	}
	nfsNode := dep.Annotations[nfsNodeKey]
	if nfsNode == "" || *dep.Spec.Replicas != 1 {
		c.fatalf("the previous chart did not install one controller pinned to an NFS node: %d replicas, annotation %q", *dep.Spec.Replicas, nfsNode)
	}

	c.create(nfsClaim("before", corev1.ReadWriteOnce))
	pv := c.boundPV("before")
	server := pv.Spec.CSI.VolumeAttributes["nfsServer"]
	c.create(withCommand(pinnedPod("writer", "before", nodeA1), stampLoop("/data/log")))
	c.waitRunning("writer")
	lines := func() []string {
		return strings.Split(strings.TrimSpace(c.mustExec("writer", "cat", "/data/log")), "\n")
	}
	c.waitFor("the writer's first lines", startTimeout, func() (bool, error) {
		return len(lines()) >= 10, nil
	})

	upgraded := time.Now()
	c.deployChart(current, "")
	took := time.Since(upgraded)

	// The NFS target on the NFS node, serving the volume at the address
	// its PersistentVolume names.
	sts, err := c.cs.AppsV1().StatefulSets(driverNamespace).Get(c.ctx, "modeguard-nfs", metav1.GetOptions{})
	if err != nil {
		c.fatalf("the NFS target after the upgrade: %v", err)
	}
	if got := sts.Annotations[nfsNodeKey]; got != nfsNode {
		c.fatalf("the NFS target is pinned to %q; the previous release served NFS from %s", got, nfsNode)
	}
	targets, err := c.cs.CoreV1().Pods(driverNamespace).List(c.ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=nfs-target"})
	if err != nil || len(targets.Items) != 1 || targets.Items[0].Status.HostIP != server {
		c.fatalf("the NFS target does not run at %s, the address the volume records: %v %v", server, targets, err)
	}
	if dep, err = c.cs.AppsV1().Deployments(driverNamespace).Get(c.ctx, controllerName, metav1.GetOptions{}); err != nil || *dep.Spec.Replicas != 2 {
		c.fatalf("the controller after the upgrade: %v %v", dep, err)
	}

	// The writer goes on: never restarted, every acknowledged line there.
	c.waitFor("the writer writing after the upgrade", startTimeout, func() (bool, error) {
		last := lines()
		var sec, n int64
		_, err := fmt.Sscanf(last[len(last)-1], "%d %d", &sec, &n)
		return err == nil && sec > upgraded.Add(took).Unix(), fmt.Errorf("last line %q", last[len(last)-1])
	})
	p := c.pod("writer")
	if r := p.Status.ContainerStatuses[0].RestartCount; r != 0 {
		c.fatalf("the writer restarted %d times across the upgrade", r)
	}
	log := lines()
	for i, line := range log {
		var sec, n int64
		if _, err := fmt.Sscanf(line, "%d %d", &sec, &n); err != nil || n != int64(i+1) {
			c.fatalf("line %d of the writer's log is %q: an acknowledged line is missing or repeated", i+1, line)
		}
	}
	pause, _ := longestPause(strings.Join(log, "\n"), upgraded, upgraded.Add(took))
	t.Logf("upgraded in %s; the writer's longest pause meanwhile %s, %d lines in all", took.Round(time.Second), pause, len(log))

	// The new controllers make and attach a new NFS volume.
	c.create(nfsClaim("after", corev1.ReadWriteOnce))
	c.create(withCommand(pinnedPod("new", "after", nodeA2), "echo made-after > /data/f; exec sleep 1000000"))
	c.waitRunning("new")
	if got := strings.TrimSpace(c.mustExec("new", "cat", "/data/f")); got != "made-after" {
		c.fatalf("the volume made after the upgrade reads %q", got)
	}
	if after := c.boundPV("after"); after.Spec.CSI.VolumeAttributes["nfsServer"] != server {
		c.fatalf("the volume made after the upgrade is served at %s, not %s", after.Spec.CSI.VolumeAttributes["nfsServer"], server)
	}

	// The old volume moves to another node with every line.
	c.deletePodAndWait("writer")
	c.create(pinnedPod("reader", "before", nodeA2))
	c.waitRunning("reader")
	got := strings.Split(strings.TrimSpace(c.mustExec("reader", "cat", "/data/log")), "\n")
	if len(got) < len(log) || got[len(log)-1] != log[len(log)-1] {
		c.fatalf("on %s the volume holds %d lines, the writer had acknowledged %d (last %q)", nodeA2, len(got), len(log), log[len(log)-1])
	}
}

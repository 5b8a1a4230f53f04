package e2e

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Story node-restart: a pod's node reboots (hack/local-cluster/reboot-node.sh:
// kubelet, containerd and pods killed, every mount and loop device of the
// node gone, its disk kept) and the pod comes back with its data. The
// node's kernel is the machine's, so its boot id does not change: the driver
// must see from the mount table and the loop devices that its records no
// longer hold.
func TestNodeRestartKeepsPodData(t *testing.T) {
	c := setup(t)
	c.create(c.example("node-restart.yaml")...)
	pod := c.waitRunning("node-restart")
	node, uid := pod.Spec.NodeName, pod.UID
	pv := c.boundPV("node-restart-claim")
	token := make([]byte, 16)
	if _, err := rand.Read(token); err != nil {
		c.fatalf("%v", err)
	}
	kept := hex.EncodeToString(token)
	c.mustExec("node-restart", "sh", "-c", "echo "+kept+" > /data/kept && sync")

	rebootedAt := time.Now()
	script := filepath.Join(filepath.Dir(c.build), "hack", "local-cluster", "reboot-node.sh")
	cmd := exec.Command("bash", script, node)
	cmd.Env = append(os.Environ(), "BUILD_DIR="+c.build)
	out, err := cmd.CombinedOutput()
	t.Logf("reboot-node.sh %s:\n%s", node, out)
	if err != nil {
		c.fatalf("rebooting node %s: %v", node, err)
	}

	c.waitFor("node-restart running again after the reboot", 3*startTimeout, func() (bool, error) {
		p, err := c.cs.CoreV1().Pods(c.ns).Get(c.ctx, "node-restart", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		return podReady(p) && startedAfter(p, rebootedAt), nil
	})
	if pod.UID != uid || pod.Spec.NodeName != node {
		c.fatalf("the pod came back as another pod or on another node (%s)", pod.Spec.NodeName)
	}
	// A kubelet just started may not serve exec for the pod yet.
	var got string
	c.waitFor("exec in node-restart", startTimeout, func() (bool, error) {
		out, _, err := c.exec("node-restart", "cat", "/data/kept")
		got = strings.TrimSpace(out)
		return err == nil, err
	})
	if got != kept {
		c.fatalf("after the reboot the pod reads %q from its volume, want %q", got, kept)
	}
	// Each start of the container appended a line: the second start found
	// the first one's, so the volume it started on was the volume, not an
	// empty directory.
	if boots := strings.Fields(c.mustExec("node-restart", "wc", "-l", "/data/boots")); len(boots) == 0 || boots[0] != "2" {
		c.fatalf("/data/boots has %v lines, want 2 (one per start of the pod)", boots)
	}
	c.mustExec("node-restart", "sh", "-c", "echo after > /data/after-reboot && sync")

	// Once the pod is gone and the volume unmounted, none of what the pod
	// wrote lies on the node's own disk.
	c.deletePodAndWait("node-restart")
	nodeDir := filepath.Join(c.build, "cluster", "nodes", node)
	c.waitFor("the volume unmounted from "+node, startTimeout, func() (bool, error) {
		return !volumeMountedBelow(nodeDir, pv), nil
	})
	var landed []string
	_ = filepath.WalkDir(nodeDir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			switch d.Name() {
			case "kept", "boots", "after-reboot":
				landed = append(landed, p)
			}
		}
		return nil
	})
	if len(landed) > 0 {
		c.fatalf("the pod's files landed on the node's disk: %v", landed)
	}
}

// startedAfter reports whether every container of p runs since after t.
func startedAfter(p *corev1.Pod, t time.Time) bool {
	if len(p.Status.ContainerStatuses) == 0 {
		return false
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.State.Running == nil || cs.State.Running.StartedAt.Time.Before(t.Truncate(time.Second)) {
			return false
		}
	}
	return true
}

// volumeMountedBelow reports whether a mount below dir is one the kubelet
// made for pv: its staging mount (named after the SHA-256 of the volume
// handle) or a pod's mount of it (named after the PV).
func volumeMountedBelow(dir string, pv *corev1.PersistentVolume) bool {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return true
	}
	sum := sha256.Sum256([]byte(pv.Spec.CSI.VolumeHandle))
	staging := "/" + hex.EncodeToString(sum[:]) + "/"
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || !strings.HasPrefix(f[4], dir+"/") {
			continue
		}
		if strings.Contains(f[4], "/"+pv.Name+"/") || strings.Contains(f[4], staging) {
			return true
		}
	}
	return false
}

// A node plugin restarted while it has a volume staged (a rollout, an
// upgrade, a crash) must still detach that volume's loop device when the
// pod goes. The new plugin's container sees the pool through a mount of
// its own: the kernel names the old binding's file relative to the old
// container's mount, which is gone.
func TestPluginRestartThenUnstageDetaches(t *testing.T) {
	c := setup(t)
	c.create(c.example("node-restart.yaml")...)
	pod := c.waitRunning("node-restart")
	node := pod.Spec.NodeName
	pv := c.boundPV("node-restart-claim")
	image := c.blockImage(pv, c.zoneOf(node))
	if len(loopDevicesNaming(image)) == 0 {
		c.fatalf("no loop device names %s while node-restart runs", filepath.Base(image))
	}

	plugins, err := c.cs.CoreV1().Pods("modeguard").List(c.ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=node", FieldSelector: "spec.nodeName=" + node})
	if err != nil || len(plugins.Items) != 1 {
		c.fatalf("the node plugin on %s: %d pods, %v", node, len(plugins.Items), err)
	}
	old := plugins.Items[0]
	if err := c.cs.CoreV1().Pods("modeguard").Delete(c.ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		c.fatalf("deleting the node plugin %s: %v", old.Name, err)
	}
	c.waitFor("a new node plugin ready on "+node, 2*startTimeout, func() (bool, error) {
		l, err := c.cs.CoreV1().Pods("modeguard").List(c.ctx, metav1.ListOptions{
			LabelSelector: "app.kubernetes.io/component=node", FieldSelector: "spec.nodeName=" + node})
		if err != nil {
			return false, err
		}
		for i := range l.Items {
			if l.Items[i].UID != old.UID && podReady(&l.Items[i]) {
				return true, nil
			}
		}
		return false, nil
	})

	c.deletePodAndWait("node-restart")
	nodeDir := filepath.Join(c.build, "cluster", "nodes", node)
	c.waitFor("the volume unmounted from "+node, startTimeout, func() (bool, error) {
		return !volumeMountedBelow(nodeDir, pv), nil
	})
	c.waitFor("no loop device naming "+filepath.Base(image), startTimeout, func() (bool, error) {
		return len(loopDevicesNaming(image)) == 0, nil
	})
}

// loopDevicesNaming lists the loop devices whose backing file has image's
// name, however the kernel spells the path (from whichever mount it was
// opened through).
func loopDevicesNaming(image string) []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.Contains(string(b), "/"+filepath.Base(image)) {
			out = append(out, filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}

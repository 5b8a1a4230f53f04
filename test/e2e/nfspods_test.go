package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The stories of this file mount NFS volumes in pods, so they need nodes
// whose kernel has the NFS client: the cluster of hack/local-cluster/vm-up.sh,
// whose worker nodes are VMs (make test-e2e-vm). The local cluster's nodes
// share a host kernel without one; TestNFSExportFollowsAttachments is its
// part of the story.

// nfsNodes skips the test unless MODEGUARD_E2E_NFS_CLIENTS=1 says the
// cluster's nodes can mount NFS.
func nfsNodes(t *testing.T) {
	t.Helper()
	if os.Getenv("MODEGUARD_E2E_NFS_CLIENTS") != "1" {
		t.Skip("the nodes have no NFS client: set MODEGUARD_E2E_NFS_CLIENTS=1 on a cluster whose nodes do (make test-e2e-vm)")
	}
}

func nfsClaim(name string, mode corev1.PersistentVolumeAccessMode) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{mode},
			StorageClassName: ptr("modeguard-nfs"),
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: resource.MustParse("64Mi")}},
		},
	}
}

// withCommand gives a pod's first container a shell command.
func withCommand(p *corev1.Pod, script string) *corev1.Pod {
	p.Spec.Containers[0].Command = []string{"sh", "-c", script}
	return p
}

// appendLoop is a writer: every half second a line "<hostname> <n>" appended
// to file and synced, so each line a pod wrote is on the server.
func appendLoop(file string) string {
	return `n=0; while true; do n=$((n+1)); echo "$(hostname) $n" >> ` + file + `; sync; sleep 0.5; done`
}

// Story 000 on NFS, with pods: three replicas of a Deployment share one
// ReadWriteOnce claim across two nodes. The replicas on the node the volume
// is attached to run and write the same file; the one on the other node is
// refused, and its event says so. Several containers of one pod share the
// claim as well: ReadWriteOnce is one node, not one container.
func TestNFSRWODeploymentOnTwoNodes(t *testing.T) {
	nfsNodes(t)
	c := setupBeside(t)
	// An NFS volume has no zone: an export is reachable from every zone.
	holder, _ := rwoDeploymentStaysOnOneNode(c, "modeguard-nfs", nil)

	// Two containers of one pod on the holding node: each reads what the
	// other wrote.
	two := withCommand(pinnedPod("two-containers", "rwo-shared", holder), "echo first > /data/first; exec sleep 1000000")
	second := two.Spec.Containers[0]
	second.Name = "second"
	second.Command = []string{"sh", "-c", "echo second > /data/second; exec sleep 1000000"}
	two.Spec.Containers = append(two.Spec.Containers, second)
	c.create(two)
	c.waitRunning("two-containers")
	for _, ctr := range []string{"app", "second"} {
		c.waitFor("container "+ctr+" reading both files", 30*time.Second, func() (bool, error) {
			out, _, err := c.execIn(c.ns, "two-containers", ctr, "cat", "/data/first", "/data/second")
			return err == nil && out == "first\nsecond\n", fmt.Errorf("read %q: %v", out, err)
		})
	}
}

// Story 000's rolling update on NFS: a Deployment of one replica on a
// ReadWriteOnce claim is moved to another node. With the default strategy
// (a new pod before the old one goes) the new pod is refused while the old
// one writes: the rollout waits, and no two nodes ever write. With
// maxSurge 0 the old pod goes first, the volume is detached from its node,
// and the new pod on the other node takes the claim over with every line the
// old one synced, and after its first line, the old one writes no more.
func TestNFSRollingUpdateHandsTheClaimOver(t *testing.T) {
	nfsNodes(t)
	c := setupBeside(t)
	c.create(nfsClaim("handover", corev1.ReadWriteOnce))
	pv := c.boundPV("handover")
	one := int32(1)
	pod := withCommand(pinnedPod("writer", "handover", ""), appendLoop("/data/log"))
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "writer"},
		Spec: appsv1.DeploymentSpec{
			Replicas: &one,
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "writer"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "writer"}},
				Spec:       pod.Spec,
			},
		},
	}
	dep.Spec.Template.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": nodeA1}
	c.create(dep)
	var old corev1.Pod
	c.waitFor("the first writer running", startTimeout, func() (bool, error) {
		for _, p := range c.pods("app=writer") {
			if podReady(&p) {
				old = p
				return true, nil
			}
		}
		return false, nil
	})
	c.waitFor(old.Name+" writing", 60*time.Second, func() (bool, error) {
		return strings.Contains(c.mustExec(old.Name, "cat", "/data/log"), old.Name+" 3\n"), nil
	})

	// Move it to the other node with the default strategy.
	c.patchDeployment("writer", `{"spec":{"template":{"spec":{"nodeSelector":{"kubernetes.io/hostname":"`+nodeB+`"}}}}}`)
	var surge string
	c.waitFor("a new writer on "+nodeB, startTimeout, func() (bool, error) {
		for _, p := range c.pods("app=writer") {
			if p.Name != old.Name && p.Spec.NodeName == nodeB {
				surge = p.Name
				return true, nil
			}
		}
		return false, nil
	})
	e := c.waitEventMatch(surge, "FailedAttachVolume", refusalTimeout, "Multi-Attach or FailedPrecondition", attachRefused)
	t.Logf("%s on %s refused while %s writes: %s", surge, nodeB, old.Name, e.Message)
	c.stillNotRunning(surge, 10*time.Second)
	if va := c.attachment(pv.Name, nodeB); va != nil && va.Status.Attached {
		c.fatalf("volume %s attached to %s while %s still holds it", pv.Name, nodeB, nodeA1)
	}

	// maxSurge 0: the old pod goes first, and the claim follows.
	c.patchDeployment("writer", `{"spec":{"strategy":{"type":"RollingUpdate","rollingUpdate":{"maxSurge":0,"maxUnavailable":1}}}}`)
	c.waitFor(surge+" running on "+nodeB, startTimeout, func() (bool, error) {
		p, err := c.cs.CoreV1().Pods(c.ns).Get(c.ctx, surge, metav1.GetOptions{})
		return err == nil && podReady(p), nil
	})
	c.waitFor(surge+" writing", 60*time.Second, func() (bool, error) {
		return strings.Contains(c.mustExec(surge, "cat", "/data/log"), surge+" 3\n"), nil
	})
	if va := c.attachment(pv.Name, nodeA1); va != nil && va.Status.Attached {
		c.fatalf("volume %s still attached to %s after the handover", pv.Name, nodeA1)
	}
	log := c.mustExec(surge, "cat", "/data/log")
	if err := handedOver(log, old.Name, surge); err != nil {
		c.fatalf("%v\n%s", err, log)
	}
}

// handedOver checks a writers' log: the old writer's lines come first,
// numbered from 1 without a gap, and then only the new writer's, from 1: no
// line of the old one after the new one's first, nothing lost in between.
func handedOver(log, old, next string) error {
	var wantOld, wantNew int
	for i, line := range strings.Split(strings.TrimSuffix(log, "\n"), "\n") {
		var who string
		var n int
		if _, err := fmt.Sscanf(line, "%s %d", &who, &n); err != nil {
			return fmt.Errorf("line %d %q: %v", i+1, line, err)
		}
		switch who {
		case old:
			if wantNew > 0 {
				return fmt.Errorf("line %d: %s wrote after %s had begun", i+1, old, next)
			}
			wantOld++
			if n != wantOld {
				return fmt.Errorf("line %d: %s's line %d, want %d", i+1, old, n, wantOld)
			}
		case next:
			wantNew++
			if n != wantNew {
				return fmt.Errorf("line %d: %s's line %d, want %d", i+1, next, n, wantNew)
			}
		default:
			return fmt.Errorf("line %d %q: from neither %s nor %s", i+1, line, old, next)
		}
	}
	if wantOld == 0 || wantNew == 0 {
		return fmt.Errorf("%d lines of %s, %d of %s: want both", wantOld, old, wantNew, next)
	}
	return nil
}

func TestHandedOver(t *testing.T) {
	for _, tc := range []struct {
		name, log string
		ok        bool
	}{
		{"old then new", "a 1\na 2\nb 1\nb 2\n", true},
		{"old after new", "a 1\nb 1\na 2\n", false},
		{"old line lost", "a 1\na 3\nb 1\n", false},
		{"new never wrote", "a 1\na 2\n", false},
		{"old never wrote", "b 1\n", false},
		{"a third writer", "a 1\nc 1\nb 1\n", false},
		{"garbage", "a 1\nnot a line\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := handedOver(tc.log, "a", "b"); (err == nil) != tc.ok {
				t.Errorf("handedOver(%q) = %v, want ok %v", tc.log, err, tc.ok)
			}
		})
	}
}

func (c *cluster) patchDeployment(name, patch string) {
	c.t.Helper()
	if _, err := c.cs.AppsV1().Deployments(c.ns).Patch(c.ctx, name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		c.fatalf("patching deployment %s with %s: %v", name, patch, err)
	}
}

// Story 001 on NFS: a StatefulSet gets a volume per pod, and a deleted pod
// comes back to its own claim with its data, here on another node (its node
// is cordoned first): an NFS volume follows its pod anywhere.
func TestNFSStatefulSetPodComesBackElsewhere(t *testing.T) {
	nfsNodes(t)
	statefulSetPodKeepsItsVolume(setup(t), "modeguard-nfs", true)
}

// cordon marks a node unschedulable until the test ends.
func (c *cluster) cordon(node string) {
	c.t.Helper()
	set := func(v bool) error {
		_, err := c.cs.CoreV1().Nodes().Patch(c.ctx, node, types.StrategicMergePatchType,
			[]byte(fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, v)), metav1.PatchOptions{})
		return err
	}
	if err := set(true); err != nil {
		c.fatalf("cordoning %s: %v", node, err)
	}
	c.t.Cleanup(func() {
		if err := set(false); err != nil {
			c.t.Errorf("uncordoning %s: %v", node, err)
		}
	})
}

// The other access modes on NFS, with pods on separate nodes: ReadWriteMany
// pods on two nodes each read what the other wrote; ReadOnlyMany refuses
// writes at the server even to a client that mounts the export read-write;
// ReadWriteOncePod admits one pod.
func TestNFSAccessModesAcrossNodes(t *testing.T) {
	nfsNodes(t)
	c := setupBeside(t)
	c.create(nfsClaim("rwx", corev1.ReadWriteMany), nfsClaim("rox", corev1.ReadOnlyMany), nfsClaim("rwop", corev1.ReadWriteOncePod))
	c.create(
		withCommand(pinnedPod("rwx-a", "rwx", nodeA1), "echo a > /data/a; exec sleep 1000000"),
		withCommand(pinnedPod("rwx-b", "rwx", nodeB), "echo b > /data/b; exec sleep 1000000"),
		// The pods ask for read/write: nothing in their spec says read-only.
		pinnedPod("rox-a", "rox", nodeA2),
		pinnedPod("rox-b", "rox", nodeB),
		pinnedPod("rwop-first", "rwop", nodeA1),
	)
	// Both writers run before either is asked for the other's file: under
	// emulation one pod can start a minute after the other. A reader's
	// kernel client then sees the other node's file once its cached view of
	// the directory expires, within acdirmax (60 s by default): the wait
	// covers that, not the other pod's start.
	c.waitRunning("rwx-a")
	c.waitRunning("rwx-b")
	for _, p := range []string{"rwx-a", "rwx-b"} {
		c.waitFor(p+" reading both nodes' files", 90*time.Second, func() (bool, error) {
			out, _, err := c.exec(p, "cat", "/data/a", "/data/b")
			return err == nil && out == "a\nb\n", fmt.Errorf("read %q: %v", out, err)
		})
	}

	for _, p := range []string{"rox-a", "rox-b"} {
		c.waitRunning(p)
		if _, errOut, err := c.exec(p, "sh", "-c", "echo x > /data/x"); err == nil {
			c.fatalf("%s wrote to a ReadOnlyMany volume", p)
		} else {
			t.Logf("%s: write refused: %s", p, strings.TrimSpace(errOut))
		}
	}
	// At the server: the node itself mounts the export read-write (a
	// superblock of its own, nosharecache, so that no read-only mount of the
	// export on this node decides), and its write is refused all the same.
	src := c.mountSource("rox-b", "/data")
	out, err := c.inNode(nodeB, `d=$(mktemp -d) && mount -t nfs4 -o rw,vers=4.2,nosharecache `+src+` "$d" || exit 2
touch "$d/by-the-node"; rc=$?; umount "$d"; rmdir "$d"; exit $rc`)
	switch {
	case err == nil:
		c.fatalf("node %s wrote to the ReadOnlyMany export %s mounted read-write:\n%s", nodeB, src, out)
	case strings.Contains(out, "Read-only file system") || strings.Contains(out, "Permission denied"):
		t.Logf("node %s, %s mounted read-write: %s", nodeB, src, strings.TrimSpace(out))
	default:
		c.fatalf("node %s: mounting %s read-write: %v\n%s", nodeB, src, err, out)
	}

	c.waitRunning("rwop-first")
	c.create(pinnedPod("rwop-same-node", "rwop", nodeA1), pinnedPod("rwop-other-node", "rwop", nodeA2))
	e := c.waitEventMatch("rwop-same-node", "FailedMount", refusalTimeout, "ReadWriteOncePod in use", mountRefusedRWOP)
	t.Logf("rwop-same-node refused: %s", e.Message)
	e = c.waitEventMatch("rwop-other-node", "FailedAttachVolume", refusalTimeout, "Multi-Attach or FailedPrecondition", attachRefused)
	t.Logf("rwop-other-node refused: %s", e.Message)
	c.stillNotRunning("rwop-same-node", 5*time.Second)
	c.stillNotRunning("rwop-other-node", 5*time.Second)
}

// mountSource is the source ("server:/path") of what is mounted at dir in
// the pod.
func (c *cluster) mountSource(pod, dir string) string {
	c.t.Helper()
	for _, line := range strings.Split(c.mustExec(pod, "cat", "/proc/mounts"), "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[1] == dir {
			return f[0]
		}
	}
	c.fatalf("nothing mounted at %s in %s", dir, pod)
	return ""
}

// inNode runs a shell script as root on a node of the VM cluster, outside
// Kubernetes (vmcluster run), and returns its output. The VMs' directory is
// MODEGUARD_E2E_VM_DIR (make test-e2e-vm sets it); without it the test skips.
func (c *cluster) inNode(node, script string) (string, error) {
	c.t.Helper()
	dir := os.Getenv("MODEGUARD_E2E_VM_DIR")
	if dir == "" {
		c.t.Skip("no VM cluster: set MODEGUARD_E2E_VM_DIR (make test-e2e-vm does)")
	}
	records, _ := filepath.Glob(filepath.Join(dir, "*", "vm.json"))
	for _, r := range records {
		data, err := os.ReadFile(r)
		if err != nil {
			c.fatalf("%v", err)
		}
		var vm struct{ Name, Addr string }
		if err := json.Unmarshal(data, &vm); err != nil {
			c.fatalf("%s: %v", r, err)
		}
		if vm.Addr != node {
			continue
		}
		tool := filepath.Join(filepath.Dir(dir), "bin", "vmcluster")
		out, err := exec.Command(tool, "run", "-dir", dir, vm.Name, "--", "sh", "-c", script).CombinedOutput()
		return string(out), err
	}
	c.fatalf("no VM in %s has the address %s", dir, node)
	return "", nil
}

// fsGroup on NFS. With root squash (the chart's class) the kubelet's change
// of the volume's ownership is squashed, so the pod's fsGroup is not applied;
// the volume's root is writable by everyone it is published to, so a pod of
// any uid writes, and its files are its own. Without root squash the kubelet
// applies the fsGroup as on a local filesystem: the root belongs to the
// group, with setgid, and the pod's files join the group.
func TestNFSFsGroup(t *testing.T) {
	nfsNodes(t)
	c := setupBeside(t)
	c.create(&storagev1.StorageClass{
		ObjectMeta:  metav1.ObjectMeta{Name: "modeguard-nfs-no-squash-" + c.ns},
		Provisioner: driverName,
		Parameters:  map[string]string{"backend": "nfs", "rootSquash": "false"},
	})
	squashed, plain := nfsClaim("squashed", corev1.ReadWriteOnce), nfsClaim("plain", corev1.ReadWriteOnce)
	plain.Spec.StorageClassName = ptr("modeguard-nfs-no-squash-" + c.ns)
	c.create(squashed, plain)
	pod := func(name, claim string) *corev1.Pod {
		p := withCommand(pinnedPod(name, claim, nodeA2), "echo hi > /data/f; exec sleep 1000000")
		p.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsUser: ptr(int64(1000)), RunAsGroup: ptr(int64(3000)), FSGroup: ptr(int64(2000))}
		return p
	}
	c.create(pod("on-squashed", "squashed"), pod("on-plain", "plain"))
	for _, tc := range []struct{ pod, root, file string }{
		// ls -n: mode, links, uid, gid of the volume's root and of the file.
		{"on-squashed", "drwxrwxrwx 0 0", "-rw-r--r-- 1000 3000"},
		{"on-plain", "drwxrwsrwx 0 2000", "-rw-r--r-- 1000 2000"},
	} {
		c.waitRunning(tc.pod)
		c.waitFor(tc.pod+" ownership "+tc.root+", "+tc.file, 30*time.Second, func() (bool, error) {
			out, _, err := c.exec(tc.pod, "sh", "-c", `ls -lnd /data | awk '{print $1, $3, $4}'; ls -ln /data/f | awk '{print $1, $3, $4}'`)
			return err == nil && out == tc.root+"\n"+tc.file+"\n", fmt.Errorf("got %q (%v)", out, err)
		})
	}
}

// nodeCtl runs hack/local-cluster/vm-node-ctl.sh (reboot, restart-kubelet)
// on a node of the VM cluster; without MODEGUARD_E2E_VM_DIR the test skips.
func (c *cluster) nodeCtl(action, node string) {
	c.t.Helper()
	dir := os.Getenv("MODEGUARD_E2E_VM_DIR")
	if dir == "" {
		c.t.Skip("no VM cluster: set MODEGUARD_E2E_VM_DIR (make test-e2e-vm does)")
	}
	cmd := exec.Command(filepath.Join("..", "..", "hack", "local-cluster", "vm-node-ctl.sh"), action, node)
	cmd.Env = append(os.Environ(), "CLUSTER_DIR="+filepath.Dir(dir))
	t0 := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		c.fatalf("vm-node-ctl.sh %s %s: %v\n%s", action, node, err, out)
	}
	c.t.Logf("%s %s: %s (%s)", action, node, strings.TrimSpace(string(out)), time.Since(t0).Round(time.Second))
}

// restartKubelet restarts node's kubelet (vm-node-ctl.sh restart-kubelet)
// and waits until the node reports Ready with a fresh heartbeat.
func (c *cluster) restartKubelet(node string) {
	c.t.Helper()
	c.nodeCtl("restart-kubelet", node)
	c.waitFor("node "+node+" Ready again", startTimeout, func() (bool, error) {
		n, err := c.cs.CoreV1().Nodes().Get(c.ctx, node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue && cond.LastHeartbeatTime.After(time.Now().Add(-20*time.Second)), nil
			}
		}
		return false, nil
	})
}

// ackedWrites appends n lines to file in the pod, each synced before the
// next, in one exec that succeeds only if every sync did: every line it
// returns was acknowledged. (One exec, not one per line: under emulation an
// exec costs seconds of a node's CPU.)
func (c *cluster) ackedWrites(pod, file, prefix string, n int) []string {
	c.t.Helper()
	var lines []string
	for i := 1; i <= n; i++ {
		lines = append(lines, fmt.Sprintf("%s-%d", prefix, i))
	}
	c.mustExec(pod, "sh", "-c", "for l in "+strings.Join(lines, " ")+"; do echo $l >> "+file+" && sync || exit 1; done")
	return lines
}

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
)

// attachRefused matches what Kubernetes says when a volume cannot be
// attached to one more node: the attach/detach controller's own Multi-Attach
// check, or the driver's FAILED_PRECONDITION when both attaches were in
// flight at once and the driver decided.
func attachRefused(msg string) bool {
	return strings.Contains(msg, "Multi-Attach error") || strings.Contains(msg, "FailedPrecondition")
}

// mountRefusedRWOP matches a refused mount of a ReadWriteOncePod volume
// already in use. Since Kubernetes 1.29 the kubelet checks this itself before
// it calls the driver ("volume uses the ReadWriteOncePod access mode and is
// already in use by another pod"); the driver's own refusal
// (SINGLE_NODE_SINGLE_WRITER, naming the holder) is what a kubelet without
// that check, or another CO, gets, and is what test/integration and test/vm
// prove against the real node plugin.
func mountRefusedRWOP(msg string) bool {
	return strings.Contains(msg, "ReadWriteOncePod") || strings.Contains(msg, "SINGLE_NODE_SINGLE_WRITER")
}

// Story 1: three replicas share one ReadWriteOnce claim. ReadWriteOnce means
// one node: the replicas on the node holding the volume run, the one on the
// other node of the zone stays ContainerCreating with the attach refused.
func TestRWODeploymentStaysOnOneNode(t *testing.T) {
	rwoDeploymentStaysOnOneNode(setupBeside(t), "", []string{"zone-a"})
}

// rwoDeploymentStaysOnOneNode runs deploy/examples/rwo-deployment.yaml, its
// claim of class (its own when ""), with the replicas spread over the two
// nodes of zone-a, and checks that the volume (in zones, [] for none) is
// attached to one of them only: the replicas there run and share the file,
// the one on the other node is refused, as its event says. It returns the
// node holding the volume and the replicas running there.
func rwoDeploymentStaysOnOneNode(c *cluster, class string, zones []string) (holder string, running []string) {
	t := c.t
	t.Helper()
	objs := c.example("rwo-deployment.yaml")
	if class != "" {
		find[*corev1.PersistentVolumeClaim](t, objs, "rwo-shared").Spec.StorageClassName = ptr(class)
	}
	dep := find[*appsv1.Deployment](t, objs, "rwo-writers")
	// Both nodes of zone-a get a replica: two on one, one on the other.
	dep.Spec.Template.Spec.NodeSelector = map[string]string{"topology.kubernetes.io/zone": "zone-a"}
	dep.Spec.Template.Spec.TopologySpreadConstraints = []corev1.TopologySpreadConstraint{{
		MaxSkew: 1, TopologyKey: "kubernetes.io/hostname", WhenUnsatisfiable: corev1.DoNotSchedule,
		LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "rwo-writers"}},
	}}
	c.create(objs...)

	pv := c.boundPV("rwo-shared")
	if z := pvZones(pv); !slices.Equal(z, zones) {
		c.fatalf("volume %s: zones %v, want %v", pv.Name, z, zones)
	}
	c.waitFor("the volume attached to one node", startTimeout, func() (bool, error) {
		for _, n := range []string{nodeA1, nodeA2} {
			if va := c.attachment(pv.Name, n); va != nil && va.Status.Attached {
				holder = n
				return true, nil
			}
		}
		return false, nil
	})
	t.Logf("volume %s attached to %s", pv.Spec.CSI.VolumeHandle, holder)

	var refused []string
	c.waitFor("three replicas scheduled", startTimeout, func() (bool, error) {
		pods := c.pods("app=rwo-writers")
		n := 0
		for _, p := range pods {
			if p.Spec.NodeName != "" {
				n++
			}
		}
		return n == 3, nil
	})
	for _, p := range c.pods("app=rwo-writers") {
		if p.Spec.NodeName == holder {
			c.waitRunning(p.Name)
			running = append(running, p.Name)
		} else {
			refused = append(refused, p.Name)
		}
	}
	if len(running) == 0 || len(refused) == 0 {
		c.fatalf("want replicas both on the holding node and off it; running %v, refused %v", running, refused)
	}
	// The attach is refused once per node: the event goes to one of the
	// pods there; none of them runs.
	c.waitFor("the attach to "+otherZoneANode(holder)+" refused", refusalTimeout, func() (bool, error) {
		for _, name := range refused {
			evs, err := c.cs.CoreV1().Events(c.ns).List(c.ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
			if err != nil {
				return false, err
			}
			for _, e := range evs.Items {
				if e.Reason == "FailedAttachVolume" && attachRefused(e.Message) {
					t.Logf("%s on %s: %s", name, otherZoneANode(holder), e.Message)
					return true, nil
				}
			}
		}
		return false, nil
	})
	for _, name := range refused {
		c.stillNotRunning(name, 5*time.Second)
	}
	if va := c.attachment(pv.Name, otherZoneANode(holder)); va != nil && va.Status.Attached {
		c.fatalf("volume %s is attached to %s as well", pv.Name, otherZoneANode(holder))
	}
	// The replicas on the holding node share the volume: each one's writes
	// are in the same file.
	for _, name := range running {
		c.waitFor(name+" writing to the shared file", scaled(30*time.Second), func() (bool, error) {
			return strings.Contains(c.mustExec(running[0], "cat", "/data/log"), name), nil
		})
	}
	return holder, running
}

func otherZoneANode(n string) string {
	if n == nodeA1 {
		return nodeA2
	}
	return nodeA1
}

// Story 1 with ReadWriteOncePod: only one replica ever runs; the scheduler
// keeps the others Pending, and a pod pinned with spec.nodeName (no
// scheduler) is refused at mount on the node (see mountRefusedRWOP) and at
// attach on any other node.
func TestRWOPDeploymentRunsOnePod(t *testing.T) {
	c := setupBeside(t)
	objs := c.example("rwo-deployment.yaml")
	pvc := find[*corev1.PersistentVolumeClaim](t, objs, "rwo-shared")
	pvc.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod}
	c.create(objs...)

	var first corev1.Pod
	c.waitFor("one replica running", startTimeout, func() (bool, error) {
		for _, p := range c.pods("app=rwo-writers") {
			if podReady(&p) {
				first = p
				return true, nil
			}
		}
		return false, nil
	})
	for _, p := range c.pods("app=rwo-writers") {
		if p.Name != first.Name {
			c.waitEvent(p.Name, "FailedScheduling", refusalTimeout, "ReadWriteOncePod")
		}
	}
	// A pod pinned to the same node bypasses the scheduler: the node plugin
	// refuses it.
	pinned := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "pinned"},
		Spec:       *first.Spec.DeepCopy(),
	}
	pinned.Spec.NodeName = first.Spec.NodeName
	c.create(pinned)
	e := c.waitEventMatch("pinned", "FailedMount", refusalTimeout, "ReadWriteOncePod in use", mountRefusedRWOP)
	t.Logf("pinned pod refused: %s", e.Message)
	elsewhere := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pinned-elsewhere"}, Spec: *first.Spec.DeepCopy()}
	elsewhere.Spec.NodeName = otherZoneANode(first.Spec.NodeName)
	c.create(elsewhere)
	e = c.waitEventMatch("pinned-elsewhere", "FailedAttachVolume", refusalTimeout, "Multi-Attach or FailedPrecondition", attachRefused)
	t.Logf("pod pinned to %s refused: %s", elsewhere.Spec.NodeName, e.Message)
	// For a while, exactly one pod runs.
	end := time.Now().Add(10 * time.Second)
	for time.Now().Before(end) {
		n := 0
		for _, p := range c.pods("") {
			if p.Status.Phase == corev1.PodRunning {
				n++
			}
		}
		if n != 1 {
			c.fatalf("%d pods running with a ReadWriteOncePod claim", n)
		}
		time.Sleep(time.Second)
	}
}

// Story 2: a StatefulSet gets one volume per pod, and a deleted pod comes
// back on the same volume with its data.
func TestStatefulSetPodKeepsItsVolume(t *testing.T) {
	statefulSetPodKeepsItsVolume(setup(t), "", false)
}

// statefulSetPodKeepsItsVolume runs deploy/examples/statefulset.yaml with
// its claims of class (its own class when ""), deletes web-0 and checks that
// it comes back on its own volume with its data; elsewhere cordons its node
// first, so that it comes back on another.
func statefulSetPodKeepsItsVolume(c *cluster, class string, elsewhere bool) {
	t := c.t
	t.Helper()
	objs := c.example("statefulset.yaml")
	if class != "" {
		find[*appsv1.StatefulSet](t, objs, "web").Spec.VolumeClaimTemplates[0].Spec.StorageClassName = ptr(class)
	}
	c.create(objs...)
	c.waitRunning("web-0")
	c.waitRunning("web-1")
	pv0, pv1 := c.boundPV("data-web-0"), c.boundPV("data-web-1")
	if pv0.Name == pv1.Name {
		c.fatalf("both pods on volume %s", pv0.Name)
	}
	for _, name := range []string{"web-0", "web-1"} {
		if id := strings.TrimSpace(c.mustExec(name, "cat", "/data/id")); id != name {
			c.fatalf("%s: /data/id is %q", name, id)
		}
	}
	c.mustExec("web-0", "sh", "-c", "echo kept > /data/kept && sync")
	old := c.pod("web-0")
	if elsewhere {
		c.cordon(old.Spec.NodeName)
	}
	c.deletePodAndWait("web-0")
	var back *corev1.Pod
	c.waitFor("web-0 back", startTimeout, func() (bool, error) {
		p, err := c.cs.CoreV1().Pods(c.ns).Get(c.ctx, "web-0", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		back = p
		return p.UID != old.UID && podReady(p), nil
	})
	if elsewhere && back.Spec.NodeName == old.Spec.NodeName {
		c.fatalf("web-0 came back on its cordoned node %s", old.Spec.NodeName)
	}
	if pv := c.boundPV("data-web-0"); pv.Name != pv0.Name {
		c.fatalf("web-0 came back on %s, was on %s", pv.Name, pv0.Name)
	}
	if got := strings.TrimSpace(c.mustExec("web-0", "cat", "/data/id", "/data/kept")); got != "web-0\nkept" {
		c.fatalf("web-0 (on %s, was on %s) reads %q from its volume", back.Spec.NodeName, old.Spec.NodeName, got)
	}
	t.Logf("web-0 back on %s (was on %s) with its data", back.Spec.NodeName, old.Spec.NodeName)
}

// Story 3: a second pod using a ReadWriteOncePod claim does not start, and
// the event says why; once the first is gone, the second starts.
func TestRWOPSecondPodRefused(t *testing.T) {
	c := setup(t)
	objs := c.example("rwop-two-pods.yaml")
	second := find[*corev1.Pod](t, objs, "rwop-second")
	c.create(find[*corev1.PersistentVolumeClaim](t, objs, "rwop-claim"), find[*corev1.Pod](t, objs, "rwop-first"))
	first := c.waitRunning("rwop-first")
	second.Spec.NodeName = first.Spec.NodeName
	c.create(second)
	e := c.waitEventMatch("rwop-second", "FailedMount", refusalTimeout, "ReadWriteOncePod in use", mountRefusedRWOP)
	t.Logf("rwop-second refused: %s", e.Message)
	c.stillNotRunning("rwop-second", 10*time.Second)

	// A pod left to the scheduler is not placed at all.
	third := second.DeepCopy()
	third.Name, third.Spec.NodeName = "rwop-third", ""
	c.create(third)
	c.waitEvent("rwop-third", "FailedScheduling", refusalTimeout, "ReadWriteOncePod")
	c.deletePodAndWait("rwop-third")

	c.deletePodAndWait("rwop-first")
	c.waitRunning("rwop-second")
}

// Story 4: a WaitForFirstConsumer claim lands in the zone of its pod's
// node; an Immediate claim with allowedTopologies lands where allowed and
// pulls its pod into that zone.
func TestTopologyFollowsTheData(t *testing.T) {
	c := setup(t)
	objs := c.example("topology.yaml")
	c.create(find[*storagev1.StorageClass](t, objs, "modeguard-block-zone-b"))

	// Immediate: bound before any pod exists.
	c.create(find[*corev1.PersistentVolumeClaim](t, objs, "topo-immediate"))
	imm := c.boundPV("topo-immediate")
	if z := pvZones(imm); len(z) != 1 || z[0] != "zone-b" {
		c.fatalf("Immediate claim with allowedTopologies zone-b: volume zones %v", z)
	}
	c.create(find[*corev1.Pod](t, objs, "topo-immediate-pod"))
	p := c.waitRunning("topo-immediate-pod")
	if z := c.zoneOf(p.Spec.NodeName); z != "zone-b" {
		c.fatalf("topo-immediate-pod scheduled to %s in %s, its volume is in zone-b", p.Spec.NodeName, z)
	}

	// WaitForFirstConsumer: not bound until the pod is scheduled, then in
	// the pod's zone.
	c.create(find[*corev1.PersistentVolumeClaim](t, objs, "topo-wffc"))
	time.Sleep(3 * time.Second)
	if pvc, err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Get(c.ctx, "topo-wffc", metav1.GetOptions{}); err != nil || pvc.Status.Phase != corev1.ClaimPending {
		c.fatalf("topo-wffc without a pod: %v, %v (want Pending)", pvc.Status.Phase, err)
	}
	c.create(find[*corev1.Pod](t, objs, "topo-wffc-pod"))
	p = c.waitRunning("topo-wffc-pod")
	wffc := c.boundPV("topo-wffc")
	if z, want := pvZones(wffc), c.zoneOf(p.Spec.NodeName); len(z) != 1 || z[0] != want {
		c.fatalf("WaitForFirstConsumer volume zones %v, its pod runs on %s in %s", z, p.Spec.NodeName, want)
	}
	if !strings.Contains(wffc.Spec.CSI.VolumeHandle, ":zone-b:") {
		c.fatalf("volume %s is not in zone-b's pool", wffc.Spec.CSI.VolumeHandle)
	}
}

// Story 5: a ReadOnlyMany claim from a snapshot, read from both nodes of
// the zone; no pod can write to it. Deleting the claim removes the image.
func TestROXFromSnapshot(t *testing.T) {
	c := setupBeside(t)
	src := c.example("rox-from-snapshot-source.yaml")
	// The snapshot lives in the source's pool, and the copy is made from
	// it: keep the source in zone-a, where the readers will be.
	find[*corev1.Pod](t, src, "rox-source-writer").Spec.NodeSelector = map[string]string{"topology.kubernetes.io/zone": "zone-a"}
	c.create(src...)
	c.waitRunning("rox-source-writer")

	objs := c.example("rox-from-snapshot.yaml")
	for _, o := range objs {
		if u, ok := o.(*unstructured.Unstructured); ok {
			c.create(u)
		}
	}
	c.waitSnapshotReady("rox-snap")
	// Change the source after the snapshot: the copy must not see it.
	c.mustExec("rox-source-writer", "sh", "-c", "echo changed > /data/hello && sync")

	c.create(find[*corev1.PersistentVolumeClaim](t, objs, "rox-copy"))
	readers := map[string]string{"rox-reader-1": nodeA1, "rox-reader-2": nodeA2}
	for name, node := range readers {
		p := find[*corev1.Pod](t, objs, name)
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
		c.create(p)
	}
	pv := c.boundPV("rox-copy")
	for name, node := range readers {
		c.waitRunning(name)
		if got := strings.TrimSpace(c.mustExec(name, "cat", "/data/hello")); got != "hello from the source volume" {
			c.fatalf("%s on %s reads %q", name, node, got)
		}
		_, stderr, err := c.exec(name, "sh", "-c", "echo write > /data/attempt")
		if err == nil || !strings.Contains(stderr, "Read-only file system") {
			c.fatalf("%s on %s could write to the ReadOnlyMany volume (err %v, stderr %q)", name, node, err, stderr)
		}
		if va := c.attachment(pv.Name, node); va == nil || !va.Status.Attached {
			c.fatalf("volume not attached to %s", node)
		}
	}

	if !c.blockImageExists(pv, "zone-a") {
		c.fatalf("the copy's image is not in zone-a's pool")
	}
	for name := range readers {
		c.deletePodAndWait(name)
	}
	c.deleteClaimAndWait("rox-copy", pv.Name)
	if c.blockImageExists(pv, "zone-a") {
		c.fatalf("the copy's image is still in zone-a's pool after the claim was deleted")
	}
}

// Story 5: growing a bound claim grows the filesystem the running pod sees.
// xfs, because growing a mounted ext4 needs CAP_SYS_RESOURCE, which this
// machine does not grant even to privileged containers (ext4 then grows at
// the next stage; see the README).
func TestExpansionGrowsMountedFilesystem(t *testing.T) {
	c := setupBeside(t)
	c.create(&storagev1.StorageClass{
		ObjectMeta:  metav1.ObjectMeta{Name: "modeguard-e2e-xfs"},
		Provisioner: driverName,
		// The older bare key: classes made before the shipped ones moved
		// to csi.storage.k8s.io/fstype keep working.
		Parameters:           map[string]string{"backend": "block", "fsType": "xfs"},
		VolumeBindingMode:    ptr(storagev1.VolumeBindingWaitForFirstConsumer),
		AllowVolumeExpansion: ptr(true),
	})
	objs := c.example("expansion.yaml")
	pvc := find[*corev1.PersistentVolumeClaim](t, objs, "grow-claim")
	pvc.Spec.StorageClassName = ptr("modeguard-e2e-xfs")
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("320Mi")
	c.create(objs...)
	pod := c.waitRunning("grow-me")
	before := c.dfKiB("grow-me")

	patch := []byte(`{"spec":{"resources":{"requests":{"storage":"640Mi"}}}}`)
	if _, err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Patch(c.ctx, "grow-claim", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		c.fatalf("%v", err)
	}
	// The kubelet grows a mounted volume at its next sync of the pod, which
	// comes every minute or so (with jitter) after the resizer is done.
	c.waitFor("claim capacity 640Mi", 3*startTimeout, func() (bool, error) {
		p, err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Get(c.ctx, "grow-claim", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		got := p.Status.Capacity[corev1.ResourceStorage]
		return got.Cmp(resource.MustParse("640Mi")) >= 0 && len(p.Status.Conditions) == 0, nil
	})
	var after int64
	c.waitFor("the pod's filesystem grown", 30*time.Second, func() (bool, error) {
		after = c.dfKiB("grow-me")
		return after > before+250*1024, nil
	})
	if p := c.pod("grow-me"); p.UID != pod.UID || p.Status.ContainerStatuses[0].RestartCount != 0 {
		c.fatalf("the pod was restarted to grow its volume")
	}
	t.Logf("filesystem %d KiB -> %d KiB", before, after)
}

// dfKiB returns the size of the filesystem at /data in the pod.
func (c *cluster) dfKiB(pod string) int64 {
	c.t.Helper()
	out := c.mustExec(pod, "df", "-k", "/data")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	fields := strings.Fields(lines[len(lines)-1])
	if len(fields) < 2 {
		c.fatalf("df output %q", out)
	}
	n, err := strconv.ParseInt(fields[1], 10, 64)
	if err != nil {
		c.fatalf("df output %q: %v", out, err)
	}
	return n
}

func ptr[T any](v T) *T { return &v }

// The NFS variants, as far as this machine lets them go: its kernel has no
// NFS client, so no node can mount an export (each pod here stays
// ContainerCreating on a failed mount). What the driver decides still shows:
// the export's client list is exactly the nodes the volume is attached to,
// read-write or read-only as the mode says, a second node is refused for a
// ReadWriteOnce volume, and deleting the claim removes the export. The mounts
// themselves run in test/vm, in a VM whose kernel has the NFS client.
func TestNFSExportFollowsAttachments(t *testing.T) {
	if os.Getenv("MODEGUARD_E2E_NFS_CLIENTS") == "1" {
		t.Skip("the nodes mount NFS here: the stories of nfspods_test.go are this cluster's")
	}
	c := setup(t)
	claim := func(name string, mode corev1.PersistentVolumeAccessMode) *corev1.PersistentVolumeClaim {
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
	pod := pinnedPod

	// ReadWriteOnce: one node, read-write.
	c.create(claim("nfs-rwo", corev1.ReadWriteOnce))
	rwo := c.boundPV("nfs-rwo")
	c.waitExportClients(rwo, "")
	c.create(pod("rwo-a", "nfs-rwo", nodeA1))
	c.waitExportClients(rwo, nodeA1+" RW")
	e := c.waitEventMatch("rwo-a", "FailedMount", startTimeout, "any failed mount", func(string) bool { return true })
	t.Logf("rwo-a cannot mount here (no NFS client in this kernel): %s", e.Message)
	// NFS volumes have no zone: the refusal of a node in the other zone comes
	// from the access mode alone.
	c.create(pod("rwo-b", "nfs-rwo", nodeB))
	c.waitEventMatch("rwo-b", "FailedAttachVolume", refusalTimeout, "Multi-Attach or FailedPrecondition", attachRefused)
	c.waitExportClients(rwo, nodeA1+" RW")

	// ReadOnlyMany: every node it is attached to, read-only.
	c.create(claim("nfs-rox", corev1.ReadOnlyMany))
	rox := c.boundPV("nfs-rox")
	c.create(pod("rox-a", "nfs-rox", nodeA1), pod("rox-b", "nfs-rox", nodeB))
	c.waitExportClients(rox, nodeA1+" RO", nodeB+" RO")

	// Detach closes the export again; deleting the claim removes it.
	for _, p := range []string{"rwo-a", "rwo-b", "rox-a", "rox-b"} {
		c.deletePodAndWait(p)
	}
	c.waitExportClients(rwo, "")
	c.waitExportClients(rox, "")
	c.deleteClaimAndWait("nfs-rwo", rwo.Name)
	if path, _ := c.exportOf(rwo); path != "" {
		c.fatalf("export file %s still there after the claim was deleted", path)
	}
}

// exportOf finds the ganesha export file of an NFS volume and returns its
// path and its clients as "address RW|RO", sorted; "" when there is none.
func (c *cluster) exportOf(pv *corev1.PersistentVolume) (string, []string) {
	c.t.Helper()
	dir := filepath.Join(c.build, "modeguard-local", "ganesha", "exports")
	entries, err := os.ReadDir(dir)
	if err != nil {
		c.fatalf("%v", err)
	}
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil || !strings.Contains(string(data), "modeguard volume "+pv.Spec.CSI.VolumeHandle+"\n") {
			continue
		}
		var clients []string
		var addr string
		for _, line := range strings.Split(string(data), "\n") {
			line = strings.TrimSuffix(strings.TrimSpace(line), ";")
			if v, ok := strings.CutPrefix(line, "Clients = "); ok {
				addr = v
			} else if v, ok := strings.CutPrefix(line, "Access_Type = "); ok && addr != "" {
				clients = append(clients, addr+" "+v)
				addr = ""
			}
		}
		sort.Strings(clients)
		return filepath.Join(dir, e.Name()), clients
	}
	return "", nil
}

// waitExportClients waits until the volume's export lists exactly the given
// clients ("address RW|RO"); a single "" means open to no one, which for a
// volume no node holds is no export at all.
func (c *cluster) waitExportClients(pv *corev1.PersistentVolume, want ...string) {
	c.t.Helper()
	if len(want) == 1 && want[0] == "" {
		want = nil
	}
	sort.Strings(want)
	var got []string
	c.waitFor(fmt.Sprintf("export of %s open to exactly %v", pv.Name, want), startTimeout, func() (bool, error) {
		var path string
		path, got = c.exportOf(pv)
		if path == "" {
			return len(want) == 0, fmt.Errorf("no export file for %s", pv.Spec.CSI.VolumeHandle)
		}
		return slices.Equal(got, want), fmt.Errorf("clients %v", got)
	})
}

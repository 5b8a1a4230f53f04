package e2e

import (
	"os"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// claimAttributesClass is the VolumeAttributesClass Kubernetes reports the
// claim's volume to have now (status.currentVolumeAttributesClassName), and
// the state of a change in flight ("" when none).
func (c *cluster) claimAttributesClass(claim string) (current, modifyStatus string) {
	c.t.Helper()
	pvc, err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Get(c.ctx, claim, metav1.GetOptions{})
	if err != nil {
		c.fatalf("claim %s: %v", claim, err)
	}
	if p := pvc.Status.CurrentVolumeAttributesClassName; p != nil {
		current = *p
	}
	if s := pvc.Status.ModifyVolumeStatus; s != nil {
		modifyStatus = string(s.Status)
	}
	return current, modifyStatus
}

// setAttributesClass points the claim at another VolumeAttributesClass and
// waits until Kubernetes reports the volume changed to it: the driver's
// ControllerModifyVolume answered.
func (c *cluster) setAttributesClass(claim, class string) {
	c.t.Helper()
	c.patchAttributesClass(claim, class)
	c.waitFor("claim "+claim+" modified to "+class, startTimeout, func() (bool, error) {
		current, _ := c.claimAttributesClass(claim)
		return current == class, nil
	})
}

func (c *cluster) patchAttributesClass(claim, class string) {
	c.t.Helper()
	patch := []byte(`{"spec":{"volumeAttributesClassName":"` + class + `"}}`)
	if _, err := c.cs.CoreV1().PersistentVolumeClaims(c.ns).Patch(c.ctx, claim, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		c.fatalf("pointing claim %s at %s: %v", claim, class, err)
	}
}

// exportSquash is the Squash line of an NFS volume's export file.
func (c *cluster) exportSquash(pv *corev1.PersistentVolume) string {
	c.t.Helper()
	path, _ := c.exportOf(pv)
	if path == "" {
		return ""
	}
	data, err := os.ReadFile(path)
	if err != nil {
		c.fatalf("%v", err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "Squash = "); ok {
			return strings.TrimSuffix(v, ";")
		}
	}
	return ""
}

// wantSquash fails the test unless the Squash line of the volume's export
// file is want.
func (c *cluster) wantSquash(pv *corev1.PersistentVolume, want, when string) {
	c.t.Helper()
	if got := c.exportSquash(pv); got != want {
		c.fatalf("%s the export says Squash = %q, want %s", when, got, want)
	}
}

// readAheadKiB is the read-ahead of the loop device backing a block volume
// in its zone's pool, as the kernel reports it in sysfs.
func (c *cluster) readAheadKiB(pv *corev1.PersistentVolume, zone string) string {
	c.t.Helper()
	devs := loopDevicesNaming(c.blockImage(pv, zone))
	if len(devs) != 1 {
		c.fatalf("loop devices of %s: %v, want exactly one", pv.Name, devs)
	}
	b, err := os.ReadFile("/sys/block/" + devs[0] + "/queue/read_ahead_kb")
	if err != nil {
		c.fatalf("%v", err)
	}
	return strings.TrimSpace(string(b))
}

// TestVolumeAttributesClassChangesAVolume runs
// deploy/examples/volume-attributes.yaml through Kubernetes: external-
// provisioner passes a claim's VolumeAttributesClass to CreateVolume, and
// pointing the claim at another class makes external-resizer call
// ControllerModifyVolume. An NFS volume's export changes root squashing
// while a node holds it; a block volume's loop device gets the class's
// read-ahead when it is staged; a class the backend cannot serve is refused
// with the driver's reason and the volume keeps the class it had.
func TestVolumeAttributesClassChangesAVolume(t *testing.T) {
	c := setup(t)
	objs := c.example("volume-attributes.yaml")
	for _, name := range []string{"modeguard-nfs-squashed", "modeguard-nfs-root", "modeguard-block-readahead"} {
		c.create(find[*storagev1.VolumeAttributesClass](t, objs, name))
	}
	// A second block class, to see a change reach the node.
	c.create(&storagev1.VolumeAttributesClass{
		ObjectMeta: metav1.ObjectMeta{Name: "modeguard-block-readahead-small"},
		DriverName: driverName, Parameters: map[string]string{"readAheadKiB": "256"},
	})

	t.Log("NFS: root squashing follows the class, on the live export")
	c.create(find[*corev1.PersistentVolumeClaim](t, objs, "squash-claim"))
	demo := find[*corev1.Pod](t, objs, "squash-demo")
	demo.Spec.NodeName = nodeA1 // attached there; this kernel has no NFS client to mount it
	c.create(demo)
	nfsPV := c.boundPV("squash-claim")
	if current, _ := c.claimAttributesClass("squash-claim"); current != "modeguard-nfs-squashed" {
		c.fatalf("squash-claim was created with class %q, want modeguard-nfs-squashed", current)
	}
	c.waitExportClients(nfsPV, nodeA1+" RW")
	c.wantSquash(nfsPV, "root_squash", "created with modeguard-nfs-squashed,")
	c.setAttributesClass("squash-claim", "modeguard-nfs-root")
	c.wantSquash(nfsPV, "no_root_squash", "after the change to modeguard-nfs-root")

	t.Log("NFS: a block-only attribute is refused, and the volume keeps its class")
	c.patchAttributesClass("squash-claim", "modeguard-block-readahead")
	e := c.waitEvent("squash-claim", "VolumeModifyFailed", startTimeout, "readAheadKiB")
	t.Logf("refused: %s", e.Message)
	c.waitFor("claim squash-claim marked Infeasible", startTimeout, func() (bool, error) {
		_, st := c.claimAttributesClass("squash-claim")
		return st == string(corev1.PersistentVolumeClaimModifyVolumeInfeasible), nil
	})
	if current, _ := c.claimAttributesClass("squash-claim"); current != "modeguard-nfs-root" {
		c.fatalf("after a refused change squash-claim reports class %q, want modeguard-nfs-root", current)
	}
	c.wantSquash(nfsPV, "no_root_squash", "after a refused change")
	// Back to a class the volume can have: the refusal left nothing stuck.
	c.setAttributesClass("squash-claim", "modeguard-nfs-squashed")
	c.wantSquash(nfsPV, "root_squash", "after the change back")

	t.Log("block: the read-ahead of the class at creation, then of the new class at the next stage")
	c.create(&corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "readahead-claim"},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:               []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName:          ptr("modeguard-block"),
			VolumeAttributesClassName: ptr("modeguard-block-readahead"),
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: resource.MustParse("64Mi")}},
		},
	})
	c.create(readerPod("readahead-claim"))
	pod := c.waitRunning("readahead-claim-reader")
	blockPV := c.boundPV("readahead-claim")
	zone := c.zoneOf(pod.Spec.NodeName)
	if got := c.readAheadKiB(blockPV, zone); got != "1024" {
		c.fatalf("read-ahead of the staged volume: %s KiB, want 1024 (class modeguard-block-readahead)", got)
	}
	c.setAttributesClass("readahead-claim", "modeguard-block-readahead-small")
	c.deletePodAndWait("readahead-claim-reader")
	c.waitDetached("readahead-claim")
	c.create(readerPod("readahead-claim"))
	c.waitRunning("readahead-claim-reader")
	if got := c.readAheadKiB(blockPV, zone); got != "256" {
		c.fatalf("read-ahead after the change and a new stage: %s KiB, want 256", got)
	}
}

package e2e

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// groupSnapshot is the named VolumeGroupSnapshot of the test's namespace.
func (c *cluster) groupSnapshot(name string) *unstructured.Unstructured {
	c.t.Helper()
	u, err := c.dyn.Resource(volumeGroupSnapshots).Namespace(c.ns).Get(c.ctx, name, metav1.GetOptions{})
	if err != nil {
		c.fatalf("VolumeGroupSnapshot %s: %v", name, err)
	}
	return u
}

// waitDetached waits until the claim's volume is attached to no node.
func (c *cluster) waitDetached(claim string) {
	c.t.Helper()
	pv := c.boundPV(claim)
	c.waitFor("volume of "+claim+" detached", startTimeout, func() (bool, error) {
		vas, err := c.cs.StorageV1().VolumeAttachments().List(c.ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		return !slices.ContainsFunc(vas.Items, func(va storagev1.VolumeAttachment) bool {
			return va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv.Name
		}), nil
	})
}

// restoredMembers restores every VolumeSnapshot the group owns (one per
// claim) into a claim of its own and returns what each holds in /v/state,
// sorted.
func (c *cluster) restoredMembers(group string) []string {
	c.t.Helper()
	snaps, err := c.dyn.Resource(volumeSnapshots).Namespace(c.ns).List(c.ctx, metav1.ListOptions{})
	if err != nil {
		c.fatalf("%v", err)
	}
	var members []string
	for _, s := range snaps.Items {
		for _, o := range s.GetOwnerReferences() {
			if o.Kind == "VolumeGroupSnapshot" && o.Name == group {
				members = append(members, s.GetName())
			}
		}
	}
	if len(members) != 2 {
		c.fatalf("%s owns %d VolumeSnapshots %v, want one per claim (2)", group, len(members), members)
	}
	var held []string
	for i, m := range members {
		name := group + "-restored-" + string(rune('a'+i))
		class := "modeguard-block-group"
		c.create(&corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				StorageClassName: &class,
				DataSource:       &corev1.TypedLocalObjectReference{APIGroup: ptr("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: m},
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}},
			},
		})
		reader := readerPod(name)
		c.create(reader)
		c.waitRunning(reader.Name)
		held = append(held, strings.TrimSpace(c.mustExec(reader.Name, "cat", "/v/state")))
		c.deletePodAndWait(reader.Name)
	}
	slices.Sort(held)
	return held
}

// waitGroupReady waits until the named VolumeGroupSnapshot is ready; an
// error the driver reports for it ends the test.
func (c *cluster) waitGroupReady(name string) {
	c.t.Helper()
	c.waitFor("group snapshot "+name+" ready", startTimeout, func() (bool, error) {
		u := c.groupSnapshot(name)
		if msg, found, _ := unstructured.NestedString(u.Object, "status", "error", "message"); found && msg != "" {
			c.fatalf("group snapshot %s: %s", name, msg)
		}
		ready, _, _ := unstructured.NestedBool(u.Object, "status", "readyToUse")
		return ready, nil
	})
}

// TestGroupSnapshotOfAnApplication runs deploy/examples/group-snapshot.yaml
// on the local cluster's block pools, which are btrfs: a VolumeGroupSnapshot
// of a volume being written and one at rest is ready, and each member
// restores to what its volume held at the group's moment, not what was
// written after; so is a group of both volumes while one pod writes both.
// (A pool without a btrfs subvolume for its volumes refuses that second
// group: pkg/backend/block's tests.)
func TestGroupSnapshotOfAnApplication(t *testing.T) {
	c := setup(t)
	objs := c.example("group-snapshot.yaml")
	c.create(find[*storagev1.StorageClass](t, objs, "modeguard-block-group"))
	c.create(find[*corev1.PersistentVolumeClaim](t, objs, "app-log"), find[*corev1.PersistentVolumeClaim](t, objs, "app-data"))
	c.create(find[*corev1.Pod](t, objs, "data-filler"))
	c.waitRunning("data-filler")
	c.mustExec("data-filler", "sync")
	c.deletePodAndWait("data-filler")
	c.waitDetached("app-data")
	c.create(find[*corev1.Pod](t, objs, "journal-writer"))
	c.waitRunning("journal-writer")
	c.mustExec("journal-writer", "sync")

	c.create(find[*unstructured.Unstructured](t, objs, "app-snap"))
	c.waitGroupReady("app-snap")
	c.mustExec("journal-writer", "sh", "-c", `echo "log 2" > /log/state && sync`)
	if held, want := c.restoredMembers("app-snap"), []string{"data 1", "log 1"}; !slices.Equal(held, want) {
		c.fatalf("the group's members restore to %q, want %q: each volume as it was when the group was taken", held, want)
	}

	c.deletePodAndWait("journal-writer")
	c.waitDetached("app-log")
	c.create(find[*corev1.Pod](t, objs, "app-both-writer"))
	c.waitRunning("app-both-writer")
	c.mustExec("app-both-writer", "sync")
	c.create(find[*unstructured.Unstructured](t, objs, "app-snap-both"))
	c.waitGroupReady("app-snap-both")
	c.mustExec("app-both-writer", "sh", "-c", `echo "log 4" > /log/state && echo "data 4" > /data/state && sync`)
	if held, want := c.restoredMembers("app-snap-both"), []string{"data 3", "log 3"}; !slices.Equal(held, want) {
		c.fatalf("the members of a group of two volumes being written restore to %q, want %q: both as of the group's one instant", held, want)
	}
}

// readerPod mounts claim at /v and waits.
func readerPod(claim string) *corev1.Pod {
	grace := int64(1)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: claim + "-reader"},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{
				Name: "app", Image: testImage, ImagePullPolicy: corev1.PullNever,
				Command:      []string{"sh", "-c", "exec sleep 1000000"},
				VolumeMounts: []corev1.VolumeMount{{Name: "v", MountPath: "/v"}},
			}},
			Volumes: []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}
}

package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// zoneCapacity is the smallest free space the driver has published (as
// CSIStorageCapacity objects) for class in zone, and whether any was.
func (c *cluster) zoneCapacity(class, zone string) (resource.Quantity, bool) {
	c.t.Helper()
	list, err := c.cs.StorageV1().CSIStorageCapacities("").List(c.ctx, metav1.ListOptions{})
	if err != nil {
		c.fatalf("listing CSIStorageCapacity: %v", err)
	}
	var least resource.Quantity
	found := false
	for _, sc := range list.Items {
		if sc.StorageClassName != class || sc.NodeTopology == nil || sc.Capacity == nil ||
			sc.NodeTopology.MatchLabels["topology.modeguard.csi.dev/zone"] != zone {
			continue
		}
		if !found || sc.Capacity.Cmp(least) < 0 {
			least = *sc.Capacity
		}
		found = true
	}
	return least, found
}

// Story capacity: once zone-a's pool is full, the scheduler sends pods with
// new WaitForFirstConsumer claims to zone-b at the first try. Without the
// published capacity two of three nodes are in zone-a, and a pod scheduled
// there gets a ProvisioningFailed (ResourceExhausted) before it is moved.
func TestFullZoneSendsPodsElsewhere(t *testing.T) {
	c := setup(t)
	objs := c.example("capacity.yaml")
	const class = "modeguard-block"

	c.waitFor("capacity published for zone-a and zone-b", startTimeout, func() (bool, error) {
		_, a := c.zoneCapacity(class, "zone-a")
		_, b := c.zoneCapacity(class, "zone-b")
		return a && b, nil
	})
	free, _ := c.zoneCapacity(class, "zone-a")
	// Leave less than one claim of capacity-app (1 GiB) free in zone-a.
	fill := free.Value() - 256<<20
	if fill < 1<<30 {
		c.fatalf("zone-a has only %s free: the story needs a pool larger than 1.25 GiB", free.String())
	}
	filler := find[*corev1.PersistentVolumeClaim](t, objs, "capacity-filler")
	filler.Spec.Resources.Requests[corev1.ResourceStorage] = *resource.NewQuantity(fill, resource.BinarySI)
	c.create(filler, find[*corev1.Pod](t, objs, "capacity-filler"))
	c.waitRunning("capacity-filler")
	if z := pvZones(c.boundPV("capacity-filler")); len(z) != 1 || z[0] != "zone-a" {
		c.fatalf("capacity-filler's volume zones %v, want zone-a", z)
	}
	// The provisioner polls GetCapacity (--capacity-poll-interval=20s).
	c.waitFor("zone-a's published capacity below 1 GiB", 2*time.Minute, func() (bool, error) {
		q, ok := c.zoneCapacity(class, "zone-a")
		return ok && q.Value() < 1<<30, nil
	})

	app := find[*appsv1.StatefulSet](t, objs, "capacity-app")
	c.create(app)
	for i := range *app.Spec.Replicas {
		pod, claim := fmt.Sprintf("capacity-app-%d", i), fmt.Sprintf("data-capacity-app-%d", i)
		p := c.waitRunning(pod)
		if z := c.zoneOf(p.Spec.NodeName); z != "zone-b" {
			c.fatalf("%s scheduled to %s in %s, where no 1 GiB claim fits", pod, p.Spec.NodeName, z)
		}
		if z := pvZones(c.boundPV(claim)); len(z) != 1 || z[0] != "zone-b" {
			c.fatalf("%s's volume zones %v, want zone-b", claim, z)
		}
		evs, err := c.cs.CoreV1().Events(c.ns).List(c.ctx, metav1.ListOptions{
			FieldSelector: "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=" + claim})
		if err != nil {
			c.fatalf("events of %s: %v", claim, err)
		}
		for _, e := range evs.Items {
			if e.Reason == "ProvisioningFailed" || strings.Contains(e.Message, "ResourceExhausted") {
				c.fatalf("%s was first provisioned where it did not fit: %s: %s", claim, e.Reason, e.Message)
			}
		}
	}
}

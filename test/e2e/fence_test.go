package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var networkFences = schema.GroupVersionResource{Group: "csiaddons.openshift.io", Version: "v1alpha1", Resource: "networkfences"}

// outOfService is the taint that tells Kubernetes a node is down for good:
// its pods may be deleted and its volumes detached without the node.
var outOfService = corev1.Taint{Key: "node.kubernetes.io/out-of-service", Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}

// applyNetworkFence makes the NetworkFence name on cidr in state (Fenced,
// Unfenced), as the operator guide describes it, and waits for its result
// Succeeded.
func (c *cluster) applyNetworkFence(name, cidr, state string) {
	c.t.Helper()
	nf := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "csiaddons.openshift.io/v1alpha1", "kind": "NetworkFence",
		"metadata": map[string]any{"name": name},
		"spec": map[string]any{
			"driver": driverName, "fenceState": state, "cidrs": []any{cidr},
			"secret": map[string]any{"name": "modeguard-networkfence", "namespace": "modeguard"},
		},
	}}
	if _, err := c.dyn.Resource(networkFences).Create(c.ctx, nf, metav1.CreateOptions{}); err != nil {
		c.fatalf("NetworkFence %s: %v", name, err)
	}
	c.waitFor("NetworkFence "+name+" ("+state+") Succeeded", startTimeout, func() (bool, error) {
		u, err := c.dyn.Resource(networkFences).Get(c.ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		result, _, _ := unstructured.NestedString(u.Object, "status", "result")
		message, _, _ := unstructured.NestedString(u.Object, "status", "message")
		return result == "Succeeded", fmt.Errorf("result %q: %s", result, message)
	})
}

// deleteNetworkFence deletes a NetworkFence and waits until it is gone
// (which lifts nothing: see the operator guide).
func (c *cluster) deleteNetworkFence(name string) {
	c.t.Helper()
	if err := c.dyn.Resource(networkFences).Delete(c.ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		c.fatalf("%v", err)
	}
	c.waitFor("NetworkFence "+name+" gone", startTimeout, func() (bool, error) {
		_, err := c.dyn.Resource(networkFences).Get(c.ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}

// setTaint adds (on) or removes the taint on node.
func (c *cluster) setTaint(node string, taint corev1.Taint, on bool) error {
	n, err := c.cs.CoreV1().Nodes().Get(c.ctx, node, metav1.GetOptions{})
	if err != nil {
		return err
	}
	var taints []corev1.Taint
	for _, t := range n.Spec.Taints {
		if t.Key != taint.Key {
			taints = append(taints, t)
		}
	}
	if on {
		taints = append(taints, taint)
	}
	n.Spec.Taints = taints
	_, err = c.cs.CoreV1().Nodes().Update(c.ctx, n, metav1.UpdateOptions{})
	return err
}

// targetACLsNaming counts the storage target's access-list entries (LIO's
// acls, one per initiator a volume is published to) that name iqn.
func (c *cluster) targetACLsNaming(zone, iqn string) int {
	c.t.Helper()
	out, stderr, err := c.execIn("modeguard", "modeguard-target-"+zone+"-0", "modeguard", "sh", "-c",
		`ls -d /sys/kernel/config/target/iscsi/*/tpgt_*/acls/* 2>/dev/null || true`)
	if err != nil {
		c.fatalf("the access lists of the target of %s: %v %s", zone, err, stderr)
	}
	n := 0
	for _, acl := range strings.Fields(out) {
		if strings.HasSuffix(acl, "/"+iqn) {
			n++
		}
	}
	return n
}

// A fence, end to end: a csi-addons NetworkFence on a worker VM's address
// cuts it off the storage while its pods write. The node (zone-a's first: no
// controller, no target) holds an NFS and an iSCSI ReadWriteOnce volume,
// each written by a pod with acknowledged (synced) lines, and an NFS
// ReadWriteMany volume whose pod tolerates the out-of-service taint.
//   - The fence: the NFS pod's next write fails (the server refuses it), and
//     the node's initiator is off the target's access list, so the iSCSI
//     pod's next write is never acknowledged.
//   - The out-of-service taint, as an operator sets it on a node that is
//     down for good: the two writers are evicted and deleted, Kubernetes
//     detaches their volumes without the node, and pods on the other node of
//     the zone read exactly the lines the fenced node had acknowledged.
//   - The fence lifted (a NetworkFence Unfenced; deleting a Fenced one
//     does not lift it): the pod that stayed writes its volume again.
func TestNetworkFenceCutsANodeOff(t *testing.T) {
	nfsNodes(t)
	iscsiTargets(t)
	c := setup(t)
	if _, err := c.dyn.Resource(networkFences).List(c.ctx, metav1.ListOptions{}); err != nil {
		t.Skipf("no NetworkFence API here (csi-addons not installed): %v", err)
	}
	_, fenced := c.storageNode("zone-a") // not the zone's storage node
	if fenced != nodeA1 {
		c.fatalf("zone-a's node without its target is %s, want %s (the controller's node is not fenced)", fenced, nodeA1)
	}
	other := nodeA2
	cidr := fenced + "/32"
	iqn := "iqn.2026-11.dev.csi.modeguard.node:" + fenced // hack/local-cluster/vm-node.sh
	fence, lift := "fence-"+c.ns, "lift-"+c.ns
	// Whatever happens: no fence, no taint left for the next test.
	c.t.Cleanup(func() {
		if err := c.setTaint(fenced, outOfService, false); err != nil {
			t.Errorf("removing the out-of-service taint of %s: %v", fenced, err)
		}
		if _, err := c.dyn.Resource(networkFences).Get(c.ctx, fence, metav1.GetOptions{}); err == nil {
			c.deleteNetworkFence(fence)
			c.applyNetworkFence(lift, cidr, "Unfenced")
		}
		if _, err := c.dyn.Resource(networkFences).Get(c.ctx, lift, metav1.GetOptions{}); err == nil {
			c.deleteNetworkFence(lift)
		}
	})

	block := blockClaim("block", corev1.ReadWriteOnce, corev1.PersistentVolumeFilesystem)
	c.create(nfsClaim("nfs", corev1.ReadWriteOnce), block, nfsClaim("shared", corev1.ReadWriteMany))
	stays := onNode(pinnedPod("stays", "shared", ""), fenced)
	stays.Spec.Tolerations = []corev1.Toleration{{Key: outOfService.Key, Operator: corev1.TolerationOpExists, Effect: outOfService.Effect}}
	c.create(onNode(pinnedPod("nfs-writer", "nfs", ""), fenced), onNode(pinnedPod("block-writer", "block", ""), fenced), stays)
	acked := map[string][]string{}
	for _, pod := range []string{"nfs-writer", "block-writer", "stays"} {
		c.waitRunning(pod)
		acked[pod] = c.ackedWrites(pod, "/data/acked", "before", 3)
	}
	nfsPV, blockPV := c.boundPV("nfs"), c.boundPV("block")
	if n := c.targetACLsNaming("zone-a", iqn); n != 1 {
		c.fatalf("before the fence %d of the target's access lists name %s, want 1", n, iqn)
	}

	c.applyNetworkFence(fence, cidr, "Fenced")
	c.waitFor("the NFS server refusing "+fenced, scaled(time.Minute), func() (bool, error) {
		_, stderr, err := c.exec("nfs-writer", "sh", "-c", "echo fenced >> /data/acked && sync")
		return err != nil, fmt.Errorf("a write after the fence: %v %s", err, stderr)
	})
	if n := c.targetACLsNaming("zone-a", iqn); n != 0 {
		c.fatalf("after the fence %d of the target's access lists still name %s", n, iqn)
	}
	// The write waits for a session the target no longer lets in; exec
	// gives up on it after execTimeout.
	if _, stderr, err := c.exec("block-writer", "sh", "-c", "echo fenced >> /data/acked && sync"); err == nil {
		c.fatalf("a write to the iSCSI volume was acknowledged after the fence (%s)", stderr)
	}

	if err := c.setTaint(fenced, outOfService, true); err != nil {
		c.fatalf("%v", err)
	}
	for _, pod := range []string{"nfs-writer", "block-writer"} {
		c.waitFor(pod+" evicted", startTimeout, func() (bool, error) {
			p, err := c.cs.CoreV1().Pods(c.ns).Get(c.ctx, pod, metav1.GetOptions{})
			return apierrors.IsNotFound(err) || (err == nil && p.DeletionTimestamp != nil), nil
		})
		// The node cannot finish it (its volumes hang): delete it as for a
		// node that is down.
		if err := c.cs.CoreV1().Pods(c.ns).Delete(c.ctx, pod, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil && !apierrors.IsNotFound(err) {
			c.fatalf("%v", err)
		}
	}
	for _, pv := range []*corev1.PersistentVolume{nfsPV, blockPV} {
		c.waitFor("volume "+pv.Name+" detached from "+fenced, startTimeout, func() (bool, error) {
			return c.attachment(pv.Name, fenced) == nil, nil
		})
	}
	for _, tc := range []struct{ reader, claim, writer string }{{"nfs-reader", "nfs", "nfs-writer"}, {"block-reader", "block", "block-writer"}} {
		c.create(onNode(pinnedPod(tc.reader, tc.claim, ""), other))
		c.waitRunning(tc.reader)
		if got := c.mustExec(tc.reader, "cat", "/data/acked"); got != strings.Join(acked[tc.writer], "\n")+"\n" {
			c.fatalf("on %s the %s volume holds\n%s\nwant exactly what %s acknowledged before the fence:\n%s",
				other, tc.claim, got, fenced, strings.Join(acked[tc.writer], "\n"))
		}
	}

	// Lifted: deleting the Fenced NetworkFence lifts nothing (csi-addons
	// v0.14.0); one Unfenced on the block does.
	c.deleteNetworkFence(fence)
	c.applyNetworkFence(lift, cidr, "Unfenced")
	c.deleteNetworkFence(lift)
	if err := c.setTaint(fenced, outOfService, false); err != nil {
		c.fatalf("%v", err)
	}
	var line string
	c.waitFor("stays writing its volume again on "+fenced, startTimeout, func() (bool, error) {
		line = "after-" + time.Now().Format("150405")
		_, stderr, err := c.exec("stays", "sh", "-c", "echo "+line+" >> /data/acked && sync")
		return err == nil, fmt.Errorf("%v %s", err, stderr)
	})
	got := strings.Split(strings.TrimSpace(c.mustExec("stays", "cat", "/data/acked")), "\n")
	if strings.Join(got[:min(3, len(got))], "\n") != strings.Join(acked["stays"], "\n") || got[len(got)-1] != line {
		c.fatalf("stays' volume holds %q, want its lines from before the fence first and %q last", got, line)
	}
}

package driver_test

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// TestConcurrentAttachesKeepTheNodeLimit: attaches of different volumes to
// one node that arrive together still add up to exactly the limit the node
// reports in its id: each counts what the node holds under the node's
// lock. Each attach is held up between that count and its record, and
// several rounds start from an empty node, to give a lost race every
// chance to show.
func TestConcurrentAttachesKeepTheNodeLimit(t *testing.T) {
	const limit, volumes, rounds = 3, 16, 10
	e := newMemoryEnv(t, limit, func(e *env) { e.attachDelay = 5 * time.Millisecond })
	c := blockCap(accessmode.SingleNodeWriter)
	var vols []string
	for i := 0; i < volumes; i++ {
		vols = append(vols, e.createVolume(t, fmt.Sprintf("race-%d", i), c))
	}
	node := e.nodeID()
	if n, err := nodeid.Parse(node); err != nil || n.MaxVolumes != limit {
		t.Fatalf("node id %q = %+v, %v; want the limit %d in it", node, n, err, limit)
	}
	for round := range rounds {
		var wg sync.WaitGroup
		errs := make([]error, volumes)
		start := make(chan struct{})
		for i, v := range vols {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				_, errs[i] = e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: v, NodeId: node, VolumeCapability: c})
			}()
		}
		close(start)
		wg.Wait()
		var published []string
		for i, err := range errs {
			switch status.Code(err) {
			case codes.OK:
				published = append(published, vols[i])
			case codes.ResourceExhausted:
			default:
				t.Errorf("round %d: publish of %s: %v, want OK or RESOURCE_EXHAUSTED", round, vols[i], err)
			}
		}
		held := 0
		for _, v := range vols {
			held += len(publishedNodes(t, e, v))
		}
		for _, v := range published {
			if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: v, NodeId: node}); err != nil {
				t.Fatalf("ControllerUnpublishVolume %s: %v", v, err)
			}
		}
		if len(published) != limit || held != limit {
			t.Fatalf("round %d: %d publishes succeeded and %d attachments are recorded; the node's limit is %d", round, len(published), held, limit)
		}
	}
}

// TestNodeIdentityIsItsName: a node is its name. One that comes back under
// a new address holds what it held (idempotent publishes, everything it
// holds recorded under the new id, no other node let in) and can let go of
// it under either id; one that claims another zone is refused, saying so.
func TestNodeIdentityIsItsName(t *testing.T) {
	e := newMemoryEnv(t, 0)
	c := blockCap(accessmode.SingleNodeWriter)
	a := e.createVolume(t, "ident-a", c)
	b := e.createVolume(t, "ident-b", c)
	publish := func(vol, node string) error {
		_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: node, VolumeCapability: c})
		return err
	}
	unpublish := func(vol, node string) {
		t.Helper()
		if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: node}); err != nil {
			t.Fatalf("ControllerUnpublishVolume %s from %s: %v", vol, node, err)
		}
	}
	const before, after = "node-r@" + testZone + "@10.0.0.1", "node-r@" + testZone + "@10.0.0.2@16"
	for _, v := range []string{a, b} {
		if err := publish(v, before); err != nil {
			t.Fatal(err)
		}
		e.cleanupControllerUnpublish(t, v, "node-r@"+testZone)
	}

	if err := publish(a, after); err != nil {
		t.Fatalf("the node's publish under its new id: %v, want OK (it holds the volume)", err)
	}
	for _, v := range []string{a, b} {
		if got := publishedNodes(t, e, v); !slices.Equal(got, []string{after}) {
			t.Errorf("volume %s is published to %v, want [%s]: every attachment follows the node's newest id", v, got, after)
		}
	}
	err := publish(a, "node-x@"+testZone)
	wantCode(t, "another node while the moved node holds the volume", err, codes.FailedPrecondition)

	// Another zone: refused, naming both.
	err = publish(a, "node-r@zone-b@10.0.0.2")
	wantCode(t, "the same node in another zone", err, codes.FailedPrecondition)
	if m := status.Convert(err).Message(); !strings.Contains(m, "zone-b") || !strings.Contains(m, testZone) {
		t.Errorf("message %q should name the zone the node reports and the zone it held the volumes in", m)
	}
	if got := publishedNodes(t, e, b); !slices.Equal(got, []string{after}) {
		t.Errorf("a refused publish changed volume %s's attachment to %v", b, got)
	}

	// Unpublish under the old id still lets go: the name matches.
	unpublish(a, before)
	if got := publishedNodes(t, e, a); len(got) != 0 {
		t.Errorf("after unpublish under the node's old id, %s is published to %v", a, got)
	}
	// ... and it moved the rest back to the id it named (the newest seen).
	if got := publishedNodes(t, e, b); !slices.Equal(got, []string{before}) {
		t.Errorf("volume %s is published to %v, want [%s]", b, got, before)
	}
	unpublish(b, "node-r@zone-b")
	if got := publishedNodes(t, e, b); len(got) != 0 {
		t.Errorf("after unpublish under another zone, %s is published to %v", b, got)
	}
	if err := publish(a, "node-x@"+testZone); err != nil {
		t.Errorf("another node after the first let go: %v", err)
	} else {
		e.cleanupControllerUnpublish(t, a, "node-x@"+testZone)
	}
}

// TestLongNodeName: a Kubernetes node name of 253 characters works; the
// id carries its key, short enough for it, and the topology only the zone.
func TestLongNodeName(t *testing.T) {
	name := strings.Repeat("n", 60) + "." + strings.Repeat("o", 60) + "." + strings.Repeat("d", 60) + "." + strings.Repeat("e", 70)
	if len(name) != 253 {
		t.Fatalf("name is %d characters", len(name))
	}
	e := newMemoryEnv(t, 8, func(e *env) { e.nodeName = name })
	info, err := e.node.NodeGetInfo(ctx(t), &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if id, err := nodeid.Parse(info.GetNodeId()); err != nil || id.Name != nodeid.Key(name) || len(id.Name) > 63 {
		t.Errorf("node id %q (%v): want the name's key %q", info.GetNodeId(), err, nodeid.Key(name))
	}
	if segs := info.GetAccessibleTopology().GetSegments(); len(segs) != 1 || segs[driver.TopologyZoneKey] != testZone {
		t.Errorf("topology %v, want only %s=%s", segs, driver.TopologyZoneKey, testZone)
	}
	if len(info.GetNodeId()) > 192 {
		t.Errorf("node id %q is %d bytes long", info.GetNodeId(), len(info.GetNodeId()))
	}
	c := mountCap(accessmode.SingleNodeSingleWriter)
	vol, staging, pc := e.setup(t, "long-name", c)
	if err := e.publish(t, vol, staging, e.targetPath("long-name"), c, pc, false); err != nil {
		t.Fatalf("publish on a node with a long name: %v", err)
	}
	t.Cleanup(func() {
		e.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: vol, TargetPath: e.targetPath("long-name")})
	})
}

package driver_test

import (
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"github.com/csi-addons/spec/lib/go/identity"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/metrics"
)

func withFenceFile(e *env) { e.fenceFile = filepath.Join(e.root, "controller", "fences.json") }

func cidrs(s ...string) []*fence.CIDR {
	out := make([]*fence.CIDR, len(s))
	for i, c := range s {
		out[i] = &fence.CIDR{Cidr: c}
	}
	return out
}

func (e *env) fenced(t *testing.T) []string {
	t.Helper()
	resp, err := fence.NewFenceControllerClient(e.conn).ListClusterFence(ctx(t), &fence.ListClusterFenceRequest{})
	if err != nil {
		t.Fatalf("ListClusterFence: %v", err)
	}
	var out []string
	for _, c := range resp.GetCidrs() {
		out = append(out, c.GetCidr())
	}
	return out
}

func networkFence(t *testing.T, e *env) bool {
	t.Helper()
	resp, err := identity.NewIdentityClient(e.conn).GetCapabilities(ctx(t), &identity.GetCapabilitiesRequest{})
	if err != nil {
		t.Fatalf("csi-addons GetCapabilities: %v", err)
	}
	for _, c := range resp.GetCapabilities() {
		if c.GetNetworkFence().GetType() == identity.Capability_NetworkFence_NETWORK_FENCE {
			return true
		}
	}
	return false
}

// TestNetworkFenceNeedsAPlaceForTheList: a controller without a fence
// file does not offer NetworkFence, and its calls say what is missing.
func TestNetworkFenceNeedsAPlaceForTheList(t *testing.T) {
	e := newMemoryEnv(t, 0)
	if networkFence(t, e) {
		t.Error("csi-addons GetCapabilities offers NETWORK_FENCE without a fence file")
	}
	_, err := fence.NewFenceControllerClient(e.conn).FenceClusterNetwork(ctx(t), &fence.FenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.0/8")})
	wantCode(t, "FenceClusterNetwork without a fence file", err, codes.FailedPrecondition)
	if !strings.Contains(status.Convert(err).Message(), "--fence-file") {
		t.Errorf("the refusal does not say what is missing: %v", err)
	}
}

// TestNetworkFenceRefusesBadRequests: what is wrong, and what is accepted.
func TestNetworkFenceRefusesBadRequests(t *testing.T) {
	e := newMemoryEnv(t, 0, withFenceFile)
	if !networkFence(t, e) {
		t.Fatal("csi-addons GetCapabilities does not offer NETWORK_FENCE with a fence file")
	}
	_, err := fence.NewFenceControllerClient(e.conn).GetFenceClients(ctx(t), &fence.GetFenceClientsRequest{Parameters: map[string]string{"clusterID": "x"}})
	wantCode(t, "GetFenceClients with parameters", err, codes.InvalidArgument)
	fc := fence.NewFenceControllerClient(e.conn)
	for _, tt := range []struct {
		name   string
		req    *fence.FenceClusterNetworkRequest
		saying string
	}{
		{"no block", &fence.FenceClusterNetworkRequest{}, "at least one"},
		{"an address", &fence.FenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.5")}, "10.0.0.5/32"},
		{"host bits", &fence.FenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.0/8", "10.1.2.3/16")}, "10.1.0.0/16"},
		{"a name", &fence.FenceClusterNetworkRequest{Cidrs: cidrs("node-1")}, "not a CIDR block"},
		{"parameters", &fence.FenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.0/8"), Parameters: map[string]string{"clusterID": "x"}}, "clusterID"},
	} {
		_, err := fc.FenceClusterNetwork(ctx(t), tt.req)
		wantCode(t, tt.name, err, codes.InvalidArgument)
		if !strings.Contains(status.Convert(err).Message(), tt.saying) {
			t.Errorf("%s: %v; want it to say %q", tt.name, err, tt.saying)
		}
		_, err = fc.UnfenceClusterNetwork(ctx(t), &fence.UnfenceClusterNetworkRequest{Cidrs: tt.req.Cidrs, Parameters: tt.req.Parameters})
		wantCode(t, "unfence: "+tt.name, err, codes.InvalidArgument)
	}
	if got := e.fenced(t); len(got) != 0 {
		t.Errorf("refused requests left fences: %v", got)
	}
}

// TestNetworkFenceOnTheLoopTransport: a pool every node shares cannot
// keep a node from writing, so fencing a node that holds one of its
// volumes fails and says so; the fence is in force all the same for what
// the controller decides (attaches), survives a restart, and lifts.
func TestNetworkFenceOnTheLoopTransport(t *testing.T) {
	m := metrics.New("test", []string{"controller", "node"})
	e := newEnv(t, 0, withFenceFile, func(e *env) { e.metrics = m })
	srv := serveMetrics(t, m)
	fc := fence.NewFenceControllerClient(e.conn)
	c := blockCap(accessmode.SingleNodeWriter)
	held := e.createVolume(t, "held", c)
	spare := e.createVolume(t, "spare", c)
	fencedNode := "node-2@" + testZone + "@10.0.0.2"
	otherNode := "node-3@" + testZone + "@10.1.0.3"
	e.controllerPublishTo(t, held, fencedNode, c, false)

	_, err := fc.FenceClusterNetwork(ctx(t), &fence.FenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.0/24")})
	wantCode(t, "fencing a node that holds a loop-transport volume", err, codes.FailedPrecondition)
	if msg := status.Convert(err).Message(); !strings.Contains(msg, held) || !strings.Contains(msg, "--block-target") {
		t.Errorf("the failure does not name the volume and the way out: %v", err)
	}
	if got := e.fenced(t); !slices.Equal(got, []string{"10.0.0.0/24"}) {
		t.Errorf("ListClusterFence = %v, want the block that was asked for", got)
	}
	// The attachment is as it was: the CO still has the volume there.
	if got := publishedNodes(t, e, held); !slices.Equal(got, []string{fencedNode}) {
		t.Errorf("volume published to %v, want %s", got, fencedNode)
	}
	refusedFenced := func(what, vol, node string) {
		t.Helper()
		_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: node, VolumeCapability: c})
		wantCode(t, what, err, codes.FailedPrecondition)
		if !strings.Contains(status.Convert(err).Message(), "fenced") {
			t.Errorf("%s: %v; want it to say the node is fenced", what, err)
		}
	}
	refusedFenced("publish to the fenced node", spare, fencedNode)
	refusedFenced("publish to the fenced node under another address", spare, "node-2@"+testZone+"@10.9.9.9")
	_, err = e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: spare, NodeId: "node-4@" + testZone, VolumeCapability: c})
	wantCode(t, "publish to a node with no address while fences are in force", err, codes.FailedPrecondition)
	if !strings.Contains(status.Convert(err).Message(), "--node-address") {
		t.Errorf("the refusal of a node without address does not say what to do: %v", err)
	}
	e.controllerPublishTo(t, spare, otherNode, c, false)
	// What a fence would name for each node the storage serves.
	clients, err := fc.GetFenceClients(ctx(t), &fence.GetFenceClientsRequest{})
	if err != nil {
		t.Fatalf("GetFenceClients: %v", err)
	}
	var got []string
	for _, cl := range clients.GetClients() {
		for _, a := range cl.GetAddresses() {
			got = append(got, cl.GetId()+"="+a.GetCidr())
		}
	}
	if want := []string{"node-2=10.0.0.2/32", "node-3=10.1.0.3/32"}; !slices.Equal(got, want) {
		t.Errorf("GetFenceClients = %v, want %v", got, want)
	}

	f := scrape(t, srv.URL())
	want(t, f, "modeguard_network_fences", nil, 1)
	want(t, f, "modeguard_fenced_attachments", map[string]string{"backend": "block"}, 0)
	want(t, f, "modeguard_publish_refused_total", map[string]string{"stage": "attach", "mode": "SINGLE_NODE_WRITER", "reason": "Fenced"}, 3)

	e.restart(t)
	fc = fence.NewFenceControllerClient(e.conn)
	if got := e.fenced(t); !slices.Equal(got, []string{"10.0.0.0/24"}) {
		t.Errorf("after a restart ListClusterFence = %v", got)
	}
	refusedFenced("publish to the fenced node after a restart", spare, "node-2@"+testZone+"@10.0.0.2")

	// Lifted: the node is served again.
	if _, err := fc.UnfenceClusterNetwork(ctx(t), &fence.UnfenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.0/24")}); err != nil {
		t.Fatalf("UnfenceClusterNetwork: %v", err)
	}
	if got := e.fenced(t); len(got) != 0 {
		t.Errorf("after the lift ListClusterFence = %v", got)
	}
	want(t, scrape(t, srv.URL()), "modeguard_network_fences", nil, 0)
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: spare, NodeId: otherNode}); err != nil {
		t.Fatal(err)
	}
	e.controllerPublishTo(t, spare, "node-2@"+testZone+"@10.9.9.9", c, false)
}

// TestNetworkFenceWaitsForAnAttachInFlight: an attach that checked the
// fence list before a fence came is recorded before the fence's pass reads
// the volumes, so the pass finds it. Here the pass cannot fence it (loop
// transport) and must say so: an answer of OK would mean the attach
// slipped past the fence.
func TestNetworkFenceWaitsForAnAttachInFlight(t *testing.T) {
	e := newEnv(t, 0, withFenceFile, func(e *env) { e.attachDelay = 500 * time.Millisecond })
	c := blockCap(accessmode.SingleNodeWriter)
	vol := e.createVolume(t, "in-flight", c)
	node := "node-2@" + testZone + "@10.0.0.2"
	var wg sync.WaitGroup
	var publishErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, publishErr = e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: node, VolumeCapability: c})
	}()
	time.Sleep(200 * time.Millisecond) // the publish is in its SetAttachments
	_, fenceErr := fence.NewFenceControllerClient(e.conn).FenceClusterNetwork(ctx(t), &fence.FenceClusterNetworkRequest{Cidrs: cidrs("10.0.0.2/32")})
	wg.Wait()
	if publishErr != nil {
		t.Fatalf("the publish that came first: %v", publishErr)
	}
	e.cleanupControllerUnpublish(t, vol, node)
	wantCode(t, "a fence of a node whose attach was in flight", fenceErr, codes.FailedPrecondition)
	if !strings.Contains(status.Convert(fenceErr).Message(), vol) {
		t.Errorf("the fence's answer does not name the volume attached meanwhile: %v", fenceErr)
	}
}

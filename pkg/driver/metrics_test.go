package driver_test

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/nodestate"
)

// scrape fetches the metrics over HTTP and parses the text format.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scraping %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scraping %s: HTTP %s", url, resp.Status)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Fatalf("scraping %s: content type %q, want the text format", url, ct)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing the scrape: %v", err)
	}
	return families
}

// gathered reads the metrics straight from the registry, as a scrape would.
func gathered(t *testing.T, m *metrics.Metrics) map[string]*dto.MetricFamily {
	t.Helper()
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, f := range families {
		out[f.GetName()] = f
	}
	return out
}

// sample finds the series of name whose labels are exactly labels and
// returns its value (a histogram's sample count).
func sample(t *testing.T, families map[string]*dto.MetricFamily, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	f, ok := families[name]
	if !ok {
		return 0, false
	}
	for _, m := range f.GetMetric() {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		match := true
		for _, l := range m.GetLabel() {
			if v, ok := labels[l.GetName()]; !ok || v != l.GetValue() {
				match = false
				break
			}
		}
		if !match {
			continue
		}
		switch f.GetType() {
		case dto.MetricType_COUNTER:
			return m.GetCounter().GetValue(), true
		case dto.MetricType_GAUGE:
			return m.GetGauge().GetValue(), true
		case dto.MetricType_HISTOGRAM:
			return float64(m.GetHistogram().GetSampleCount()), true
		}
		t.Fatalf("%s has type %v", name, f.GetType())
	}
	return 0, false
}

// want asserts one series' value.
func want(t *testing.T, families map[string]*dto.MetricFamily, name string, labels map[string]string, value float64) {
	t.Helper()
	got, ok := sample(t, families, name, labels)
	if !ok {
		t.Errorf("%s%v: no such series", name, labels)
		return
	}
	if got != value {
		t.Errorf("%s%v = %v, want %v", name, labels, got, value)
	}
}

// total sums every series of a counter or gauge.
func total(families map[string]*dto.MetricFamily, name string) float64 {
	var sum float64
	for _, m := range families[name].GetMetric() {
		sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return sum
}

func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names
}

// serveMetrics serves m on a loopback port until the test ends.
func serveMetrics(t *testing.T, m *metrics.Metrics) *metrics.Server {
	t.Helper()
	srv, err := m.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(c); err != nil {
			t.Errorf("shutting the metrics server down: %v", err)
		}
	})
	return srv
}

// TestMetricsOverHTTP drives a real driver (block backend on tmpfs, real
// loop devices and mounts) through one allowed and one refused attach and
// publish of a ReadWriteOncePod volume, then scrapes its metrics server over
// HTTP: the refusals, the calls, the volume, the pool and the lock files
// must all show, and after the cleanup all must be gone again.
func TestMetricsOverHTTP(t *testing.T) {
	m := metrics.New("test", []string{"controller", "node"})
	e := newEnv(t, 0, func(e *env) { e.metrics = m })
	srv := serveMetrics(t, m)
	const (
		snsw = "SINGLE_NODE_SINGLE_WRITER"
		name = "metrics-rwop"
	)
	c := mountCap(accessmode.SingleNodeSingleWriter)
	volID := e.createVolume(t, name, c)
	pc := e.controllerPublish(t, volID, c)
	_, err := e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: "other@" + testZone, VolumeCapability: c,
	})
	wantCode(t, "ControllerPublishVolume to a second node", err, codes.FailedPrecondition)
	staging := e.stage(t, volID, name, c, pc)
	targetA, targetB := e.targetPath(name+"-a"), e.targetPath(name+"-b")
	if err := e.publish(t, volID, staging, targetA, c, pc, false); err != nil {
		t.Fatalf("NodePublishVolume at the first target: %v", err)
	}
	err = e.publish(t, volID, staging, targetB, c, pc, false)
	wantCode(t, "NodePublishVolume at a second target", err, codes.FailedPrecondition)

	f := scrape(t, srv.URL())
	want(t, f, "modeguard_publish_refused_total", map[string]string{"stage": "attach", "mode": snsw, "reason": "HeldByOtherNode"}, 1)
	want(t, f, "modeguard_publish_refused_total", map[string]string{"stage": "publish", "mode": snsw, "reason": "HeldByOtherWorkload"}, 1)
	if n := total(f, "modeguard_publish_refused_total"); n != 2 {
		t.Errorf("%v refusals counted in all, want the 2 made", n)
	}
	// Series of other reasons exist before their first refusal.
	want(t, f, "modeguard_publish_refused_total", map[string]string{"stage": "attach", "mode": snsw, "reason": "WriterLimit"}, 0)

	publish := func(code string) map[string]string {
		return map[string]string{"method": "ControllerPublishVolume", "code": code}
	}
	want(t, f, "modeguard_csi_requests_total", publish("OK"), 1)
	want(t, f, "modeguard_csi_requests_total", publish("FailedPrecondition"), 1)
	want(t, f, "modeguard_csi_request_duration_seconds", publish("OK"), 1)
	want(t, f, "modeguard_csi_request_duration_seconds", publish("FailedPrecondition"), 1)
	want(t, f, "modeguard_csi_requests_total", map[string]string{"method": "NodePublishVolume", "code": "OK"}, 1)
	want(t, f, "modeguard_csi_requests_total", map[string]string{"method": "NodePublishVolume", "code": "FailedPrecondition"}, 1)
	want(t, f, "modeguard_csi_requests_total", map[string]string{"method": "CreateVolume", "code": "OK"}, 1)

	volumes := func(state string) map[string]string {
		return map[string]string{"backend": "block", "access_mode": snsw, "state": state}
	}
	want(t, f, "modeguard_volumes", volumes("attached"), 1)
	want(t, f, "modeguard_volumes", volumes("available"), 0)
	if n := total(f, "modeguard_volumes"); n != 1 {
		t.Errorf("%v volumes in all, want 1", n)
	}

	pool := map[string]string{"backend": "block", "zone": testZone}
	size, okSize := sample(t, f, "modeguard_pool_size_bytes", pool)
	free, okFree := sample(t, f, "modeguard_pool_free_bytes", pool)
	if !okSize || !okFree || !(size > free && free > 0) {
		t.Errorf("pool %v: size %v (present %t), free %v (present %t), want size > free > 0", pool, size, okSize, free, okFree)
	}
	want(t, f, "modeguard_pool_committed_bytes", pool, float64(volumeSize))

	// The node's name and zone, not its CSI node id (which carries its
	// address): a series must not change when the address does.
	node := map[string]string{"node": e.nodeName, "zone": testZone}
	want(t, f, "modeguard_node_volume_holders", node, 1)
	want(t, f, "modeguard_node_staged_volumes", node, 1)
	if _, ok := f["modeguard_nfs_exports"]; ok {
		t.Error("modeguard_nfs_exports reported without an NFS backend")
	}

	// The driver's own attach rules count with their reasons too: a node
	// of another zone, and a mode wider than the volume's.
	_, err = e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: "far@zone-b", VolumeCapability: c,
	})
	wantCode(t, "ControllerPublishVolume to another zone", err, codes.FailedPrecondition)
	_, err = e.ctrl.ControllerPublishVolume(ctx(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: "other@" + testZone, VolumeCapability: mountCap(accessmode.MultiNodeMultiWriter),
	})
	wantCode(t, "ControllerPublishVolume with a wider mode", err, codes.FailedPrecondition)
	f = scrape(t, srv.URL())
	want(t, f, "modeguard_publish_refused_total", map[string]string{"stage": "attach", "mode": snsw, "reason": "OtherZone"}, 1)
	want(t, f, "modeguard_publish_refused_total", map[string]string{"stage": "attach", "mode": "MULTI_NODE_MULTI_WRITER", "reason": "ModeNotAllowed"}, 1)
	want(t, f, "modeguard_csi_requests_total", publish("FailedPrecondition"), 3)

	// Undo everything (the env's cleanups then find nothing to do), and the
	// state metrics follow at the next scrape.
	if _, err := e.node.NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: targetA}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := e.node.NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	f = scrape(t, srv.URL())
	want(t, f, "modeguard_node_volume_holders", node, 0)
	want(t, f, "modeguard_node_staged_volumes", node, 0)
	want(t, f, "modeguard_volumes", volumes("attached"), 1) // still attached to the node
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx(t), &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: e.nodeID()}); err != nil {
		t.Fatalf("ControllerUnpublishVolume: %v", err)
	}
	f = scrape(t, srv.URL())
	want(t, f, "modeguard_volumes", volumes("attached"), 0)
	want(t, f, "modeguard_volumes", volumes("available"), 1)
	if _, err := e.ctrl.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: volID}); err != nil {
		t.Fatalf("DeleteVolume: %v", err)
	}
	f = scrape(t, srv.URL())
	if n := total(f, "modeguard_volumes"); n != 0 {
		t.Errorf("%v volumes after the delete, want 0", n)
	}
	want(t, f, "modeguard_pool_committed_bytes", pool, 0)
	// The refusals stay counted: they happened.
	if n := total(f, "modeguard_publish_refused_total"); n != 4 {
		t.Errorf("%v refusals counted after the cleanup, want 4", n)
	}

	if left := localcluster.MountsUnder(e.root); len(left) > 0 {
		t.Errorf("mounts left after the cleanup: %v", left)
	}
	if left := localcluster.LoopsUnder(e.root); len(left) > 0 {
		t.Errorf("loop devices left after the cleanup: %v", left)
	}
	for _, dir := range []string{filepath.Join(e.pool, "volumes"), filepath.Join(e.stateDir, nodestate.DirName)} {
		if left := dirEntries(t, dir); len(left) > 0 {
			t.Errorf("files left in %s: %v", dir, left)
		}
	}
}

package metrics

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/nodestate"
)

// fakeController answers ListVolumes and Pools; nothing else is called.
type fakeController struct {
	backend.Controller
	name    accessmode.Backend
	vols    []*backend.Volume
	pools   []backend.PoolStats
	listErr error
}

func (f *fakeController) Backend() accessmode.Backend { return f.name }
func (f *fakeController) ListVolumes(context.Context) ([]*backend.Volume, error) {
	return f.vols, f.listErr
}
func (f *fakeController) Pools(context.Context) ([]backend.PoolStats, error) { return f.pools, nil }

type fakeHolders []*nodestate.Record

func (f fakeHolders) All() ([]*nodestate.Record, error) { return f, nil }

func attached(modes ...accessmode.Mode) *backend.Volume {
	return &backend.Volume{Modes: modes, Attachments: []accessmode.Attachment{{Node: nodeid.MustParse("n@z")}}}
}

func available(modes ...accessmode.Mode) *backend.Volume { return &backend.Volume{Modes: modes} }

func TestInterceptorCountsByShortMethodAndCode(t *testing.T) {
	m := New("test", []string{"controller"})
	icpt := m.UnaryServerInterceptor()
	call := func(method string, err error) {
		_, got := icpt(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: method},
			func(context.Context, any) (any, error) { return nil, err })
		if got != err {
			t.Fatalf("interceptor changed the error: %v", got)
		}
	}
	const publish = "/csi.v1.Controller/ControllerPublishVolume"
	call(publish, nil)
	call(publish, status.Error(codes.FailedPrecondition, "held"))
	call(publish, status.Error(codes.FailedPrecondition, "held"))
	call("/csi.v1.Node/NodeGetInfo", nil)

	for _, tt := range []struct {
		method, code string
		want         float64
	}{
		{"ControllerPublishVolume", "OK", 1},
		{"ControllerPublishVolume", "FailedPrecondition", 2},
		{"NodeGetInfo", "OK", 1},
	} {
		if got := testutil.ToFloat64(m.requests.WithLabelValues(tt.method, tt.code)); got != tt.want {
			t.Errorf("requests{%s,%s} = %v, want %v", tt.method, tt.code, got, tt.want)
		}
	}
	if n := testutil.CollectAndCount(m.durations); n != 3 {
		t.Errorf("%d duration series, want 3", n)
	}
}

func TestNilMetricsCountNothing(t *testing.T) {
	var m *Metrics
	m.PublishRefused(StageAttach, accessmode.SingleNodeWriter, accessmode.ReasonHeldByOtherNode)
	m.NFSControlFailed("ApplyExport")
	m.NFSPaused(time.Millisecond, "copied")
	m.ObserveRequest("NodeGetInfo", codes.OK, time.Millisecond)
}

func TestNFSPausesAreTimedByOutcome(t *testing.T) {
	m := New("test", []string{"controller"})
	m.NFSPaused(30*time.Millisecond, "copied")
	m.NFSPaused(40*time.Millisecond, "copied")
	m.NFSPaused(5*time.Second, "over_budget")
	families, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][2]float64{} // outcome: count, sum
	for _, f := range families {
		if f.GetName() != "modeguard_nfs_pause_seconds" {
			continue
		}
		for _, s := range f.GetMetric() {
			got[s.GetLabel()[0].GetValue()] = [2]float64{float64(s.GetHistogram().GetSampleCount()), s.GetHistogram().GetSampleSum()}
		}
	}
	want := map[string][2]float64{"copied": {2, 0.07}, "over_budget": {1, 5}}
	for outcome, w := range want {
		g := got[outcome]
		if g[0] != w[0] || g[1] < w[1]-1e-9 || g[1] > w[1]+1e-9 {
			t.Errorf("pauses %s: count %v sum %v, want %v %v", outcome, g[0], g[1], w[0], w[1])
		}
	}
	if len(got) != len(want) {
		t.Errorf("pause series %v, want one per outcome seen", got)
	}
}

func TestPublishRefusedSeriesExistBeforeTheFirstRefusal(t *testing.T) {
	m := New("test", []string{"controller"})
	m.SetSources(Sources{
		Controllers: map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: &fakeController{name: accessmode.BackendBlock}},
		Node:        "n", Zone: "z", Holders: fakeHolders{},
	})
	attach := m.refused.WithLabelValues(StageAttach, "SINGLE_NODE_SINGLE_WRITER", accessmode.ReasonHeldByOtherNode)
	if got := testutil.ToFloat64(attach); got != 0 {
		t.Fatalf("fresh counter = %v", got)
	}
	want := len(accessmode.All) * (len(refusalsByStage[StageAttach]) + len(refusalsByStage[StageStage]) + len(refusalsByStage[StagePublish]))
	if n := testutil.CollectAndCount(m.refused); n != want {
		t.Errorf("%d refusal series before any refusal, want %d", n, want)
	}
	m.PublishRefused(StageAttach, accessmode.SingleNodeSingleWriter, accessmode.ReasonHeldByOtherNode)
	m.PublishRefused(StagePublish, accessmode.Mode(42), accessmode.ReasonInvalidMode)
	if got := testutil.ToFloat64(attach); got != 1 {
		t.Errorf("after one refusal = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.refused.WithLabelValues(StagePublish, "Unknown", accessmode.ReasonInvalidMode)); got != 1 {
		t.Errorf("an undefined mode is counted as Unknown: got %v", got)
	}
}

func TestStateIsReadAtScrapeTime(t *testing.T) {
	m := New("test", []string{"controller"})
	block := &fakeController{
		name: accessmode.BackendBlock,
		vols: []*backend.Volume{
			attached(accessmode.SingleNodeSingleWriter),
			available(accessmode.SingleNodeSingleWriter),
			available(accessmode.SingleNodeSingleWriter, accessmode.SingleNodeMultiWriter), // counts once per mode
		},
		pools: []backend.PoolStats{{Zone: "zone-a", SizeBytes: 100, FreeBytes: 60, CommittedBytes: 30}},
	}
	nfsCtrl := &fakeController{
		name: accessmode.BackendNFS,
		vols: []*backend.Volume{attached(accessmode.MultiNodeMultiWriter), available(accessmode.MultiNodeMultiWriter),
			{Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}, Attachments: []accessmode.Attachment{
				{Node: nodeid.MustParse("a@z"), Fenced: true}, {Node: nodeid.MustParse("b@z")}, {Node: nodeid.MustParse("c@z"), Fenced: true}}}},
		pools: []backend.PoolStats{{SizeBytes: 1000, FreeBytes: 900, CommittedBytes: 50}},
	}
	m.SetSources(Sources{
		Controllers: map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: block, accessmode.BackendNFS: nfsCtrl},
		Node:        "node-1", Zone: "zone-a",
		Holders: fakeHolders{
			{Staged: &backend.Staged{}, Holders: []accessmode.Holder{{TargetPath: "/a"}, {TargetPath: "/b"}}},
			{Staged: &backend.Staged{}},
		},
		FencedBlocks: func() int { return 3 },
	})
	expected := `
# HELP modeguard_node_staged_volumes Volumes staged on this node, from its lock files.
# TYPE modeguard_node_staged_volumes gauge
modeguard_node_staged_volumes{node="node-1",zone="zone-a"} 2
# HELP modeguard_node_volume_holders Workloads (target paths) holding volumes on this node, from its lock files.
# TYPE modeguard_node_volume_holders gauge
modeguard_node_volume_holders{node="node-1",zone="zone-a"} 2
# HELP modeguard_nfs_exports nfs-ganesha exports the controller serves: one per NFS volume.
# TYPE modeguard_nfs_exports gauge
modeguard_nfs_exports 3
# HELP modeguard_fenced_attachments Attachments whose node a network fence cuts off the storage: still attached for the CO, served nothing.
# TYPE modeguard_fenced_attachments gauge
modeguard_fenced_attachments{backend="block"} 0
modeguard_fenced_attachments{backend="nfs"} 2
# HELP modeguard_network_fences CIDR blocks fenced off the storage (csi-addons NetworkFence).
# TYPE modeguard_network_fences gauge
modeguard_network_fences 3
# HELP modeguard_pool_free_bytes Bytes still free on the filesystem a pool lives on.
# TYPE modeguard_pool_free_bytes gauge
modeguard_pool_free_bytes{backend="block",zone="zone-a"} 60
modeguard_pool_free_bytes{backend="nfs",zone=""} 900
`
	if err := testutil.GatherAndCompare(m.reg, strings.NewReader(expected),
		"modeguard_node_staged_volumes", "modeguard_node_volume_holders", "modeguard_nfs_exports", "modeguard_pool_free_bytes",
		"modeguard_fenced_attachments", "modeguard_network_fences"); err != nil {
		t.Error(err)
	}
	families, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	volumes := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "modeguard_volumes" {
			continue
		}
		for _, s := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range s.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			volumes[l["backend"]+"/"+l["access_mode"]+"/"+l["state"]] = s.GetGauge().GetValue()
		}
	}
	if len(volumes) != 2*len(accessmode.All)*2 {
		t.Errorf("%d volume series, want every backend, mode and state: %v", len(volumes), volumes)
	}
	for k, want := range map[string]float64{
		"block/SINGLE_NODE_SINGLE_WRITER/attached":  1,
		"block/SINGLE_NODE_SINGLE_WRITER/available": 2,
		"block/SINGLE_NODE_MULTI_WRITER/available":  1,
		"block/SINGLE_NODE_MULTI_WRITER/attached":   0,
		"nfs/MULTI_NODE_MULTI_WRITER/attached":      2,
		"nfs/MULTI_NODE_MULTI_WRITER/available":     1,
		"block/MULTI_NODE_READER_ONLY/available":    0,
	} {
		if got, ok := volumes[k]; !ok || got != want {
			t.Errorf("modeguard_volumes %s = %v (present %t), want %v", k, got, ok, want)
		}
	}

	// The state follows the backend, with no cache in between.
	block.vols = nil
	if err := testutil.GatherAndCompare(m.reg, strings.NewReader(`
# HELP modeguard_nfs_exports nfs-ganesha exports the controller serves: one per NFS volume.
# TYPE modeguard_nfs_exports gauge
modeguard_nfs_exports 3
`), "modeguard_nfs_exports"); err != nil {
		t.Error(err)
	}
	if got := testutil.ToFloat64(m.nfsControlErrors.WithLabelValues("Exports")); got != 0 {
		t.Errorf("nfs control errors before any = %v", got)
	}
}

// A backend that cannot be read fails its own metrics, and the scrape still
// serves the rest.
func TestUnreadableBackendDoesNotHideTheRest(t *testing.T) {
	m := New("test", []string{"controller"})
	m.SetSources(Sources{Controllers: map[accessmode.Backend]backend.Controller{
		accessmode.BackendBlock: &fakeController{name: accessmode.BackendBlock, listErr: errors.New("pool gone"),
			pools: []backend.PoolStats{{Zone: "zone-a", SizeBytes: 100, FreeBytes: 50}}},
	}})
	m.NFSControlFailed("ApplyExport")
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	for _, want := range []string{
		`modeguard_pool_size_bytes{backend="block",zone="zone-a"} 100`,
		`modeguard_nfs_control_errors_total{operation="ApplyExport"} 1`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
	if strings.Contains(string(body), "modeguard_volumes{") {
		t.Error("volumes reported although they could not be listed")
	}
}

func TestServerStartsAndShutsDown(t *testing.T) {
	m := New("test", []string{"controller"})
	s, err := m.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "go_goroutines") {
		t.Fatalf("status %d, body %.200s", resp.StatusCode, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get(s.URL()); err == nil {
		t.Error("metrics still served after Shutdown")
	}
}

// Package metrics defines modeguard's Prometheus metrics: CSI calls, the
// publishes the access-mode rules refused (the unsafe mounts prevented),
// volumes by mode and state, pool capacity, NFS exports and ganesha control
// errors, and the lock-file holders of a node.
//
// Every Metrics has a registry of its own rather than the global one, so one
// process (or test) may run several drivers. Counters are updated as calls
// happen; everything that describes state (volumes, pools, exports, holders)
// is read from the backends and lock files when Prometheus scrapes, so it
// can never drift from what the driver acts on.
package metrics

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/nodestate"
)

const namespace = "modeguard"

// Stages of a publish, the values of the stage label.
const (
	StageAttach  = "attach"  // ControllerPublishVolume: which nodes
	StageStage   = "stage"   // NodeStageVolume: within the mode attached to the node
	StagePublish = "publish" // NodePublishVolume: which workloads on a node
)

// Volume states, the values of the state label of modeguard_volumes.
const (
	StateAttached  = "attached"  // published to at least one node
	StateAvailable = "available" // published to none
)

// scrapeTimeout bounds what one scrape may spend reading the backends and
// lock files.
const scrapeTimeout = 10 * time.Second

// refusalsByStage lists the reasons each stage can give, so their series
// exist (at 0) before the first refusal and the first one is not lost to
// rate() and increase().
var refusalsByStage = map[string][]string{
	StageAttach: {
		accessmode.ReasonHeldByOtherNode, accessmode.ReasonWriterLimit, accessmode.ReasonPublishedWithOtherArguments,
		accessmode.ReasonOtherZone, accessmode.ReasonAttachLimit, accessmode.ReasonModeNotAllowed, accessmode.ReasonFenced,
	},
	StageStage: {accessmode.ReasonBeyondNodeMode},
	StagePublish: {
		accessmode.ReasonHeldByOtherWorkload, accessmode.ReasonOtherAccessMode, accessmode.ReasonPublishedWithOtherArguments,
		accessmode.ReasonBeyondNodeMode,
	},
}

// Metrics holds one driver's metrics and the registry that serves them.
type Metrics struct {
	reg              *prometheus.Registry
	requests         *prometheus.CounterVec
	durations        *prometheus.HistogramVec
	refused          *prometheus.CounterVec
	nfsControlErrors *prometheus.CounterVec
	nfsPauses        *prometheus.HistogramVec
	controllerActive prometheus.Gauge
	forwarded        *prometheus.CounterVec
	state            *stateCollector
}

// New makes the metrics and their registry, with modeguard_build_info for
// this binary (its version, Go version and roles). Nothing is served until
// Handler or Start is used; the scrape-time metrics appear once a driver
// hands its sources to SetSources.
func New(version string, roles []string) *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "csi_requests_total",
			Help: "CSI calls served, by method and gRPC status code.",
		}, []string{"method", "code"}),
		durations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "csi_request_duration_seconds",
			Help: "Time taken to serve CSI calls, by method and gRPC status code.",
			// From lookups (milliseconds) to mkfs, copies and mounts (minutes).
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300},
		}, []string{"method", "code"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "publish_refused_total",
			Help: "Publishes refused by the access-mode rules, i.e. unsafe mounts prevented: " +
				"stage attach (ControllerPublishVolume) or publish (NodePublishVolume), the requested mode, and the rule's reason.",
		}, []string{"stage", "mode", "reason"}),
		nfsControlErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "nfs_control_errors_total",
			Help: "Failures to tell nfs-ganesha over D-Bus, by operation (ApplyExport, RemoveExport, Exports).",
		}, []string{"operation"}),
		nfsPauses: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "nfs_pause_seconds",
			Help: "How long nfs-ganesha was held still (every NFS client's calls waiting) to copy a volume in use at one instant, " +
				"by outcome (copied, over_budget, failed).",
			// From a handful of files (milliseconds) to the budget's
			// largest allowed values (under the 20 s lease).
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20},
		}, []string{"outcome"}),
		controllerActive: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "controller_active",
			Help: "1 while this controller is the acting one (it holds every storage target's lease and serves Controller calls), 0 while it stands by.",
		}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "controller_forwarded_total",
			Help: "Controller calls this standby forwarded to the acting controller, by method and the gRPC status code answered.",
		}, []string{"method", "code"}),
		state: newStateCollector(),
	}
	buildInfo := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "build_info",
		Help:        "Always 1: the binary's version, the Go version it was built with, and the roles it serves.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version(), "roles": strings.Join(roles, ",")},
	})
	buildInfo.Set(1)
	m.reg.MustRegister(
		buildInfo,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.requests, m.durations, m.refused, m.nfsControlErrors, m.nfsPauses, m.controllerActive, m.forwarded, m.state,
	)
	return m
}

// Registry is the registry the metrics live in, for tests and for adding
// collectors.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in the Prometheus exposition formats. A
// backend that cannot be read during a scrape is logged and reported as a
// scrape error, and every other metric is still served.
func (m *Metrics) Handler() http.Handler {
	return promhttp.InstrumentMetricHandler(m.reg, promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		ErrorLog:      klogLogger{},
		ErrorHandling: promhttp.ContinueOnError,
		Registry:      m.reg,
	}))
}

type klogLogger struct{}

func (klogLogger) Println(v ...any) { klog.ErrorS(nil, "Serving metrics", "error", fmt.Sprint(v...)) }

// Sources are what the scrape-time metrics are read from. A process with
// the controller role sets Controllers; one with the node role sets Node,
// Zone and Holders.
type Sources struct {
	Controllers map[accessmode.Backend]backend.Controller
	// Node is the node's name (its --node-id), not its CSI node id: the
	// id carries the node's address, and a series named by it would end
	// and start anew whenever the address changes.
	Node, Zone string
	Holders    HolderLister
	// FencedBlocks counts the network fences in force (nil: the
	// controller keeps none).
	FencedBlocks func() int
}

// HolderLister reads a node's lock files (nodestate.Store).
type HolderLister interface {
	All() ([]*nodestate.Record, error)
}

// SetSources tells the metrics where to read volumes, pools and holders
// from. A driver calls it when it starts; a later call (a restarted driver
// in a test) replaces the sources.
func (m *Metrics) SetSources(s Sources) {
	m.state.set(s)
	if len(s.Controllers) > 0 {
		for _, r := range refusalsByStage[StageAttach] {
			for _, mode := range accessmode.All {
				m.refused.WithLabelValues(StageAttach, accessmode.Name(mode), r)
			}
		}
	}
	if _, ok := s.Controllers[accessmode.BackendNFS]; ok {
		for _, op := range []string{nfs.OpApplyExport, nfs.OpRemoveExport, nfs.OpExports} {
			m.nfsControlErrors.WithLabelValues(op)
		}
	}
	if s.Holders != nil {
		for _, stage := range []string{StageStage, StagePublish} {
			for _, r := range refusalsByStage[stage] {
				for _, mode := range accessmode.All {
					m.refused.WithLabelValues(stage, accessmode.Name(mode), r)
				}
			}
		}
	}
}

// PublishRefused counts one publish the access-mode rules refused. A nil
// Metrics counts nothing.
func (m *Metrics) PublishRefused(stage string, mode accessmode.Mode, reason string) {
	if m == nil {
		return
	}
	name := "Unknown"
	if accessmode.Valid(mode) {
		name = accessmode.Name(mode)
	}
	m.refused.WithLabelValues(stage, name, reason).Inc()
}

// NFSControlFailed counts one failed operation on ganesha; it fits
// nfs.Config.ControlFailed. A nil Metrics counts nothing.
func (m *Metrics) NFSControlFailed(operation string) {
	if m == nil {
		return
	}
	m.nfsControlErrors.WithLabelValues(operation).Inc()
}

// NFSPaused records one pause of ganesha for a copy of a volume in use;
// it fits nfs.Config.Paused. A nil Metrics records nothing.
func (m *Metrics) NFSPaused(took time.Duration, outcome string) {
	if m == nil {
		return
	}
	m.nfsPauses.WithLabelValues(outcome).Observe(took.Seconds())
}

// SetControllerActive records whether this controller acts. A nil
// Metrics records nothing.
func (m *Metrics) SetControllerActive(active bool) {
	if m == nil {
		return
	}
	v := 0.0
	if active {
		v = 1
	}
	m.controllerActive.Set(v)
}

// Forwarded counts one Controller call forwarded to the acting controller,
// by its full method name, with the code it was answered. A nil Metrics
// counts nothing.
func (m *Metrics) Forwarded(method string, code codes.Code) {
	if m == nil {
		return
	}
	m.forwarded.WithLabelValues(shortMethod(method), code.String()).Inc()
}

// ObserveRequest records one served CSI call.
func (m *Metrics) ObserveRequest(method string, code codes.Code, took time.Duration) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(method, code.String()).Inc()
	m.durations.WithLabelValues(method, code.String()).Observe(took.Seconds())
}

// UnaryServerInterceptor counts and times every CSI call by its short
// method name (ControllerPublishVolume) and status code. gRPC answers calls
// of unknown methods itself, so the method label has a bounded set of values.
func (m *Metrics) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		m.ObserveRequest(shortMethod(info.FullMethod), status.Code(err), time.Since(start))
		return resp, err
	}
}

// shortMethod turns /csi.v1.Controller/ControllerPublishVolume into
// ControllerPublishVolume.
func shortMethod(full string) string {
	return full[strings.LastIndex(full, "/")+1:]
}

// stateCollector reads state at scrape time.
type stateCollector struct {
	volumes, exports                  *prometheus.Desc
	poolSize, poolFree, poolCommitted *prometheus.Desc
	holders, staged                   *prometheus.Desc
	fencedAttachments, fences         *prometheus.Desc

	mu      sync.Mutex
	sources Sources
}

func newStateCollector() *stateCollector {
	name := func(n string) string { return prometheus.BuildFQName(namespace, "", n) }
	return &stateCollector{
		volumes: prometheus.NewDesc(name("volumes"),
			"Volumes by backend, access mode and state (attached: published to at least one node; available: to none). A volume created with several modes counts once per mode.",
			[]string{"backend", "access_mode", "state"}, nil),
		exports: prometheus.NewDesc(name("nfs_exports"),
			"nfs-ganesha exports the controller serves: one per NFS volume.", nil, nil),
		poolSize: prometheus.NewDesc(name("pool_size_bytes"),
			"Total size of the filesystem a pool lives on.", []string{"backend", "zone"}, nil),
		poolFree: prometheus.NewDesc(name("pool_free_bytes"),
			"Bytes still free on the filesystem a pool lives on.", []string{"backend", "zone"}, nil),
		poolCommitted: prometheus.NewDesc(name("pool_committed_bytes"),
			"Bytes a pool has promised: its volumes' capacities (NFS: and its snapshots' sizes).", []string{"backend", "zone"}, nil),
		holders: prometheus.NewDesc(name("node_volume_holders"),
			"Workloads (target paths) holding volumes on this node, from its lock files.", []string{"node", "zone"}, nil),
		staged: prometheus.NewDesc(name("node_staged_volumes"),
			"Volumes staged on this node, from its lock files.", []string{"node", "zone"}, nil),
		fencedAttachments: prometheus.NewDesc(name("fenced_attachments"),
			"Attachments whose node a network fence cuts off the storage: still attached for the CO, served nothing.", []string{"backend"}, nil),
		fences: prometheus.NewDesc(name("network_fences"),
			"CIDR blocks fenced off the storage (csi-addons NetworkFence).", nil, nil),
	}
}

func (c *stateCollector) set(s Sources) {
	c.mu.Lock()
	c.sources = s
	c.mu.Unlock()
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.volumes, c.exports, c.poolSize, c.poolFree, c.poolCommitted, c.holders, c.staged, c.fencedAttachments, c.fences} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	s := c.sources
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	for _, b := range slices.Sorted(maps.Keys(s.Controllers)) {
		c.collectBackend(ctx, ch, b, s.Controllers[b])
	}
	if s.Holders != nil {
		c.collectHolders(ch, s.Node, s.Zone, s.Holders)
	}
	if s.FencedBlocks != nil {
		ch <- prometheus.MustNewConstMetric(c.fences, prometheus.GaugeValue, float64(s.FencedBlocks()))
	}
}

func (c *stateCollector) collectBackend(ctx context.Context, ch chan<- prometheus.Metric, b accessmode.Backend, ctrl backend.Controller) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	vols, err := ctrl.ListVolumes(ctx)
	if err != nil {
		klog.ErrorS(err, "Metrics: listing volumes", "backend", b)
		ch <- prometheus.NewInvalidMetric(c.volumes, fmt.Errorf("listing %s volumes: %w", b, err))
	} else {
		type key struct {
			mode     accessmode.Mode
			attached bool
		}
		counts := map[key]int{}
		fenced := 0
		for _, v := range vols {
			for _, mode := range v.Modes {
				counts[key{mode, len(v.Attachments) > 0}]++
			}
			fenced += len(v.Attachments) - len(accessmode.Served(v.Attachments))
		}
		gauge(c.fencedAttachments, float64(fenced), string(b))
		// Every mode and state, zeros included, so a series never
		// vanishes when its last volume goes.
		for _, mode := range accessmode.All {
			gauge(c.volumes, float64(counts[key{mode, true}]), string(b), accessmode.Name(mode), StateAttached)
			gauge(c.volumes, float64(counts[key{mode, false}]), string(b), accessmode.Name(mode), StateAvailable)
		}
		if b == accessmode.BackendNFS {
			gauge(c.exports, float64(len(vols)))
		}
	}
	pools, err := ctrl.Pools(ctx)
	if err != nil {
		klog.ErrorS(err, "Metrics: reading pools", "backend", b)
		ch <- prometheus.NewInvalidMetric(c.poolSize, fmt.Errorf("reading %s pools: %w", b, err))
		return
	}
	for _, p := range pools {
		gauge(c.poolSize, float64(p.SizeBytes), string(b), p.Zone)
		gauge(c.poolFree, float64(p.FreeBytes), string(b), p.Zone)
		gauge(c.poolCommitted, float64(p.CommittedBytes), string(b), p.Zone)
	}
}

func (c *stateCollector) collectHolders(ch chan<- prometheus.Metric, node, zone string, store HolderLister) {
	records, err := store.All()
	if err != nil {
		klog.ErrorS(err, "Metrics: reading lock files")
		ch <- prometheus.NewInvalidMetric(c.holders, fmt.Errorf("reading lock files: %w", err))
		return
	}
	var holders, staged int
	for _, r := range records {
		holders += len(r.Holders)
		if r.Staged != nil {
			staged++
		}
	}
	ch <- prometheus.MustNewConstMetric(c.holders, prometheus.GaugeValue, float64(holders), node, zone)
	ch <- prometheus.MustNewConstMetric(c.staged, prometheus.GaugeValue, float64(staged), node, zone)
}

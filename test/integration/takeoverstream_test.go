package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// The stream of controller calls the take-over tests run while the acting
// controller fails, as a CO's sidecars would send them: each call to
// either controller's socket, retried with the same arguments until it has
// a final answer. The ledger keeps every call with its attempts and that
// answer, for the checker (takeovercheck_test.go) to hold against what the
// targets store.

// callKind is what a call of the stream does.
type callKind string

const (
	callCreate    callKind = "CreateVolume"
	callPublish   callKind = "ControllerPublishVolume"
	callUnpublish callKind = "ControllerUnpublishVolume"
	// callPublishHeld publishes a single-node volume to a second node
	// while another holds it: whoever acts must refuse it.
	callPublishHeld callKind = "ControllerPublishVolume to a second node"
	callSnapshot    callKind = "CreateSnapshot"
	callDelete      callKind = "DeleteVolume"
	callFence       callKind = "FenceClusterNetwork"
	callUnfence     callKind = "UnfenceClusterNetwork"
)

// attempt is one try of a call, sent to one controller.
type attempt struct {
	controller int // index into the stream's controllers
	start, end time.Time
	code       codes.Code
	message    string
}

// ledgerCall is one call of the stream: its arguments, its attempts and
// its final answer.
type ledgerCall struct {
	seq    int // order of the calls' first attempts
	worker int
	kind   callKind
	// name is the volume's (create) or the snapshot's (snapshot).
	name string
	zone string // create: the zone asked for; none for an NFS volume
	// volumeID is the volume the call acts on, or, for a create, the id
	// its answer gave.
	volumeID   string
	node       string // publish, unpublish: the node's key
	nodeID     string // ... and its whole id, as sent
	cidr       string // fence, unfence
	snapshotID string // snapshot: the id its answer gave
	attempts   []attempt
	start, end time.Time
	// answered says a final answer came; else the call was still being
	// retried when its time ran out (a stuck call).
	answered bool
	code     codes.Code // the final answer
	message  string
}

// acknowledged says the controllers answered the call OK: what it asked
// for is done, and must stay done until a later call undoes it.
func (c *ledgerCall) acknowledged() bool { return c.answered && c.code == codes.OK }

// refusedAsExpected says the call was one a controller must refuse, and
// was refused: it changed nothing.
func (c *ledgerCall) refusedAsExpected() bool {
	return c.answered && c.kind == callPublishHeld && c.code == codes.FailedPrecondition
}

func (c *ledgerCall) String() string {
	what := c.name
	switch {
	case c.cidr != "":
		what = c.cidr
	case c.kind == callSnapshot:
		what = c.name + " of " + c.volumeID
	case c.node != "":
		what = c.volumeID + " on " + c.node
	case c.volumeID != "" && c.kind != callCreate:
		what = c.volumeID
	}
	return fmt.Sprintf("call %d (%s %s, worker %d, %d attempts)", c.seq, c.kind, what, c.worker, len(c.attempts))
}

// retryable are the answers after which a CO sends the same call again:
// the controller could not act now (standby without an acting controller,
// a term that ended, a target not answering), or the attempt's deadline
// ran out. A connection that fails is UNAVAILABLE too.
func retryable(code codes.Code) bool {
	return code == codes.Unavailable || code == codes.Aborted || code == codes.DeadlineExceeded
}

const (
	// streamAttemptTimeout bounds one attempt, as a sidecar's --timeout
	// does: an attempt stuck at a frozen or cut-off controller is given up
	// and sent again, maybe to the other one.
	streamAttemptTimeout = 5 * time.Second
	// streamCallBudget is how long a call is retried before the ledger
	// records it as stuck: longer than any take-over may take.
	streamCallBudget  = 2 * time.Minute
	streamVolumeBytes = 16 << 20
	// streamFenceCIDR is the block the stream fences and lifts; no node of
	// the stream is in it, so fences change the list, never an attachment.
	streamFenceCIDR = "10.78.0.0/24"
	// streamLiveVolumes bounds each worker's volumes: it deletes rather
	// than creates beyond them, so the pools stay small.
	streamLiveVolumes = 4
)

// streamZones are the zones of the stream's block volumes, one target
// each. NFS volumes have no zone: one target serves them to every node.
var streamZones = []string{"zone-a", "zone-b"}

// streamNodeID is node n of zone: its key, zone and an address outside
// streamFenceCIDR. With an address, a fence in force decides that it does
// not cover the node; without one, a fence call could not tell and would
// fail, though it took effect.
func streamNodeID(zone string, n int) nodeid.Node {
	z := 1 + slices.Index(streamZones, zone)
	return nodeid.Node{Name: fmt.Sprintf("node-%d-%s", n, zone), Zone: zone, Address: fmt.Sprintf("10.77.%d.%d", z, n)}
}

// stream runs the workers and the fencer and keeps the ledger.
type stream struct {
	conns   []*grpc.ClientConn // the controllers' CSI sockets
	workers int                // the fencer is worker number workers
	nfs     bool               // NFS volumes too, besides each zone's block volumes
	stop    chan struct{}
	// given is closed when the test gave up: calls are not retried any
	// more.
	given    chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
	inFlight atomic.Int32 // calls begun and not yet finished

	mu     sync.Mutex
	seq    int
	ledger []*ledgerCall // finished calls
}

// startStream starts workers that act on volumes of their own (NFS ones
// too, with nfs) and a fencer that fences and lifts streamFenceCIDR, all
// sending each attempt to one of conns at random, until finish.
func startStream(t *testing.T, conns []*grpc.ClientConn, workers int, nfs bool) *stream {
	s := &stream{conns: conns, workers: workers, nfs: nfs, stop: make(chan struct{}), given: make(chan struct{})}
	seed := uint64(time.Now().UnixNano())
	t.Logf("stream seed %d", seed)
	for w := range workers {
		s.wg.Go(func() { s.work(w, rand.New(rand.NewPCG(seed, uint64(w)))) })
	}
	s.wg.Go(func() { s.fence(workers, rand.New(rand.NewPCG(seed, uint64(workers)))) })
	return s
}

// finish stops the stream once every call in flight has its final answer
// (or ran out of time), and answers the ledger in the order of the calls.
func (s *stream) finish() []*ledgerCall {
	s.stopOnce.Do(func() { close(s.stop) })
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := slices.Clone(s.ledger)
	slices.SortFunc(out, func(a, b *ledgerCall) int { return a.seq - b.seq })
	return out
}

// giveUp ends the stream at once, for a test that failed: calls in
// flight are left without their final answer.
func (s *stream) giveUp() {
	close(s.given)
	s.finish()
}

func (s *stream) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}

// acknowledgedSince counts, per worker (the fencer last), the calls
// acknowledged after since.
func (s *stream) acknowledgedSince(since time.Time) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	counts := make([]int, s.workers+1)
	for _, c := range s.ledger {
		if c.acknowledged() && c.end.After(since) {
			counts[c.worker]++
		}
	}
	return counts
}

// pause is the time between two calls of a worker: a CO's calls come at
// their own pace, and a stream as fast as the controllers go would only
// fill the pools.
func pause(rng *rand.Rand, least, most time.Duration) time.Duration {
	return least + time.Duration(rng.Int64N(int64(most-least)+1))
}

// do sends c until it has a final answer: each attempt to a controller
// chosen at random, under streamAttemptTimeout, and again after a retryable
// answer, for at most streamCallBudget.
func (s *stream) do(c *ledgerCall, rng *rand.Rand, try func(ctx context.Context, conn *grpc.ClientConn) error) {
	s.inFlight.Add(1)
	defer s.inFlight.Add(-1)
	s.mu.Lock()
	s.seq++
	c.seq = s.seq
	s.mu.Unlock()
	c.start = time.Now()
	for {
		i := rng.IntN(len(s.conns))
		a := attempt{controller: i, start: time.Now()}
		ctx, cancel := context.WithTimeout(context.Background(), streamAttemptTimeout)
		err := try(ctx, s.conns[i])
		cancel()
		a.end = time.Now()
		a.code, a.message = status.Code(err), status.Convert(err).Message()
		c.attempts = append(c.attempts, a)
		if !retryable(a.code) {
			c.answered, c.code, c.message = true, a.code, a.message
			break
		}
		if time.Since(c.start) > streamCallBudget {
			break
		}
		// A CO's retry backoff, shortened.
		select {
		case <-s.given:
		case <-time.After(pause(rng, 100*time.Millisecond, 300*time.Millisecond)):
			continue
		}
		break
	}
	c.end = time.Now()
	s.mu.Lock()
	s.ledger = append(s.ledger, c)
	s.mu.Unlock()
}

// streamVolume is a volume as the worker that owns it knows it from the
// answers it had.
type streamVolume struct {
	name, id, zone string      // zone: none for an NFS volume
	holder         nodeid.Node // the node it is published to (Name empty: none)
}

// capability is what every call asks of v: a raw block device of a block
// volume, a filesystem of an NFS one; single-node either way.
func (v *streamVolume) capability() *csi.VolumeCapability {
	if v.zone == "" {
		return nfsCapability(accessmode.SingleNodeWriter)
	}
	return capability(accessmode.SingleNodeWriter, "")
}

// work is one worker: it creates volumes named from its counter and acts
// only on its own, one call at a time, so each volume's calls have one
// order. A volume whose call ended without an acknowledgement (or the
// refusal expected) is left alone from then on: what it holds is not
// known, and the checker accepts either outcome of that call only.
func (s *stream) work(w int, rng *rand.Rand) {
	var vols []*streamVolume
	for n := 0; !s.stopping(); n++ {
		if len(vols) == 0 || (len(vols) < streamLiveVolumes && rng.IntN(4) == 0) {
			if v := s.create(w, n, rng); v != nil {
				vols = append(vols, v)
			}
		} else {
			i := rng.IntN(len(vols))
			if !s.act(w, n, vols[i], len(vols) >= streamLiveVolumes, rng) {
				vols = slices.Delete(vols, i, i+1)
			}
		}
		time.Sleep(pause(rng, 10*time.Millisecond, 60*time.Millisecond))
	}
}

func (s *stream) create(w, n int, rng *rand.Rand) *streamVolume {
	kinds := len(streamZones)
	if s.nfs {
		kinds++
	}
	v := &streamVolume{name: fmt.Sprintf("stream-w%d-%d", w, n)}
	req := &csi.CreateVolumeRequest{Name: v.name, CapacityRange: &csi.CapacityRange{RequiredBytes: streamVolumeBytes}}
	if k := rng.IntN(kinds); k < len(streamZones) {
		v.zone = streamZones[k]
		req.AccessibilityRequirements = &csi.TopologyRequirement{
			Requisite: []*csi.Topology{{Segments: map[string]string{driver.TopologyZoneKey: v.zone}}}}
	} else {
		req.Parameters = map[string]string{"backend": "nfs"}
	}
	req.VolumeCapabilities = []*csi.VolumeCapability{v.capability()}
	c := &ledgerCall{worker: w, kind: callCreate, name: v.name, zone: v.zone}
	s.do(c, rng, func(ctx context.Context, conn *grpc.ClientConn) error {
		resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, req)
		if err == nil {
			c.volumeID = resp.GetVolume().GetVolumeId()
		}
		return err
	})
	if !c.acknowledged() {
		return nil
	}
	v.id = c.volumeID
	return v
}

// act makes one call on v, chosen from what v's state allows, and says
// whether v is still to be acted on. full asks for a delete where one is
// allowed.
func (s *stream) act(w, n int, v *streamVolume, full bool, rng *rand.Rand) (keep bool) {
	c := &ledgerCall{worker: w, volumeID: v.id}
	var try func(ctx context.Context, conn *grpc.ClientConn) error
	publish := func(node nodeid.Node) func(ctx context.Context, conn *grpc.ClientConn) error {
		c.node, c.nodeID = node.Name, node.String()
		return func(ctx context.Context, conn *grpc.ClientConn) error {
			_, err := csi.NewControllerClient(conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
				VolumeId: v.id, NodeId: c.nodeID, VolumeCapability: v.capability()})
			return err
		}
	}
	// A block volume goes to nodes of its zone; an NFS volume to any.
	other := func(than string) nodeid.Node {
		for {
			zone := v.zone
			if zone == "" {
				zone = streamZones[rng.IntN(len(streamZones))]
			}
			if node := streamNodeID(zone, 1+rng.IntN(3)); node.Name != than {
				return node
			}
		}
	}
	r := rng.IntN(10)
	switch {
	case v.holder.Name != "" && r < 2:
		c.kind, try = callPublishHeld, publish(other(v.holder.Name))
	case v.holder.Name != "" && r < 3:
		// Again to its holder: the same answer, nothing changes.
		c.kind, try = callPublish, publish(v.holder)
	case v.holder.Name != "":
		c.kind, c.node, c.nodeID = callUnpublish, v.holder.Name, v.holder.String()
		try = func(ctx context.Context, conn *grpc.ClientConn) error {
			_, err := csi.NewControllerClient(conn).ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
				VolumeId: v.id, NodeId: c.nodeID})
			return err
		}
	case r >= 8 || (full && r >= 6):
		c.kind = callDelete
		try = func(ctx context.Context, conn *grpc.ClientConn) error {
			_, err := csi.NewControllerClient(conn).DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id})
			return err
		}
	case r == 5:
		// Of a volume no node holds: a pool without reflinks copies no
		// image in use.
		c.kind, c.name = callSnapshot, fmt.Sprintf("snap-w%d-%d", w, n)
		try = func(ctx context.Context, conn *grpc.ClientConn) error {
			resp, err := csi.NewControllerClient(conn).CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: v.id, Name: c.name})
			if err == nil && !resp.GetSnapshot().GetReadyToUse() {
				// The snapshotter asks again until it is.
				return status.Error(codes.Unavailable, "answered ready_to_use=false")
			}
			c.snapshotID = resp.GetSnapshot().GetSnapshotId()
			return err
		}
	default:
		c.kind, try = callPublish, publish(other(""))
	}
	s.do(c, rng, try)
	switch {
	case c.refusedAsExpected():
		return true
	case !c.acknowledged():
		return false
	case c.kind == callPublish:
		v.holder, _ = nodeid.Parse(c.nodeID)
	case c.kind == callUnpublish:
		v.holder = nodeid.Node{}
	case c.kind == callDelete:
		return false
	case c.kind == callPublishHeld:
		// Granted against the rules: the checker reports it; the volume's
		// state is beyond what this worker models.
		return false
	}
	return true
}

// fence fences and lifts streamFenceCIDR in turn. A call without an
// acknowledgement is sent again as a new call, until one is acknowledged:
// the list then is known again.
func (s *stream) fence(w int, rng *rand.Rand) {
	fenced := false
	for !s.stopping() {
		c := &ledgerCall{worker: w, kind: callFence, cidr: streamFenceCIDR}
		cidrs := []*fence.CIDR{{Cidr: streamFenceCIDR}}
		try := func(ctx context.Context, conn *grpc.ClientConn) error {
			_, err := fence.NewFenceControllerClient(conn).FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Cidrs: cidrs})
			return err
		}
		if fenced {
			c.kind = callUnfence
			try = func(ctx context.Context, conn *grpc.ClientConn) error {
				_, err := fence.NewFenceControllerClient(conn).UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Cidrs: cidrs})
				return err
			}
		}
		s.do(c, rng, try)
		if c.acknowledged() {
			fenced = !fenced
		}
		time.Sleep(pause(rng, 200*time.Millisecond, 600*time.Millisecond))
	}
}

// prober calls ListVolumes through one controller every 100 ms, each call
// under a deadline of a second (started on time even while earlier ones
// hang), and keeps when each call started and whether it succeeded.
type prober struct {
	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
	inFlight atomic.Int32 // calls begun and not yet finished

	mu     sync.Mutex
	probes []probe
}

type probe struct {
	start time.Time
	ok    bool
}

func startProber(conn *grpc.ClientConn) *prober {
	p := &prober{stop: make(chan struct{})}
	p.wg.Go(func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			p.wg.Go(func() {
				start := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, err := csi.NewControllerClient(conn).ListVolumes(ctx, &csi.ListVolumesRequest{})
				cancel()
				p.mu.Lock()
				p.probes = append(p.probes, probe{start: start, ok: err == nil})
				p.mu.Unlock()
			})
			select {
			case <-p.stop:
				return
			case <-tick.C:
			}
		}
	})
	return p
}

func (p *prober) finish() {
	p.stopOnce.Do(func() { close(p.stop) })
	p.wg.Wait()
}

// firstSuccessAfter answers how long after from the first probe sent at
// or after from succeeded, or false while none has.
func (p *prober) firstSuccessAfter(from time.Time) (time.Duration, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	first, found := time.Time{}, false
	for _, pr := range p.probes {
		if pr.ok && !pr.start.Before(from) && (!found || pr.start.Before(first)) {
			first, found = pr.start, true
		}
	}
	return first.Sub(from), found
}

// failedBefore counts the probes sent from from on that failed before the
// first success.
func (p *prober) failedBefore(from time.Time, took time.Duration) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, pr := range p.probes {
		if !pr.ok && !pr.start.Before(from) && pr.start.Before(from.Add(took)) {
			n++
		}
	}
	return n
}

package driver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/netfence"
)

// An elected controller (Config.Elected) acts only during a term: from
// StartTerm, when it took the storage targets' leases, until EndTerm, when
// it lost one or stepped down. Controller calls are served only during a
// term and run under the term's context, so that ending the term cancels
// them; EndTerm returns once they have returned, and only then are the
// leases given back, so no call of this controller runs next to one of its
// successor.

// ErrTermEndedWhileStarting is StartTerm's answer when EndTerm came first:
// the term never began, and there is nothing to step down from.
var ErrTermEndedWhileStarting = errors.New("this controller stepped down while its term was starting")

// term is one term of an elected controller.
type term struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	calls  sync.WaitGroup
}

// termEndWait bounds how long EndTerm waits for the calls of the term.
const termEndWait = 30 * time.Second

// errTermEnded is the cause a term's calls are cancelled with.
type errTermEnded struct{ why string }

func (e errTermEnded) Error() string { return "this controller stopped acting: " + e.why }

// StartTerm begins a term of an elected controller: the network fence list
// is read (again: a controller that acted before on this host may have
// changed it) and followed by every volume, and only then are Controller
// calls served. An error leaves the controller standby; the caller steps
// down.
func (d *Driver) StartTerm(ctx context.Context) error {
	if !d.cfg.Elected {
		return fmt.Errorf("terms are for an elected controller")
	}
	if !d.controllersReady.Load() {
		return fmt.Errorf("the controller's backends are not set")
	}
	d.termMu.Lock()
	gen := d.termGen
	d.termMu.Unlock()
	t := &term{}
	t.ctx, t.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	if err := d.openFences(t.ctx, d.cfg.Controllers); err != nil {
		t.cancel(err)
		return fmt.Errorf("starting a term: %w", err)
	}
	d.followFencesAtStart()
	d.termMu.Lock()
	if d.termGen != gen {
		// Stepped down while the term was starting.
		d.termMu.Unlock()
		t.cancel(nil)
		return ErrTermEndedWhileStarting
	}
	d.term = t
	d.standbyReady = true
	d.termMu.Unlock()
	go d.keepFencesFollowed(t.ctx)
	d.setMetricSources()
	d.cfg.Metrics.SetControllerActive(true)
	klog.InfoS("Acting controller: serving Controller calls")
	return nil
}

// EndTerm ends the term, if one runs: no Controller call is taken any
// more, those running are cancelled, and EndTerm waits for them to return
// (termEndWait at most: it answers false when some did not, and the caller
// must then not let another controller act until this process exits).
func (d *Driver) EndTerm(why string) bool {
	d.termMu.Lock()
	t := d.term
	d.term = nil
	d.termGen++
	d.termMu.Unlock()
	d.WaitingFor("this controller is standby: " + why)
	d.cfg.Metrics.SetControllerActive(false)
	d.setMetricSources()
	if t == nil {
		return true
	}
	t.cancel(errTermEnded{why})
	done := make(chan struct{})
	go func() { t.calls.Wait(); close(done) }()
	select {
	case <-done:
		klog.InfoS("Stopped acting: the term's calls have returned", "why", why)
		return true
	case <-time.After(termEndWait):
		klog.ErrorS(nil, "Calls of the ended term did not return in time", "why", why, "waited", termEndWait)
		return false
	}
}

// FollowFencesAgain reads the network fence list again (bringing the
// places that were behind up to date) and makes every volume follow it: a
// storage target that was away during a fence, and is acted on again, may
// still serve a node the fence covers. It runs as a call of the term, and
// does nothing outside one.
func (d *Driver) FollowFencesAgain(why string) {
	ctx, leave, err := d.enterTerm(context.Background())
	if err != nil {
		return
	}
	defer leave()
	if d.fences == nil {
		return
	}
	d.fenceGate.Lock()
	err = d.fences.Reload(ctx)
	d.fenceGate.Unlock()
	if errors.Is(err, netfence.ErrPartlyStored) {
		d.fencesBehind.Store(true)
		klog.InfoS("The network fence list is not yet everywhere it is kept", "why", why, "err", err)
	} else if err != nil {
		d.fencesBehind.Store(true)
		klog.ErrorS(err, "Reading the network fence list again", "why", why)
		return
	}
	undecided, err := d.applyFences(ctx)
	if err != nil {
		klog.ErrorS(err, "Not every volume follows the network fence list yet; the next fence call, or a publish or unpublish of the volume, tries again", "why", why)
	}
	if len(undecided) > 0 {
		klog.InfoS("Network fences are in force and nodes that hold volumes report no address", "nodes", undecided)
	}
	klog.InfoS("Volumes follow the network fence list again", "why", why)
}

// followFencesEvery is how often an acting controller tries again to
// store the fence list where it is behind and to make every volume follow
// it, while something is left to do.
const followFencesEvery = 5 * time.Second

// keepFencesFollowed tries again, during the term, what a fence change or
// the term's start could not finish: a storage target that missed the
// list (it was down, or did not answer in time) gets it, and its volumes
// follow it, as soon as it answers.
func (d *Driver) keepFencesFollowed(term context.Context) {
	t := time.NewTicker(followFencesEvery)
	defer t.Stop()
	for {
		select {
		case <-term.Done():
			return
		case <-t.C:
		}
		if d.fencesBehind.Swap(false) {
			d.FollowFencesAgain("the network fence list or its application was left unfinished")
		}
	}
}

// SetFenceStore sets where the controller keeps its network fences (in
// place of Config.FenceFile), before its backends are set.
func (d *Driver) SetFenceStore(s netfence.Store) { d.cfg.FenceStore = s }

// StandBy says what a standby controller waits for; ready says whether it
// knows another controller acts, so that Probe may answer ready (its
// sidecars then wait in their own elections rather than for this process).
func (d *Driver) StandBy(why string, ready bool) {
	d.WaitingFor(why)
	if ready {
		d.termMu.Lock()
		d.standbyReady = true
		d.termMu.Unlock()
	}
}

// enterTerm admits a Controller call of an elected controller into the
// running term: the call's context ends with the term, and leave is called
// when the call returns.
func (d *Driver) enterTerm(ctx context.Context) (context.Context, func(), error) {
	d.termMu.Lock()
	t := d.term
	if t != nil {
		t.calls.Add(1)
	}
	d.termMu.Unlock()
	if t == nil {
		why := "the controller is starting"
		if w := d.waitingFor.Load(); w != nil {
			why = *w
		}
		return nil, nil, status.Errorf(codes.Unavailable, "not serving controller calls: %s", why)
	}
	cctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(t.ctx, func() { cancel(context.Cause(t.ctx)) })
	return cctx, func() {
		stop()
		cancel(nil)
		t.calls.Done()
	}, nil
}

// localControllerCall reports whether method is answered whatever the
// controller's state: what it can do is static, and sidecars ask it before
// they elect their leader.
func localControllerCall(method string) bool {
	return strings.HasSuffix(method, "/ControllerGetCapabilities") || strings.HasSuffix(method, "/GroupControllerGetCapabilities")
}

// Package election makes one controller of several the acting one, on the
// leases of the storage targets it acts on.
//
// The targets are what must refuse a former controller anyway, so the
// election and the fence are one mechanism and cannot disagree: a
// controller acts on a target only while it holds the target's lease, and
// it counts each lease's term on its own clock from when it sent the
// renewal, so that its term always ends before the target's, which counts
// from receipt.
//
// A controller is standby or active. Standby, it reads every target's lease
// once a second and, when no readable target shows a live holder other
// than itself, takes the readable ones in order from the epochs it read,
// all or none: a lease it could not take gives back those it took, and it
// tries again after a random pause, so two standbys do not keep colliding.
// Active, it renews every lease every RenewEvery. A target that stops
// answering is dropped once its term (as this controller counts it) has
// run out: the controller stops acting on it and goes on with the others,
// and takes it again when it answers. A renewal answered "lease lost", or a
// target found held by another controller, ends the term on every target:
// one controller never acts on one target while another acts on a second,
// since rules that span zones (a node's attach limit, a volume name unique
// across zones) are kept in the acting controller's memory.
package election

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

// Lease is what a target answers about its lease.
type Lease struct {
	// Holder is empty while no one holds the lease (free, or run out).
	Holder string
	Epoch  uint64
	// ExpiresIn is how long the holder's term lasts without a renewal.
	ExpiresIn time.Duration
	// Peer is where the holder takes the calls other controllers forward
	// to it (empty: it takes none).
	Peer string
}

// Target is one storage target's lease, as a controller sees it.
type Target interface {
	// Name says which target, in logs and errors.
	Name() string
	// ReadLease reads the lease.
	ReadLease(ctx context.Context) (Lease, error)
	// Acquire takes the lease if it is still at epoch (as just read) and
	// no one else holds it, and answers the epoch of the new term.
	Acquire(ctx context.Context, epoch uint64) (uint64, error)
	// Renew extends the term of epoch; ErrLost (wrapped) when that term is
	// no longer the live one.
	Renew(ctx context.Context, epoch uint64) error
	// Release gives the lease of epoch back.
	Release(ctx context.Context, epoch uint64) error
}

// ErrLost is a renewal refused because the controller's term is over.
var ErrLost = errors.New("lease lost")

// Timings of the election. The zero value of a field takes its default.
type Timings struct {
	// Term is the targets' lease term (15 s).
	Term time.Duration
	// Margin is taken off every term as this controller counts it, for the
	// difference between the rates of two clocks and the time a renewal
	// takes to arrive (3 s).
	Margin time.Duration
	// RenewEvery is how often an active controller renews (5 s).
	RenewEvery time.Duration
	// PollEvery is how often a standby reads the leases, and an active
	// controller tries a target it dropped (1 s).
	PollEvery time.Duration
}

func (t Timings) withDefaults() Timings {
	if t.Term == 0 {
		t.Term = 15 * time.Second
	}
	if t.Margin == 0 {
		t.Margin = 3 * time.Second
	}
	if t.RenewEvery == 0 {
		t.RenewEvery = 5 * time.Second
	}
	if t.PollEvery == 0 {
		t.PollEvery = time.Second
	}
	return t
}

// Config is an election.
type Config struct {
	// Holder names this controller on the leases.
	Holder string
	// Targets are taken in this order, every time.
	Targets []Target
	Timings Timings
	// Clock is the real clock when nil.
	Clock clock.PassiveClock
	// Active is called when this controller becomes the acting one, with
	// every target it holds; Standby when it stops acting, with why. Both
	// are called from the election's goroutine, in turn: Standby returns
	// only once nothing acts any more (calls in flight ended), before the
	// leases are given back.
	Active  func()
	Standby func(why string)
	// Retaken is called when an acting controller takes again a target
	// it had stopped acting on (it did not answer in time): that target
	// may have missed what was done meanwhile.
	Retaken func(target string)
	// Waiting is told what a standby waits for, each time that changes.
	Waiting func(why string)
}

// held is one target's lease as this controller holds it.
type held struct {
	epoch uint64
	// validUntil is when this controller stops acting on the target
	// unless a renewal got through: the send time of the last one that
	// did, plus the term, less the margin.
	validUntil time.Time
	// renewDue is when the next renewal is sent.
	renewDue time.Time
}

// Elector runs an election for one controller.
type Elector struct {
	cfg   Config
	t     Timings
	clock clock.PassiveClock

	mu     sync.Mutex
	active bool
	// holding has the targets whose lease this controller holds and
	// still counts valid, by name; a target of an active controller that
	// is missing from it is tried again at every poll.
	holding map[string]held
	// nextPoll is when a standby next reads the leases, or an active one
	// tries its dropped targets.
	nextPoll time.Time
	waiting  string
	// otherActs is whether a standby's last poll found another
	// controller holding a lease, and actingPeer where that controller
	// takes forwarded calls (from the lease of the highest epoch).
	otherActs  bool
	actingPeer string
}

// New prepares an election; Run or Tick drive it.
func New(cfg Config) (*Elector, error) {
	if cfg.Holder == "" {
		return nil, fmt.Errorf("an election needs this controller's holder name")
	}
	if len(cfg.Targets) == 0 {
		return nil, fmt.Errorf("an election needs at least one storage target")
	}
	names := map[string]bool{}
	for _, t := range cfg.Targets {
		if names[t.Name()] {
			return nil, fmt.Errorf("storage target %s is named twice", t.Name())
		}
		names[t.Name()] = true
	}
	e := &Elector{cfg: cfg, t: cfg.Timings.withDefaults(), clock: cfg.Clock, holding: map[string]held{}}
	if e.clock == nil {
		e.clock = clock.RealClock{}
	}
	for _, f := range []*func(string){&e.cfg.Standby, &e.cfg.Waiting} {
		if *f == nil {
			*f = func(string) {}
		}
	}
	if e.cfg.Active == nil {
		e.cfg.Active = func() {}
	}
	if e.cfg.Retaken == nil {
		e.cfg.Retaken = func(string) {}
	}
	return e, nil
}

// Epoch answers the epoch this controller holds target's lease at, if it
// is active and still counts that lease valid: a call to the target is
// sent only then, under that epoch.
func (e *Elector) Epoch(target string) (uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.active {
		why := e.waiting
		if why == "" {
			why = "it has not taken the storage targets' leases yet"
		}
		return 0, fmt.Errorf("this controller is not the acting one: %s", why)
	}
	h, ok := e.holding[target]
	if !ok {
		return 0, fmt.Errorf("this controller does not hold the lease of storage target %s: it stopped answering, and is taken again when it answers", target)
	}
	if !e.clock.Now().Before(h.validUntil) {
		return 0, fmt.Errorf("this controller's lease of storage target %s ran out before a renewal got through", target)
	}
	return h.epoch, nil
}

// IsActive reports whether this controller is the acting one.
func (e *Elector) IsActive() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.active
}

// OtherActs reports whether this standby's last poll found another
// controller acting: it then knows it has nothing to do.
func (e *Elector) OtherActs() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return !e.active && e.otherActs
}

// ActingPeer answers where the acting controller takes forwarded calls, as
// this standby's last poll of the leases found it, or why it knows none.
func (e *Elector) ActingPeer() (string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case e.active:
		return "", fmt.Errorf("this controller is the acting one")
	case !e.otherActs:
		why := e.waiting
		if why == "" {
			why = "it has not read the storage targets' leases yet"
		}
		return "", fmt.Errorf("no other controller is known to act: %s", why)
	case e.actingPeer == "":
		return "", fmt.Errorf("the acting controller takes no forwarded calls (it was started without --controller-peer-listen)")
	}
	return e.actingPeer, nil
}

// actingPeer is the peer of the live lease of the highest epoch among
// those read: when two controllers show as holders (one whose lease is
// about to run out), the later term's.
func actingPeer(targets []Target, leases []readResult) string {
	var peer string
	var best uint64
	for i := range targets {
		l := leases[i].lease
		if leases[i].err == nil && l.Holder != "" && l.ExpiresIn > 0 && l.Epoch >= best {
			peer, best = l.Peer, l.Epoch
		}
	}
	return peer
}

// tick is how often Run lets Tick look at what is due: well under every
// period of the election.
const tick = 100 * time.Millisecond

// Run drives the election until ctx ends; then an active controller steps
// down and gives its leases back.
func (e *Elector) Run(ctx context.Context) {
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		e.Tick(ctx)
		select {
		case <-ctx.Done():
			e.StepDown("this controller is stopping")
			return
		case <-t.C:
		}
	}
}

// Tick does what is due now: a standby's poll, an active controller's
// renewals, drops and retakes.
func (e *Elector) Tick(ctx context.Context) {
	now := e.clock.Now()
	if !e.IsActive() {
		if now.Before(e.nextPollTime()) {
			return
		}
		e.tryToAct(ctx)
		return
	}
	e.renewDue(ctx, now)
	e.dropRunOut()
	e.mu.Lock()
	pollDue := !now.Before(e.nextPoll) && len(e.holding) < len(e.cfg.Targets)
	if pollDue {
		e.nextPoll = now.Add(e.t.PollEvery)
	}
	e.mu.Unlock()
	if pollDue {
		e.retakeDropped(ctx)
	}
}

func (e *Elector) nextPollTime() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.nextPoll
}

func (e *Elector) setWaiting(why string) {
	e.mu.Lock()
	changed := e.waiting != why
	e.waiting = why
	e.mu.Unlock()
	if changed && why != "" {
		e.cfg.Waiting(why)
	}
}

// callTimeout bounds one call to a target: a target that takes
// connections and does not answer must not hold the others up.
func (e *Elector) callTimeout() time.Duration { return e.t.RenewEvery }

// tryToAct is a standby's poll: read every lease, and take them all when
// no one else holds any.
func (e *Elector) tryToAct(ctx context.Context) {
	now := e.clock.Now()
	e.mu.Lock()
	e.nextPoll = now.Add(e.t.PollEvery)
	e.mu.Unlock()
	leases := e.readLeases(ctx)
	e.mu.Lock()
	e.otherActs, e.actingPeer = false, ""
	e.mu.Unlock()
	var readable []Target
	var unreadable []string
	for i, t := range e.cfg.Targets {
		r := leases[i]
		if r.err != nil {
			unreadable = append(unreadable, fmt.Sprintf("%s: %v", t.Name(), r.err))
			continue
		}
		if r.lease.Holder != "" && r.lease.Holder != e.cfg.Holder && r.lease.ExpiresIn > 0 {
			e.mu.Lock()
			e.otherActs, e.actingPeer = true, actingPeer(e.cfg.Targets, leases)
			e.mu.Unlock()
			e.setWaiting(fmt.Sprintf("another controller holds storage target %s: %s (epoch %d)", t.Name(), r.lease.Holder, r.lease.Epoch))
			return
		}
		readable = append(readable, t)
	}
	if len(readable) == 0 {
		e.setWaiting(fmt.Sprintf("no storage target answers: %v", unreadable))
		return
	}
	taken := map[string]held{}
	for i, t := range e.cfg.Targets {
		r := leases[i]
		if r.err != nil {
			continue
		}
		sent := e.clock.Now()
		epoch, err := e.take(ctx, t, r.lease)
		if err != nil {
			e.giveBack(ctx, taken)
			pause := e.t.PollEvery/2 + rand.N(e.t.PollEvery)
			e.mu.Lock()
			e.nextPoll = e.clock.Now().Add(pause)
			e.mu.Unlock()
			e.setWaiting(fmt.Sprintf("storage target %s: %v", t.Name(), err))
			return
		}
		taken[t.Name()] = held{epoch: epoch, validUntil: sent.Add(e.t.Term - e.t.Margin), renewDue: sent.Add(e.t.RenewEvery)}
	}
	e.mu.Lock()
	e.active, e.holding, e.waiting = true, taken, ""
	e.nextPoll = e.clock.Now().Add(e.t.PollEvery)
	e.mu.Unlock()
	klog.InfoS("Acting controller: took the storage targets' leases", "holder", e.cfg.Holder, "targets", len(taken), "unanswered", unreadable)
	e.cfg.Active()
}

type readResult struct {
	lease Lease
	err   error
}

// readLeases reads every target's lease at once, each call bounded.
func (e *Elector) readLeases(ctx context.Context) []readResult {
	out := make([]readResult, len(e.cfg.Targets))
	var wg sync.WaitGroup
	for i, t := range e.cfg.Targets {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, e.callTimeout())
			defer cancel()
			out[i].lease, out[i].err = t.ReadLease(cctx)
		})
	}
	wg.Wait()
	return out
}

// giveBack releases the leases in taken.
func (e *Elector) giveBack(ctx context.Context, taken map[string]held) {
	ctx = context.WithoutCancel(ctx)
	for _, t := range e.cfg.Targets {
		h, ok := taken[t.Name()]
		if !ok {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, e.callTimeout())
		if err := t.Release(cctx, h.epoch); err != nil {
			klog.InfoS("Could not give a storage target's lease back; it runs out on its own", "target", t.Name(), "epoch", h.epoch, "err", err)
		}
		cancel()
	}
}

// renewDue renews, at once, every held lease whose renewal is due.
func (e *Elector) renewDue(ctx context.Context, now time.Time) {
	e.mu.Lock()
	var due []Target
	for _, t := range e.cfg.Targets {
		if h, ok := e.holding[t.Name()]; ok && !now.Before(h.renewDue) {
			h.renewDue = now.Add(e.t.RenewEvery)
			e.holding[t.Name()] = h
			due = append(due, t)
		}
	}
	e.mu.Unlock()
	if len(due) == 0 {
		return
	}
	var lost error
	var lostMu sync.Mutex
	var wg sync.WaitGroup
	for _, t := range due {
		wg.Go(func() {
			if err := e.renew(ctx, t); errors.Is(err, ErrLost) {
				lostMu.Lock()
				lost = fmt.Errorf("storage target %s: %w", t.Name(), err)
				lostMu.Unlock()
			}
		})
	}
	wg.Wait()
	if lost != nil {
		e.StepDown(lost.Error())
	}
}

// renew renews one held lease; a renewal that got through moves its
// validity on from when it was sent.
func (e *Elector) renew(ctx context.Context, t Target) error {
	e.mu.Lock()
	h, ok := e.holding[t.Name()]
	e.mu.Unlock()
	if !ok {
		return nil
	}
	sent := e.clock.Now()
	cctx, cancel := context.WithTimeout(ctx, e.callTimeout())
	err := t.Renew(cctx, h.epoch)
	cancel()
	if err != nil {
		if !errors.Is(err, ErrLost) {
			klog.InfoS("Could not renew a storage target's lease; trying again", "target", t.Name(), "epoch", h.epoch, "err", err)
		}
		return err
	}
	e.mu.Lock()
	if cur, ok := e.holding[t.Name()]; ok && cur.epoch == h.epoch {
		cur.validUntil = sent.Add(e.t.Term - e.t.Margin)
		e.holding[t.Name()] = cur
	}
	e.mu.Unlock()
	return nil
}

// dropRunOut stops acting on every target whose term ran out before a
// renewal got through.
func (e *Elector) dropRunOut() {
	now := e.clock.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	for name, h := range e.holding {
		if !now.Before(h.validUntil) {
			delete(e.holding, name)
			klog.InfoS("Stopped acting on a storage target: no renewal of its lease got through in its term; acting on the others, and taking it again when it answers",
				"target", name, "epoch", h.epoch)
		}
	}
}

// retakeDropped tries every target an active controller does not hold:
// renewing a lease still its own, taking a free one; a target another
// controller holds ends this controller's term. Each call may take up to
// callTimeout, so the renewals due are sent before each one: targets that
// do not answer must not hold up the renewals of those that do.
func (e *Elector) retakeDropped(ctx context.Context) {
	for _, t := range e.cfg.Targets {
		if !e.renewAndWantBack(ctx, t) {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, e.callTimeout())
		sent := e.clock.Now()
		l, err := t.ReadLease(cctx)
		cancel()
		if err != nil {
			continue
		}
		if l.Holder != "" && l.Holder != e.cfg.Holder && l.ExpiresIn > 0 {
			e.StepDown(fmt.Sprintf("storage target %s is held by another controller: %s (epoch %d)", t.Name(), l.Holder, l.Epoch))
			return
		}
		if !e.renewAndWantBack(ctx, t) {
			continue
		}
		epoch, err := e.take(ctx, t, l)
		if err != nil {
			klog.InfoS("Could not take a storage target's lease again", "target", t.Name(), "err", err)
			continue
		}
		e.mu.Lock()
		still := e.active
		if still {
			e.holding[t.Name()] = held{epoch: epoch, validUntil: sent.Add(e.t.Term - e.t.Margin), renewDue: sent.Add(e.t.RenewEvery)}
		}
		e.mu.Unlock()
		if still {
			klog.InfoS("Acting on a storage target again", "target", t.Name(), "epoch", epoch)
			e.cfg.Retaken(t.Name())
		}
	}
}

// renewAndWantBack sends the renewals due, then answers whether t is still
// to be taken again: this controller acts and does not hold it.
func (e *Elector) renewAndWantBack(ctx context.Context, t Target) bool {
	e.renewDue(ctx, e.clock.Now())
	e.mu.Lock()
	defer e.mu.Unlock()
	_, holds := e.holding[t.Name()]
	return e.active && !holds
}

// take takes a target's lease from what was just read of it: a lease
// still this controller's is renewed (asking for it again would not extend
// the term, which then could end before this controller counts it ended),
// any other is acquired from the epoch read.
func (e *Elector) take(ctx context.Context, t Target, l Lease) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, e.callTimeout())
	defer cancel()
	if l.Holder == e.cfg.Holder && l.ExpiresIn > 0 {
		return l.Epoch, t.Renew(ctx, l.Epoch)
	}
	return t.Acquire(ctx, l.Epoch)
}

// StepDown ends this controller's term, if it acts: nothing is sent to a
// target any more, Standby ends what acts, and the leases it still holds
// are given back. It may be called from any goroutine (a term that could
// not start steps down). It then polls as a standby after a pause, so that
// another controller can take over.
func (e *Elector) StepDown(why string) {
	e.mu.Lock()
	if !e.active {
		e.mu.Unlock()
		return
	}
	e.active = false
	taken := e.holding
	e.holding = map[string]held{}
	e.waiting = "it stepped down: " + why
	e.mu.Unlock()
	klog.InfoS("Stepping down as the acting controller", "why", why)
	e.cfg.Standby(why)
	e.giveBack(context.Background(), taken)
	pause := e.t.PollEvery/2 + rand.N(e.t.PollEvery)
	e.mu.Lock()
	e.nextPoll = e.clock.Now().Add(pause)
	e.mu.Unlock()
}

package election_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/modeguard/modeguard/pkg/election"
)

// The elector runs on its documented default timings (zero Timings); these
// are the same numbers, for working out when things are due.
const (
	term       = 15 * time.Second
	margin     = 3 * time.Second
	renewEvery = 5 * time.Second
	// validity is how long a controller counts a lease valid after it sent
	// the renewal that got through.
	validity = term - margin
)

var start = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

// world is the storage targets' leases on a clock that the targets and the
// controllers share, so that a test moves time for all of them at once.
type world struct {
	clock *testingclock.FakeClock

	mu     sync.Mutex
	leases map[string]*lease
}

// lease is a target's lease as the target keeps it.
type lease struct {
	holder  string
	epoch   uint64
	expires time.Time
}

func newWorld(targets ...string) *world {
	w := &world{clock: testingclock.NewFakeClock(start), leases: map[string]*lease{}}
	for _, name := range targets {
		w.leases[name] = &lease{}
	}
	return w
}

func (w *world) liveLocked(l *lease) bool {
	return l.holder != "" && w.clock.Now().Before(l.expires)
}

// lease answers a copy of target's lease, for a test to look at.
func (w *world) lease(target string) lease {
	w.mu.Lock()
	defer w.mu.Unlock()
	return *w.leases[target]
}

// holds reports whether holder holds target's lease live at epoch.
func (w *world) holds(target, holder string, epoch uint64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	l := w.leases[target]
	return w.liveLocked(l) && l.holder == holder && l.epoch == epoch
}

func (w *world) free(target string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return !w.liveLocked(w.leases[target])
}

func (w *world) setLease(target string, l lease) {
	w.mu.Lock()
	defer w.mu.Unlock()
	*w.leases[target] = l
}

// view is one controller's connection to one target. Target's methods carry
// no holder: the real target knows the caller from its connection, the fake
// from the view.
type view struct {
	w      *world
	target string
	holder string

	// Guarded by w.mu.
	unreachable bool
	calls       map[string]int
	// renewTakes is how long a renewal is under way before the target
	// handles it; the clock moves on by that much.
	renewTakes time.Duration
	// readTakes is the same for reading the lease; it models a target that
	// answers nothing until the call times out. Only for reads the elector
	// sends one at a time (an active controller's retakes): concurrent
	// reads would each move the clock on.
	readTakes time.Duration
	// beforeAcquire runs once, just before the next Acquire reaches the
	// target, to let another controller get there first.
	beforeAcquire func()
}

var _ election.Target = (*view)(nil)

func (w *world) view(target, holder string) *view {
	return &view{w: w, target: target, holder: holder, calls: map[string]int{}}
}

func (v *view) setUnreachable(unreachable bool) {
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	v.unreachable = unreachable
}

func (v *view) setBeforeAcquire(f func()) {
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	v.beforeAcquire = f
}

func (v *view) setReadTakes(d time.Duration) {
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	v.readTakes = d
}

func (v *view) setRenewTakes(d time.Duration) {
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	v.renewTakes = d
}

// sent answers how many calls of op ("read", "acquire", "renew",
// "release") this view sent, whether or not they arrived.
func (v *view) sent(op string) int {
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	return v.calls[op]
}

// arriveLocked counts a call and answers whether it reaches the target;
// a target that does not answer looks like a call that timed out, which
// is not ErrLost.
func (v *view) arriveLocked(op string) (*lease, error) {
	v.calls[op]++
	if v.unreachable {
		return nil, fmt.Errorf("%s %s: %w", op, v.target, context.DeadlineExceeded)
	}
	return v.w.leases[v.target], nil
}

func (v *view) Name() string { return v.target }

func (v *view) ReadLease(ctx context.Context) (election.Lease, error) {
	v.w.mu.Lock()
	takes := v.readTakes
	v.w.mu.Unlock()
	v.w.clock.Step(takes)
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	l, err := v.arriveLocked("read")
	if err != nil {
		return election.Lease{}, err
	}
	if !v.w.liveLocked(l) {
		return election.Lease{Epoch: l.epoch}, nil
	}
	return election.Lease{Holder: l.holder, Epoch: l.epoch, ExpiresIn: l.expires.Sub(v.w.clock.Now())}, nil
}

func (v *view) Acquire(ctx context.Context, epoch uint64) (uint64, error) {
	v.w.mu.Lock()
	first := v.beforeAcquire
	v.beforeAcquire = nil
	v.w.mu.Unlock()
	if first != nil {
		first()
	}
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	l, err := v.arriveLocked("acquire")
	if err != nil {
		return 0, err
	}
	live := v.w.liveLocked(l)
	switch {
	case live && l.holder != v.holder:
		return 0, fmt.Errorf("lease of %s is held by %s (epoch %d)", v.target, l.holder, l.epoch)
	case live:
		return l.epoch, nil
	case epoch != l.epoch:
		return 0, fmt.Errorf("lease of %s changed hands: epoch %d, not %d", v.target, l.epoch, epoch)
	}
	l.holder, l.epoch, l.expires = v.holder, l.epoch+1, v.w.clock.Now().Add(term)
	return l.epoch, nil
}

func (v *view) Renew(ctx context.Context, epoch uint64) error {
	v.w.mu.Lock()
	takes := v.renewTakes
	v.w.mu.Unlock()
	v.w.clock.Step(takes)
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	l, err := v.arriveLocked("renew")
	if err != nil {
		return err
	}
	if !v.w.liveLocked(l) || l.holder != v.holder || l.epoch != epoch {
		return fmt.Errorf("renew %s at epoch %d (holder %q, epoch %d): %w", v.target, epoch, l.holder, l.epoch, election.ErrLost)
	}
	l.expires = v.w.clock.Now().Add(term)
	return nil
}

func (v *view) Release(ctx context.Context, epoch uint64) error {
	v.w.mu.Lock()
	defer v.w.mu.Unlock()
	l, err := v.arriveLocked("release")
	if err != nil {
		return err
	}
	if l.holder == v.holder && l.epoch == epoch {
		l.holder = ""
	}
	return nil
}

// events records the elector's callbacks.
type events struct {
	mu      sync.Mutex
	active  int
	standby []string
	waiting []string
	// duringStandby runs inside Standby, to look at the leases while
	// the controller is stepping down.
	duringStandby func()
}

func (ev *events) onActive() {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	ev.active++
}

func (ev *events) onStandby(why string) {
	ev.mu.Lock()
	ev.standby = append(ev.standby, why)
	during := ev.duringStandby
	ev.mu.Unlock()
	if during != nil {
		during()
	}
}

func (ev *events) onWaiting(why string) {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	ev.waiting = append(ev.waiting, why)
}

func (ev *events) activeCalls() int {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	return ev.active
}

func (ev *events) standbyCalls() []string {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	return append([]string(nil), ev.standby...)
}

func (ev *events) waitingCalls() []string {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	return append([]string(nil), ev.waiting...)
}

// controller is one elector with its views of the targets.
type controller struct {
	*election.Elector
	holder string
	views  map[string]*view
	ev     *events
}

// controller makes an elector for holder over targets, in that order.
func (w *world) controller(t *testing.T, holder string, targets ...string) *controller {
	t.Helper()
	c := &controller{holder: holder, views: map[string]*view{}, ev: &events{}}
	var ts []election.Target
	for _, name := range targets {
		v := w.view(name, holder)
		c.views[name] = v
		ts = append(ts, v)
	}
	e, err := election.New(election.Config{
		Holder:  holder,
		Targets: ts,
		Clock:   w.clock,
		Active:  c.ev.onActive,
		Standby: c.ev.onStandby,
		Waiting: c.ev.onWaiting,
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	c.Elector = e
	return c
}

func (c *controller) sent(op string) int {
	n := 0
	for _, v := range c.views {
		n += v.sent(op)
	}
	return n
}

// step moves the clock on by d and lets every controller do what is due.
func (w *world) step(t *testing.T, d time.Duration, cs ...*controller) {
	w.clock.Step(d)
	for _, c := range cs {
		c.Tick(t.Context())
	}
}

// since answers how long ago (on the fake clock) t was.
func (w *world) since(t time.Time) time.Duration { return w.clock.Now().Sub(t) }

func wantEpoch(t *testing.T, c *controller, target string, want uint64) {
	t.Helper()
	got, err := c.Epoch(target)
	if err != nil || got != want {
		t.Fatalf("%s: Epoch(%s) = %d, %v; want %d", c.holder, target, got, err, want)
	}
}

func wantNoEpoch(t *testing.T, c *controller, target string) {
	t.Helper()
	if got, err := c.Epoch(target); err == nil {
		t.Fatalf("%s: Epoch(%s) = %d; want an error, the controller may not act on it", c.holder, target, got)
	}
}

func wantStandby(t *testing.T, c *controller, targets ...string) {
	t.Helper()
	if c.IsActive() {
		t.Fatalf("%s is active; want standby", c.holder)
	}
	for _, target := range targets {
		wantNoEpoch(t, c, target)
	}
}

func TestNewRefusesAnIncompleteConfig(t *testing.T) {
	w := newWorld("t1", "t2")
	for _, tc := range []struct {
		name    string
		cfg     election.Config
		wantErr bool
	}{
		{"complete", election.Config{Holder: "A", Targets: []election.Target{w.view("t1", "A"), w.view("t2", "A")}}, false},
		{"without holder", election.Config{Targets: []election.Target{w.view("t1", "")}}, true},
		{"without targets", election.Config{Holder: "A"}, true},
		{"with a target named twice", election.Config{Holder: "A", Targets: []election.Target{w.view("t1", "A"), w.view("t2", "A"), w.view("t1", "A")}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := election.New(tc.cfg)
			if tc.wantErr && (err == nil || e != nil) {
				t.Fatalf("New = %v, %v; want an error", e, err)
			}
			if !tc.wantErr && (err != nil || e == nil) {
				t.Fatalf("New = %v, %v; want an elector", e, err)
			}
		})
	}
}

// TestTakesEveryTargetInOrderAndKeepsThem: a lone controller takes every
// lease at its first poll, becomes active once, and keeps the same terms by
// renewing every RenewEvery.
func TestTakesEveryTargetInOrderAndKeepsThem(t *testing.T) {
	w := newWorld("t1", "t2")
	a := w.controller(t, "A", "t1", "t2")
	// Order: t2's acquire finds t1 already taken.
	a.views["t2"].setBeforeAcquire(func() {
		if !w.holds("t1", "A", 1) {
			t.Error("t2 was acquired before t1")
		}
	})

	a.Tick(t.Context())

	if !a.IsActive() || a.ev.activeCalls() != 1 {
		t.Fatalf("after the first tick: active %v, Active called %d times; want active, once", a.IsActive(), a.ev.activeCalls())
	}
	wantEpoch(t, a, "t1", 1)
	wantEpoch(t, a, "t2", 1)
	for elapsed := time.Second; elapsed <= 60*time.Second; elapsed += time.Second {
		w.step(t, time.Second, a)
		for _, name := range []string{"t1", "t2"} {
			wantEpoch(t, a, name, 1)
			if !w.holds(name, "A", 1) {
				t.Fatalf("at %v: lease of %s is %+v; want A's, epoch 1, live", elapsed, name, w.lease(name))
			}
			if got, want := a.views[name].sent("renew"), int(elapsed/renewEvery); got != want {
				t.Fatalf("at %v: %d renewals of %s; want %d, one every %v", elapsed, got, name, want, renewEvery)
			}
		}
	}
	if !a.IsActive() || a.ev.activeCalls() != 1 || len(a.ev.standbyCalls()) != 0 {
		t.Fatalf("after 60 s: active %v, Active called %d times, Standby %q; want active throughout",
			a.IsActive(), a.ev.activeCalls(), a.ev.standbyCalls())
	}
	if n := a.sent("acquire"); n != 2 {
		t.Fatalf("%d acquires; want 2, the leases never changed hands", n)
	}
}

// TestStandbyTakesOverOnlyAfterTheTermsRunOut: while A renews, B waits
// without trying to take anything; once A falls silent, A stops acting by
// its own count before the targets' terms end, and B takes over only after
// they ended. A, back, is refused and steps down.
func TestStandbyTakesOverOnlyAfterTheTermsRunOut(t *testing.T) {
	w := newWorld("t1", "t2")
	a := w.controller(t, "A", "t1", "t2")
	b := w.controller(t, "B", "t1", "t2")

	a.Tick(t.Context())
	b.Tick(t.Context())
	wantEpoch(t, a, "t1", 1)
	wantEpoch(t, a, "t2", 1)
	wantStandby(t, b, "t1", "t2")
	if waits := b.ev.waitingCalls(); len(waits) != 1 || !strings.Contains(waits[0], "A") {
		t.Fatalf("B's Waiting calls %q; want one naming A", waits)
	}
	if !b.OtherActs() || a.OtherActs() {
		t.Fatalf("OtherActs: A %v, B %v; want only B to see another controller acting", a.OtherActs(), b.OtherActs())
	}

	for range 10 {
		w.step(t, time.Second, a, b)
		wantStandby(t, b, "t1", "t2")
	}
	if n := a.views["t1"].sent("renew"); n != 2 {
		t.Fatalf("A renewed t1 %d times in 10 s; want 2", n)
	}
	lastRenewal := w.clock.Now() // A sent its renewals at this tick, then falls silent.

	var tookOver time.Time
	for range 30 {
		w.step(t, time.Second, b)
		if w.since(lastRenewal) < validity {
			wantEpoch(t, a, "t1", 1)
		} else {
			wantNoEpoch(t, a, "t1")
			wantNoEpoch(t, a, "t2")
		}
		if b.IsActive() {
			tookOver = w.clock.Now()
			break
		}
		if n := b.sent("acquire"); n != 0 {
			t.Fatalf("%v after A's last renewal, B sent %d acquires while A's terms were live", w.since(lastRenewal), n)
		}
	}
	if tookOver.IsZero() {
		t.Fatal("B never took over")
	}
	if d := tookOver.Sub(lastRenewal); d < term || d > term+2*time.Second {
		t.Fatalf("B took over %v after A's last renewal; want between %v and %v", d, term, term+2*time.Second)
	}
	wantEpoch(t, b, "t1", 2)
	wantEpoch(t, b, "t2", 2)
	if b.OtherActs() {
		t.Fatal("B, acting, says another controller acts")
	}
	if b.ev.activeCalls() != 1 {
		t.Fatalf("B's Active called %d times; want once", b.ev.activeCalls())
	}

	a.Tick(t.Context())

	standby := a.ev.standbyCalls()
	if len(standby) != 1 || !strings.Contains(standby[0], election.ErrLost.Error()) {
		t.Fatalf("A's Standby calls %q; want one saying its lease was lost", standby)
	}
	wantStandby(t, a, "t1", "t2")
	for _, name := range []string{"t1", "t2"} {
		if !w.holds(name, "B", 2) {
			t.Fatalf("after A stepped down, lease of %s is %+v; want still B's at epoch 2", name, w.lease(name))
		}
		wantEpoch(t, b, name, 2)
	}
	for !a.OtherActs() && w.since(tookOver) < 5*time.Second {
		w.step(t, time.Second, a, b)
	}
	if !a.OtherActs() || a.IsActive() {
		t.Fatalf("A: OtherActs %v, active %v; want A to find B acting and stay standby", a.OtherActs(), a.IsActive())
	}
}

// TestTakesAllOrNone: a standby that takes the first lease and then loses
// the race for the second gives the first back and does not act.
func TestTakesAllOrNone(t *testing.T) {
	w := newWorld("t1", "t2")
	b := w.controller(t, "B", "t1", "t2")
	a2 := w.view("t2", "A")
	b.views["t2"].setBeforeAcquire(func() {
		if _, err := a2.Acquire(t.Context(), 0); err != nil {
			t.Errorf("A could not take t2: %v", err)
		}
	})

	b.Tick(t.Context())

	if n := b.views["t1"].sent("acquire"); n != 1 {
		t.Fatalf("B sent %d acquires to t1; want 1 (the race is on t2, after t1 was taken)", n)
	}
	if !w.free("t1") {
		t.Fatalf("lease of t1 is %+v; want free, given back", w.lease("t1"))
	}
	if !w.holds("t2", "A", 1) {
		t.Fatalf("lease of t2 is %+v; want A's, epoch 1", w.lease("t2"))
	}
	wantStandby(t, b, "t1", "t2")
	if n := b.ev.activeCalls(); n != 0 {
		t.Fatalf("B's Active called %d times; want never", n)
	}
	if waits := b.ev.waitingCalls(); len(waits) != 1 || !strings.Contains(waits[0], "t2") {
		t.Fatalf("B's Waiting calls %q; want one about t2", waits)
	}

	// Two standbys that took one lease each must not collide again in step.
	failed, reads := w.clock.Now(), b.views["t1"].sent("read")
	for b.views["t1"].sent("read") == reads && w.since(failed) < 2*time.Second {
		w.step(t, 100*time.Millisecond, b)
	}
	if d := w.since(failed); d < 500*time.Millisecond || d > 1500*time.Millisecond {
		t.Fatalf("B read the leases again %v after its take failed; want after a random pause of 0.5s to 1.5s", d)
	}

	// t2 stays A's: B must not take t1 alone later either.
	for range 5 {
		w.step(t, time.Second, b)
		wantStandby(t, b, "t1", "t2")
		if !w.free("t1") {
			t.Fatalf("lease of t1 is %+v; want free while A holds t2", w.lease("t1"))
		}
	}
}

// TestValidityCountsFromTheSendTime: the controller counts a renewed term
// from when it sent the renewal, so a slow renewal does not lengthen it.
func TestValidityCountsFromTheSendTime(t *testing.T) {
	w := newWorld("t1")
	a := w.controller(t, "A", "t1")
	a.Tick(t.Context())
	wantEpoch(t, a, "t1", 1)
	a.views["t1"].setRenewTakes(2 * time.Second)

	w.clock.Step(renewEvery)
	sent := w.clock.Now()
	a.Tick(t.Context())
	if n := a.views["t1"].sent("renew"); n != 1 || w.since(sent) != 2*time.Second {
		t.Fatalf("%d renewals answered %v after sending; want one, answered after 2s", n, w.since(sent))
	}

	w.clock.SetTime(sent.Add(validity - time.Millisecond))
	wantEpoch(t, a, "t1", 1)
	w.clock.SetTime(sent.Add(validity))
	wantNoEpoch(t, a, "t1")
}

// TestSilentTargetIsDroppedAndTakenAgain: a target that stops answering is
// no longer acted on once its validity ran out, the others are; when it
// answers again it is renewed if the lease is still this controller's at
// the target, and acquired anew if it ran out there too.
func TestSilentTargetIsDroppedAndTakenAgain(t *testing.T) {
	for _, tc := range []struct {
		name string
		// silentFor is how long after the last renewal that got through
		// t2 answers again.
		silentFor time.Duration
		wantEpoch uint64
	}{
		{"back within the target's term", validity + time.Second, 1},
		{"back after the target's term", term + time.Second, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld("t1", "t2")
			a := w.controller(t, "A", "t1", "t2")
			a.Tick(t.Context())
			for range 10 {
				w.step(t, time.Second, a)
			}
			lastRenewal := w.clock.Now()
			a.views["t2"].setUnreachable(true)

			for w.since(lastRenewal) < tc.silentFor {
				w.clock.Step(time.Second)
				if w.since(lastRenewal) < validity {
					wantEpoch(t, a, "t2", 1)
				} else {
					wantNoEpoch(t, a, "t2")
				}
				a.Tick(t.Context())
				wantEpoch(t, a, "t1", 1)
				if !a.IsActive() {
					t.Fatalf("%v after t2 fell silent: standby; want active on t1", w.since(lastRenewal))
				}
			}
			if n := a.views["t2"].sent("renew"); n < 4 {
				t.Fatalf("%d renewals sent to t2; want it tried while silent", n)
			}
			acquires := a.views["t2"].sent("acquire")

			a.views["t2"].setUnreachable(false)
			w.step(t, time.Second, a)

			wantEpoch(t, a, "t2", tc.wantEpoch)
			wantEpoch(t, a, "t1", 1)
			if !w.holds("t2", "A", tc.wantEpoch) {
				t.Fatalf("lease of t2 is %+v; want A's at epoch %d", w.lease("t2"), tc.wantEpoch)
			}
			if got := w.lease("t2").expires; !got.Equal(w.clock.Now().Add(term)) {
				t.Fatalf("lease of t2 runs out at %v; want a full term from now, %v", got, w.clock.Now().Add(term))
			}
			if tc.wantEpoch == 1 && a.views["t2"].sent("acquire") != acquires {
				t.Fatal("a lease still A's was acquired rather than renewed")
			}
			if a.ev.activeCalls() != 1 || len(a.ev.standbyCalls()) != 0 {
				t.Fatalf("Active called %d times, Standby %q; want active throughout", a.ev.activeCalls(), a.ev.standbyCalls())
			}
		})
	}
}

// TestStandbyActsOnTheAnsweringTargetsAndTakesTheSilentOneLater: a standby
// does not wait for a target that does not answer.
func TestStandbyActsOnTheAnsweringTargetsAndTakesTheSilentOneLater(t *testing.T) {
	w := newWorld("t1", "t2")
	a := w.controller(t, "A", "t1", "t2")
	a.views["t2"].setUnreachable(true)

	a.Tick(t.Context())

	if !a.IsActive() {
		t.Fatal("standby; want active on the target that answers")
	}
	wantEpoch(t, a, "t1", 1)
	wantNoEpoch(t, a, "t2")

	a.views["t2"].setUnreachable(false)
	w.step(t, time.Second, a)

	wantEpoch(t, a, "t1", 1)
	wantEpoch(t, a, "t2", 1)
	if n := a.ev.activeCalls(); n != 1 {
		t.Fatalf("Active called %d times; want once", n)
	}
}

// TestDroppedTargetHeldByAnotherEndsTheTerm: a controller must not act on
// one target while another controller acts on a second, so finding a
// dropped target taken by someone else ends its term on every target.
func TestDroppedTargetHeldByAnotherEndsTheTerm(t *testing.T) {
	w := newWorld("t1", "t2")
	a := w.controller(t, "A", "t1", "t2")
	a.Tick(t.Context())
	for range 10 {
		w.step(t, time.Second, a)
	}
	lastRenewal := w.clock.Now()
	a.views["t2"].setUnreachable(true)
	for w.since(lastRenewal) < term {
		w.step(t, time.Second, a)
	}
	if !w.free("t2") {
		t.Fatalf("lease of t2 is %+v; want run out at the target", w.lease("t2"))
	}
	if _, err := w.view("t2", "C").Acquire(t.Context(), 1); err != nil {
		t.Fatalf("C could not take t2: %v", err)
	}
	var t1HeldDuringStandby bool
	a.ev.duringStandby = func() { t1HeldDuringStandby = w.holds("t1", "A", 1) }
	wantEpoch(t, a, "t1", 1)

	a.views["t2"].setUnreachable(false)
	w.step(t, time.Second, a)

	standby := a.ev.standbyCalls()
	if len(standby) != 1 || !strings.Contains(standby[0], "C") {
		t.Fatalf("Standby calls %q; want one naming C", standby)
	}
	wantStandby(t, a, "t1", "t2")
	if !t1HeldDuringStandby {
		t.Fatal("t1's lease was given back before Standby returned")
	}
	if !w.free("t1") {
		t.Fatalf("lease of t1 is %+v; want given back", w.lease("t1"))
	}
	if !w.holds("t2", "C", 2) {
		t.Fatalf("lease of t2 is %+v; want still C's at epoch 2", w.lease("t2"))
	}
}

// TestStepDownGivesBackAndTakesAgainAfterAPause: a controller that steps
// down lets another take over for a random pause of about a poll, then
// competes again.
func TestStepDownGivesBackAndTakesAgainAfterAPause(t *testing.T) {
	// The pause is random: try it several times.
	for i := range 20 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			w := newWorld("t1", "t2")
			a := w.controller(t, "A", "t1", "t2")
			a.Tick(t.Context())
			wantEpoch(t, a, "t1", 1)
			var heldDuringStandby bool
			a.ev.duringStandby = func() { heldDuringStandby = w.holds("t1", "A", 1) && w.holds("t2", "A", 1) }
			reads := a.sent("read")

			a.StepDown("maintenance")

			if got := a.ev.standbyCalls(); len(got) != 1 || got[0] != "maintenance" {
				t.Fatalf("Standby calls %q; want one with %q", got, "maintenance")
			}
			if !heldDuringStandby {
				t.Fatal("the leases were given back before Standby returned")
			}
			wantStandby(t, a, "t1", "t2")
			if !w.free("t1") || !w.free("t2") {
				t.Fatalf("leases %+v, %+v; want both given back", w.lease("t1"), w.lease("t2"))
			}

			steppedDown := w.clock.Now()
			for !a.IsActive() && w.since(steppedDown) < 2*time.Second {
				w.step(t, 100*time.Millisecond, a)
				if w.since(steppedDown) < 500*time.Millisecond && a.sent("read") != reads {
					t.Fatalf("read the leases %v after stepping down; want a pause of at least 0.5s", w.since(steppedDown))
				}
			}
			if d := w.since(steppedDown); !a.IsActive() || d < 500*time.Millisecond || d > 1500*time.Millisecond {
				t.Fatalf("active %v, %v after stepping down; want active again after 0.5s to 1.5s", a.IsActive(), d)
			}
			if n := a.ev.activeCalls(); n != 2 {
				t.Fatalf("Active called %d times; want twice", n)
			}
			wantEpoch(t, a, "t1", 2)
			wantEpoch(t, a, "t2", 2)
		})
	}
}

// TestStandbyWithNoTargetAnsweringWaits: with nothing readable, nothing is
// taken and the standby says why, once while that does not change.
func TestStandbyWithNoTargetAnsweringWaits(t *testing.T) {
	w := newWorld("t1", "t2")
	a := w.controller(t, "A", "t1", "t2")
	a.views["t1"].setUnreachable(true)
	a.views["t2"].setUnreachable(true)

	a.Tick(t.Context())
	for range 3 {
		w.step(t, time.Second, a)
	}

	wantStandby(t, a, "t1", "t2")
	if a.OtherActs() {
		t.Fatal("OtherActs with no target answering; want false, nothing shows another controller")
	}
	if n := a.ev.activeCalls(); n != 0 {
		t.Fatalf("Active called %d times; want never", n)
	}
	if n := a.views["t1"].sent("read"); n != 4 {
		t.Fatalf("t1 read %d times in 3 s; want 4, once a second", n)
	}
	if n := a.sent("acquire") + a.sent("renew"); n != 0 {
		t.Fatalf("%d acquires and renewals sent; want none", n)
	}
	waits := a.ev.waitingCalls()
	if len(waits) != 1 || !strings.Contains(waits[0], "no storage target answers") {
		t.Fatalf("Waiting calls %q; want one saying no storage target answers", waits)
	}
	if _, err := a.Epoch("t1"); err == nil || !strings.Contains(err.Error(), "no storage target answers") {
		t.Fatalf("Epoch(t1) error %v; want it to say no storage target answers", err)
	}
}

// TestStandbyRenewsALeaseStillItsOwn: acquiring a lease the target still
// counts as this controller's would not extend its term, which could then
// end before the controller counts it ended; it is renewed instead.
func TestStandbyRenewsALeaseStillItsOwn(t *testing.T) {
	w := newWorld("t1", "t2")
	w.setLease("t1", lease{holder: "A", epoch: 3, expires: start.Add(5 * time.Second)})
	w.setLease("t2", lease{epoch: 7})
	a := w.controller(t, "A", "t1", "t2")

	a.Tick(t.Context())

	wantEpoch(t, a, "t1", 3)
	wantEpoch(t, a, "t2", 8)
	if got, want := w.lease("t1").expires, start.Add(term); !got.Equal(want) {
		t.Fatalf("lease of t1 runs out at %v; want %v, a full term from the renewal", got, want)
	}
	if n := a.views["t1"].sent("acquire"); n != 0 {
		t.Fatalf("%d acquires sent to t1; want none, it was A's", n)
	}
	if n := a.views["t1"].sent("renew"); n != 1 {
		t.Fatalf("%d renewals sent to t1; want one", n)
	}
}

// TestOtherActsFollowsTheLastPoll: a standby knows another controller acts
// only as long as its polls show one.
func TestOtherActsFollowsTheLastPoll(t *testing.T) {
	w := newWorld("t1", "t2")
	if _, err := w.view("t2", "X").Acquire(t.Context(), 0); err != nil {
		t.Fatal(err)
	}
	a := w.controller(t, "A", "t1", "t2")

	a.Tick(t.Context())
	if !a.OtherActs() {
		t.Fatal("OtherActs false while X holds t2")
	}

	a.views["t1"].setUnreachable(true)
	a.views["t2"].setUnreachable(true)
	w.step(t, time.Second, a)
	if a.OtherActs() {
		t.Fatal("OtherActs true after a poll that read no lease")
	}
	wantStandby(t, a, "t1", "t2")
}

// TestSilentTargetsDoNotHoldUpTheOthersRenewals: trying targets that
// answer nothing (each read waits out its timeout, RenewEvery) must not
// delay the renewals of the targets that answer until their terms run out.
func TestSilentTargetsDoNotHoldUpTheOthersRenewals(t *testing.T) {
	w := newWorld("t1", "t2", "t3", "t4")
	a := w.controller(t, "A", "t1", "t2", "t3", "t4")
	a.Tick(t.Context())
	for range 10 {
		w.step(t, time.Second, a)
	}
	// Their renewals fail at once here, which only spares the elector
	// time a real silent target would take.
	for _, name := range []string{"t2", "t3", "t4"} {
		a.views[name].setUnreachable(true)
		a.views[name].setReadTakes(renewEvery)
	}

	for w.since(start) < 2*time.Minute {
		w.step(t, time.Second, a)
		if !a.IsActive() {
			t.Fatalf("at %v: stepped down (%q); want active on t1 throughout", w.since(start), a.ev.standbyCalls())
		}
		wantEpoch(t, a, "t1", 1)
	}
	if !w.holds("t1", "A", 1) {
		t.Fatalf("lease of t1 is %+v; want A's at epoch 1 throughout", w.lease("t1"))
	}
}

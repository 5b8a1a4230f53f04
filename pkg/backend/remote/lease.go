package remote

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/election"
	"github.com/modeguard/modeguard/pkg/fsutil"
)

// One controller acts on a pool at a time. A controller on the pool's host
// holds the pool's lock file; a controller that reaches the pool through
// its target holds a lease on the target instead: it takes the lease
// before its first call (waiting while another controller holds it),
// renews it while it runs, and gives it back when it stops. The target
// answers every call but the lease's own and Info only for the lease's
// holder, so a controller that lost its lease (it stalled past the lease's
// term, or was cut off while another took over) is refused rather than
// acting next to its successor.
//
// Each term of the lease has an epoch, one more than the term before. The
// target records holder and epoch on its disk before it answers a new
// holder, so a restarted target still knows who holds it (and gives that
// holder one whole term from its start to renew), and a controller whose
// term ended cannot renew its way back into a later one: it must take the
// lease anew, which it can only do from the epoch it just read, and only
// when no one else holds it. Every call names its epoch and runs under its
// term: when the term ends, the calls of that term still running are
// cancelled, and the next holder is admitted only once they have returned,
// so no call of a former holder runs next to one of its successor.

// holderHeader carries the caller's lease holder name on every call, and
// epochHeader the term it holds (absent from controllers of versions that
// know no epochs: their calls run under the current term when the name is
// its holder's).
const (
	holderHeader = "Modeguard-Controller"
	epochHeader  = "Modeguard-Epoch"
)

// leaseVersion is what Info says of the target's lease: 2 has epochs, the
// Lease and Renew calls and the record on disk. A target that says nothing
// is of version 1, which a controller holds the way it always did.
const leaseVersion = 2

// LeaseTerm is how long a lease lasts without a renewal: after a
// controller dies without giving its lease back, the next waits at most
// this long.
const LeaseTerm = 15 * time.Second

// renewEvery is how often a holder renews, well within LeaseTerm.
const renewEvery = LeaseTerm / 3

// DrainLimit is how long a new holder waits for the calls of a former
// term that ignore their cancellation (a backend step blocked on a hung
// disk) before the target gives up on them: it calls its stuck function,
// which for the storage target logs them and exits, so that its restart
// ends them.
const DrainLimit = time.Minute

// leaseRecordFile is the lease's record in the target's state directory.
const leaseRecordFile = ".modeguard-target-lease.json"

type leaseRequest struct {
	Holder string `json:"holder"`
	// Epoch is the term the caller read (Acquire: the lease is taken only
	// if it is still at that epoch) or holds (Renew, Release). A
	// controller of an earlier version sends none.
	Epoch *uint64 `json:"epoch,omitempty"`
	// Peer is where the holder takes calls from other controllers.
	Peer string `json:"peer,omitempty"`
}

type leaseResponse struct {
	// Holder is empty while no one holds the lease.
	Holder string `json:"holder"`
	Epoch  uint64 `json:"epoch"`
	// ExpiresInMillis is how long the term lasts without a renewal, on the
	// target's clock: a duration, so that controller and target need no
	// common time.
	ExpiresInMillis int64  `json:"expiresInMillis"`
	Peer            string `json:"peer,omitempty"`
}

// leaseRecord is what the target keeps on its disk across restarts.
type leaseRecord struct {
	Holder string `json:"holder"`
	Epoch  uint64 `json:"epoch"`
	Peer   string `json:"peer,omitempty"`
}

// errTermEnded is the cause a term's calls are cancelled with.
type errTermEnded struct{ why string }

func (e errTermEnded) Error() string { return e.why }

// lease is the target's side.
type lease struct {
	mu     sync.Mutex
	now    func() time.Time
	length time.Duration // of a term: LeaseTerm
	record string        // the record's path; empty keeps the lease in memory only

	holder, peer string
	epoch        uint64
	expires      time.Time
	// term is the context of the current term's calls; endTerm cancels
	// it, once, when the term ends.
	term    context.Context
	endTerm context.CancelCauseFunc
	timer   *time.Timer
	// running counts the admitted calls still running, per epoch.
	running map[uint64]int
	// drainingSince is when a successor first waited for a former term's
	// calls; stuck is called once when that wait passes DrainLimit.
	drainingSince time.Time
	stuck         func(epoch uint64, calls int)
	stuckCalled   bool
}

// newLease reads the lease's record in stateDir (none: an unheld lease),
// and gives a recorded holder one whole term from now. A record that
// cannot be read is an error: a target that does not know whether a
// controller holds it does not start, rather than admit a second one.
func newLease(stateDir string, now func() time.Time, stuck func(uint64, int)) (*lease, error) {
	l := &lease{now: now, length: LeaseTerm, running: map[uint64]int{}, stuck: stuck}
	if stateDir == "" {
		return l, nil
	}
	l.record = filepath.Join(stateDir, leaseRecordFile)
	var rec leaseRecord
	switch err := fsutil.ReadJSON(l.record, &rec); {
	case errors.Is(err, fs.ErrNotExist):
		return l, nil
	case err != nil:
		return nil, fmt.Errorf("the storage target's lease record %s cannot be read, so it is not known which controller holds this target: %w; "+
			"remove the file only once no controller is acting", l.record, err)
	}
	l.holder, l.epoch, l.peer = rec.Holder, rec.Epoch, rec.Peer
	if l.holder != "" {
		l.startTerm(now())
	}
	return l, nil
}

// startTerm begins a term of the current holder lasting a term from now.
func (l *lease) startTerm(now time.Time) {
	l.term, l.endTerm = context.WithCancelCause(context.Background())
	l.extend(now)
}

// extend moves the current term's end to a term from now, and arms a
// timer that ends the term then, so that its calls are cancelled even if
// no one asks for the lease.
func (l *lease) extend(now time.Time) {
	l.expires = now.Add(l.length)
	if l.timer != nil {
		l.timer.Stop()
	}
	l.timer = time.AfterFunc(l.length+10*time.Millisecond, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.endIfDue(l.now())
	})
}

func (l *lease) live(now time.Time) bool { return l.holder != "" && now.Before(l.expires) }

// endIfDue ends a term that ran out: its calls still running are
// cancelled.
func (l *lease) endIfDue(now time.Time) {
	if l.endTerm != nil && !now.Before(l.expires) {
		l.endTerm(errTermEnded{fmt.Sprintf("the lease of %s (epoch %d) ran out", l.holder, l.epoch)})
		l.endTerm = nil
	}
}

func (l *lease) answer(now time.Time) leaseResponse {
	r := leaseResponse{Epoch: l.epoch}
	if l.live(now) {
		r.Holder, r.Peer, r.ExpiresInMillis = l.holder, l.peer, l.expires.Sub(now).Milliseconds()
	}
	return r
}

// state answers who holds the lease, at which epoch, for how long more.
func (l *lease) state() leaseResponse {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	l.endIfDue(now)
	return l.answer(now)
}

// store records holder, epoch and peer before a new holder is answered.
func (l *lease) store() error {
	if l.record == "" {
		return nil
	}
	return fsutil.WriteJSONAtomic(l.record, leaseRecord{Holder: l.holder, Epoch: l.epoch, Peer: l.peer})
}

// acquire gives the lease to the caller when no one else holds it: a new
// term, one epoch on. The caller names the epoch it read, and gets the
// lease only if it is still at that epoch, so two controllers that both
// saw it free cannot both take it. The live holder asking again gets its
// term back unchanged (its answer may have been lost). A caller that names
// no epoch is a controller of an earlier version: it renews by acquiring,
// and takes a free lease whatever its epoch.
func (l *lease) acquire(r leaseRequest) (leaseResponse, error) {
	if r.Holder == "" {
		return leaseResponse{}, status.Error(codes.InvalidArgument, "a lease needs a holder name")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	l.endIfDue(now)
	if l.live(now) {
		if l.holder != r.Holder {
			return l.answer(now), status.Errorf(codes.Unavailable,
				"another controller holds this storage target: %s (epoch %d, for %s more unless it renews); one controller acts on a pool at a time",
				l.holder, l.epoch, l.expires.Sub(now).Round(time.Millisecond))
		}
		if r.Epoch == nil {
			l.extend(now)
		}
		return l.answer(now), nil
	}
	if r.Epoch != nil && *r.Epoch != l.epoch {
		return l.answer(now), status.Errorf(codes.Aborted,
			"the lease is at epoch %d, not %d as read: it changed hands meanwhile; read it again", l.epoch, *r.Epoch)
	}
	if n := l.runningCalls(); n > 0 {
		if l.drainingSince.IsZero() {
			l.drainingSince = now
		}
		if waited := now.Sub(l.drainingSince); waited >= DrainLimit && !l.stuckCalled && l.stuck != nil {
			l.stuckCalled = true
			l.stuck(l.epoch, n)
		}
		return l.answer(now), status.Errorf(codes.Unavailable,
			"draining %d calls of the former holder %s (epoch %d), cancelled when its lease ended", n, l.holder, l.epoch)
	}
	was := leaseRecord{Holder: l.holder, Epoch: l.epoch, Peer: l.peer}
	l.holder, l.epoch, l.peer = r.Holder, l.epoch+1, r.Peer
	if err := l.store(); err != nil {
		l.holder, l.epoch, l.peer = was.Holder, was.Epoch, was.Peer
		return l.answer(now), status.Errorf(codes.Unavailable, "recording the lease: %v", err)
	}
	l.drainingSince, l.stuckCalled = time.Time{}, false
	l.startTerm(now)
	return l.answer(now), nil
}

func (l *lease) runningCalls() int {
	n := 0
	for _, c := range l.running {
		n += c
	}
	return n
}

// renew extends the caller's term, if it is still the live one.
func (l *lease) renew(r leaseRequest) (leaseResponse, error) {
	if r.Epoch == nil {
		return leaseResponse{}, status.Error(codes.InvalidArgument, "a renewal names the epoch it renews")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	l.endIfDue(now)
	if !l.live(now) || l.holder != r.Holder || l.epoch != *r.Epoch {
		return l.answer(now), status.Errorf(codes.FailedPrecondition, "%s: %s", leaseLost, l.describe(now))
	}
	l.extend(now)
	return l.answer(now), nil
}

// leaseLost begins a renewal's refusal: the caller's term is over.
const leaseLost = "lease lost"

func (l *lease) describe(now time.Time) string {
	if !l.live(now) {
		return fmt.Sprintf("nobody holds it (epoch %d)", l.epoch)
	}
	return fmt.Sprintf("%s holds it at epoch %d", l.holder, l.epoch)
}

// release ends the caller's term, if it is the live one: its calls still
// running are cancelled, and the next holder waits for them.
func (l *lease) release(r leaseRequest) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holder != r.Holder || (r.Epoch != nil && *r.Epoch != l.epoch) {
		return nil
	}
	if l.endTerm != nil {
		l.endTerm(errTermEnded{fmt.Sprintf("%s gave the lease back (epoch %d)", l.holder, l.epoch)})
		l.endTerm = nil
	}
	if l.timer != nil {
		l.timer.Stop()
	}
	l.holder, l.peer, l.expires = "", "", time.Time{}
	if err := l.store(); err != nil {
		// Kept in memory: a restart before the next record gives the
		// former holder one term, which it no longer renews.
		return status.Errorf(codes.Unavailable, "recording the lease's release: %v", err)
	}
	return nil
}

// admit lets a call through only from the lease's unexpired holder, of
// the current epoch when it names one; it answers the term's context, which
// the call runs under, and done, which the call calls when it returns.
func (l *lease) admit(holder, epoch string) (context.Context, func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	l.endIfDue(now)
	if !l.live(now) {
		return nil, nil, status.Errorf(codes.Unavailable, "%s, and %q does not hold it (nobody does)", notTheHolder, holder)
	}
	if holder == "" || holder != l.holder {
		return nil, nil, status.Errorf(codes.Unavailable, "%s: %s holds it, not %q", notTheHolder, l.holder, holder)
	}
	if epoch != "" {
		if e, err := strconv.ParseUint(epoch, 10, 64); err != nil || e != l.epoch {
			return nil, nil, status.Errorf(codes.Unavailable, "%s: %s holds it at epoch %d, and the call was for epoch %s", notTheHolder, l.holder, l.epoch, epoch)
		}
	}
	e := l.epoch
	l.running[e]++
	return l.term, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.running[e]--; l.running[e] == 0 {
			delete(l.running, e)
		}
	}, nil
}

// unleased are the methods anyone may call: what the target serves, and
// the lease's own.
var unleased = map[string]bool{"Info": true, "Lease": true, "Acquire": true, "Renew": true, "Release": true}

// notTheHolder begins every refusal of a call for want of the lease: the
// call was not carried out (or, when its term ended while it ran, was
// cancelled), and the client may take the lease (if no one else holds it)
// and call again.
const notTheHolder = "this storage target answers only the controller holding its lease"

// leased wraps the API's methods: only the holder gets through, and its
// calls run under its term.
func (l *lease) leased(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if method, ok := strings.CutPrefix(r.URL.Path, "/v1/"); ok && unleased[method] {
			next.ServeHTTP(w, r)
			return
		}
		term, done, err := l.admit(r.Header.Get(holderHeader), r.Header.Get(epochHeader))
		if err != nil {
			writeEnvelope(w, envelope{Error: toWire(err)})
			return
		}
		defer done()
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		stop := context.AfterFunc(term, func() { cancel(context.Cause(term)) })
		defer stop()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// termEnded turns the error of a call its term's end cancelled into the
// refusal the client knows.
func termEnded(ctx context.Context, err error) error {
	var ended errTermEnded
	if err == nil || !errors.As(context.Cause(ctx), &ended) {
		return err
	}
	return status.Errorf(codes.Unavailable, "%s: %s while the call ran, and it was cancelled (%v); call again", notTheHolder, ended.why, err)
}

// exitWhenStuck is the storage target's stuck function: calls that ignore
// their cancellation (a backend step blocked in the kernel) hold every
// controller off, so the target exits, and its restart ends them.
func exitWhenStuck(epoch uint64, calls int) {
	klog.ErrorS(nil, "Calls of a former lease holder did not return within the drain limit; exiting so that a restart ends them",
		"epoch", epoch, "calls", calls, "limit", DrainLimit)
	klog.Flush()
	os.Exit(1)
}

// Hold takes the target's lease as holder (a name saying which
// controller: host and pid), waiting while another controller holds it
// and calling waiting with why; then it renews the lease until Close. A
// renewal that finds the lease lost takes it again if no one else holds
// it (a new term); otherwise the calls are refused until it can.
func (c *Client) Hold(ctx context.Context, holder string, waiting func(string)) error {
	c.holder = holder
	for {
		// Each try is bounded: a target that takes connections but does
		// not answer is waited for with a message, not silently.
		try, cancel := context.WithTimeout(ctx, renewEvery)
		err := c.acquire(try)
		cancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		waiting(fmt.Sprintf("storage target %s: %v", c.name, status.Convert(err).Message()))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	renewCtx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	c.stopRenewal = func() {
		stop()
		<-done
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		callOnce[empty](rctx, c, "Release", c.leaseRequest(c.epoch.Load()))
	}
	go func() {
		defer close(done)
		t := time.NewTicker(renewEvery)
		defer t.Stop()
		for {
			select {
			case <-renewCtx.Done():
				return
			case <-t.C:
				rctx, cancel := context.WithTimeout(renewCtx, renewEvery)
				c.renew(rctx)
				cancel()
			}
		}
	}()
	return nil
}

// leaseRequest is the client's request naming epoch; a target of lease
// version 1 takes no epoch.
func (c *Client) leaseRequest(epoch uint64) leaseRequest {
	r := leaseRequest{Holder: c.holder, Peer: c.peer}
	if c.info.LeaseVersion >= leaseVersion {
		r.Epoch = &epoch
	}
	return r
}

// acquire takes the lease from the epoch the target shows now.
func (c *Client) acquire(ctx context.Context) error {
	if c.info.LeaseVersion < leaseVersion {
		_, err := callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: c.holder})
		return err
	}
	now, err := callOnce[leaseResponse](ctx, c, "Lease", empty{})
	if err != nil {
		return err
	}
	got, err := callOnce[leaseResponse](ctx, c, "Acquire", c.leaseRequest(now.Epoch))
	if err != nil {
		return err
	}
	c.epoch.Store(got.Epoch)
	return nil
}

// renew extends the term; one found lost is taken again when the lease is
// free.
func (c *Client) renew(ctx context.Context) {
	if c.info.LeaseVersion < leaseVersion {
		callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: c.holder})
		return
	}
	epoch := c.epoch.Load()
	_, err := callOnce[leaseResponse](ctx, c, "Renew", c.leaseRequest(epoch))
	if status.Code(err) != codes.FailedPrecondition {
		return
	}
	klog.InfoS("Lost the lease of a storage target; taking it again if no one holds it", "target", c.name, "epoch", epoch, "why", status.Convert(err).Message())
	if err := c.acquire(ctx); err != nil {
		klog.InfoS("Could not take the storage target's lease again", "target", c.name, "err", err)
	}
}

// Elected makes the client act for an election (package election) rather
// than hold the lease itself: holder names this controller, and epoch
// answers, before every call, the term the call is sent under, or why this
// controller may not act on the target now, in which case the call is
// refused without being sent. A refused call is not retried by taking the
// lease: only the election takes leases.
//
// peer, when not empty, is where this controller takes the calls other
// controllers forward to it; it is recorded with the lease it acquires.
func (c *Client) Elected(holder, peer string, epoch func(target string) (uint64, error)) {
	c.holder, c.peer, c.termEpoch = holder, peer, epoch
}

var _ election.Target = (*Client)(nil)

// Name is the target's address, which names it in the election.
func (c *Client) Name() string { return c.name }

// ReadLease reads the target's lease. A target of lease version 1 keeps no
// epochs and cannot take part in an election.
func (c *Client) ReadLease(ctx context.Context) (election.Lease, error) {
	if c.info.LeaseVersion < leaseVersion {
		return election.Lease{}, status.Errorf(codes.FailedPrecondition,
			"storage target %s keeps its lease without epochs (an older version), which an elected controller cannot rely on; upgrade it", c.name)
	}
	r, err := callOnce[leaseResponse](ctx, c, "Lease", empty{})
	if err != nil {
		return election.Lease{}, err
	}
	return election.Lease{Holder: r.Holder, Epoch: r.Epoch, ExpiresIn: time.Duration(r.ExpiresInMillis) * time.Millisecond, Peer: r.Peer}, nil
}

// Acquire takes the lease from epoch, as read.
func (c *Client) Acquire(ctx context.Context, epoch uint64) (uint64, error) {
	r, err := callOnce[leaseResponse](ctx, c, "Acquire", c.leaseRequest(epoch))
	if err != nil {
		return 0, err
	}
	if r.Holder != c.holder {
		return 0, status.Errorf(codes.Unavailable, "storage target %s answered its lease as %q's, not this controller's", c.name, r.Holder)
	}
	return r.Epoch, nil
}

// Renew extends the term of epoch; a term that is over is election.ErrLost.
func (c *Client) Renew(ctx context.Context, epoch uint64) error {
	_, err := callOnce[leaseResponse](ctx, c, "Renew", c.leaseRequest(epoch))
	if status.Code(err) == codes.FailedPrecondition {
		return fmt.Errorf("%w: %s", election.ErrLost, status.Convert(err).Message())
	}
	return err
}

// Release gives the lease of epoch back.
func (c *Client) Release(ctx context.Context, epoch uint64) error {
	_, err := callOnce[empty](ctx, c, "Release", c.leaseRequest(epoch))
	return err
}

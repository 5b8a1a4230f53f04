package remote

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
)

// clock is a settable now for the target's lease.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// serveLeased serves a block controller's API with the lease on clk's time.
func serveLeased(t *testing.T, clk *clock) string {
	t.Helper()
	return serveUnix(t, leasedHandler(blockController(t), leaseOn(t, "", clk, nil)))
}

// leaseOn is a target's lease on clk's time, recorded in stateDir.
func leaseOn(t *testing.T, stateDir string, clk *clock, stuck func(uint64, int)) *lease {
	t.Helper()
	l, err := newLease(stateDir, clk.now, stuck)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// serveUnix serves h on a unix socket, as a target on the controller's
// host does, and returns the address to dial.
func serveUnix(t *testing.T, h http.Handler) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "target.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	return "unix://" + sock
}

func dial(t *testing.T, addr string) *Client {
	t.Helper()
	c, err := Dial(context.Background(), Target{Address: addr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// One controller at a time: a second waits, saying for whom, and gets
// nothing answered meanwhile; it takes over once the first gives the
// lease back.
func TestSecondControllerWaitsForTheLease(t *testing.T) {
	addr := serveLeased(t, &clock{t: time.Now()})
	first, second := dial(t, addr), dial(t, addr)
	hold(t, first, "controller-1")
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	var said []string
	err := second.Hold(ctx, "controller-2", func(why string) { said = append(said, why) })
	if err == nil || len(said) == 0 || !strings.Contains(said[0], "controller-1") {
		t.Fatalf("the second controller's Hold = %v, saying %q; want a wait naming controller-1", err, said)
	}
	_, err = second.ListVolumes(context.Background())
	wantCode(t, "a call without the lease", err, codes.Unavailable)
	if _, err := first.ListVolumes(context.Background()); err != nil {
		t.Fatalf("the holder's call: %v", err)
	}
	first.Close()
	hold(t, second, "controller-2")
	if _, err := second.ListVolumes(context.Background()); err != nil {
		t.Fatalf("the new holder's call: %v", err)
	}
}

// takenOver is a target whose lease controller-1 (first) held until its
// term ran out, and controller-2 (second) holds now.
func takenOver(t *testing.T) (first, second *Client) {
	t.Helper()
	clk := &clock{t: time.Now()}
	addr := serveLeased(t, clk)
	first, second = dial(t, addr), dial(t, addr)
	hold(t, first, "controller-1")
	clk.add(LeaseTerm + time.Second)
	hold(t, second, "controller-2")
	return first, second
}

// A controller that stopped renewing (stalled, cut off) loses the lease
// after its term; once another takes it, the first is refused, even when
// it comes back: it cannot act next to its successor.
func TestStaleControllerIsRefused(t *testing.T) {
	first, second := takenOver(t)
	_, err := first.ListVolumes(context.Background())
	wantCode(t, "the stale controller's call", err, codes.Unavailable)
	if !strings.Contains(err.Error(), "controller-2 holds it") {
		t.Fatalf("the refusal does not name the holder: %v", err)
	}
	// Its renewal does not take the lease back either.
	if _, err := call[leaseResponse](context.Background(), first, "Acquire", leaseRequest{Holder: "controller-1"}); err == nil {
		t.Fatal("the stale controller took the lease back from a live holder")
	}
	if _, err := second.ListVolumes(context.Background()); err != nil {
		t.Fatalf("the holder's call: %v", err)
	}
}

// A holder whose lease ran out with no one else taking it (its renewals
// did not get through in time, or the target restarted and forgot it) is
// not refused until its next renewal: the call takes the lease again and is
// carried out. A lapse during which another controller took the lease
// still ends in a refusal (TestStaleControllerIsRefused).
func TestLapsedLeaseIsTakenAgainByTheNextCall(t *testing.T) {
	clk := &clock{t: time.Now()}
	addr := serveLeased(t, clk)
	c := dial(t, addr)
	hold(t, c, "controller-1")
	clk.add(LeaseTerm + time.Second)
	if _, err := c.ListVolumes(context.Background()); err != nil {
		t.Fatalf("the call after the lease lapsed: %v", err)
	}
	// Taken again, for a whole term: another controller waits.
	other := dial(t, addr)
	if _, err := call[leaseResponse](context.Background(), other, "Acquire", leaseRequest{Holder: "controller-2"}); err == nil {
		t.Fatal("another controller took the lease the call had just taken again")
	}
}

// A target that takes connections but never answers is waited for with a
// message at every try, not silently forever.
func TestHoldSaysItWaitsForASilentTarget(t *testing.T) {
	addr := serveLeased(t, &clock{t: time.Now()})
	c := dial(t, addr)
	sock := filepath.Join(t.TempDir(), "silent.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	go func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			defer conn.Close() // held open, never answered
		}
	}()
	c.base, c.name = "http://silent", "unix://"+sock
	c.http.Transport.(*http.Transport).DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}
	ctx, cancel := context.WithTimeout(context.Background(), renewEvery+2*time.Second)
	defer cancel()
	var said []string
	err = c.Hold(ctx, "controller-1", func(why string) { said = append(said, why) })
	if err == nil || len(said) == 0 || !strings.Contains(said[0], "silent.sock") {
		t.Fatalf("Hold against a silent target = %v, saying %q", err, said)
	}
}

// leaseOf reads the target's lease as a standby would.
func leaseOf(t *testing.T, c *Client) leaseResponse {
	t.Helper()
	l, err := callOnce[leaseResponse](context.Background(), c, "Lease", empty{})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func epochPtr(e uint64) *uint64 { return &e }

// Every term has its epoch, one more than the term before; the lease
// shows holder, epoch and the time left, and no holder once given back.
func TestEachTermHasTheNextEpoch(t *testing.T) {
	addr := serveLeased(t, &clock{t: time.Now()})
	first, second := dial(t, addr), dial(t, addr)
	if l := leaseOf(t, first); l.Holder != "" || l.Epoch != 0 {
		t.Fatalf("a new target's lease: %+v", l)
	}
	hold(t, first, "controller-1")
	if l := leaseOf(t, second); l.Holder != "controller-1" || l.Epoch != 1 || l.ExpiresInMillis <= 0 || l.ExpiresInMillis > LeaseTerm.Milliseconds() {
		t.Fatalf("the lease while controller-1 holds it: %+v", l)
	}
	first.Close()
	if l := leaseOf(t, second); l.Holder != "" || l.Epoch != 1 || l.ExpiresInMillis != 0 {
		t.Fatalf("the lease given back: %+v", l)
	}
	hold(t, second, "controller-2")
	if l := leaseOf(t, second); l.Holder != "controller-2" || l.Epoch != 2 {
		t.Fatalf("the second term: %+v", l)
	}
	if _, err := second.ListVolumes(context.Background()); err != nil {
		t.Fatalf("the second holder's call: %v", err)
	}
}

// Acquire is a compare-and-set on the epoch read: of two controllers that
// both saw the lease free, one gets it; the other, later, cannot take it
// from what it read before the lease changed hands.
func TestAcquireIsCompareAndSet(t *testing.T) {
	addr := serveLeased(t, &clock{t: time.Now()})
	c := dial(t, addr)
	ctx := context.Background()
	seen := leaseOf(t, c).Epoch
	if _, err := callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: "controller-1", Epoch: epochPtr(seen)}); err != nil {
		t.Fatal(err)
	}
	_, err := callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: "controller-2", Epoch: epochPtr(seen)})
	wantCode(t, "the second Acquire while the first holds", err, codes.Unavailable)
	if _, err := callOnce[empty](ctx, c, "Release", leaseRequest{Holder: "controller-1", Epoch: epochPtr(seen + 1)}); err != nil {
		t.Fatal(err)
	}
	_, err = callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: "controller-2", Epoch: epochPtr(seen)})
	wantCode(t, "an Acquire from an epoch read before the lease changed hands", err, codes.Aborted)
	got, err := callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: "controller-2", Epoch: epochPtr(seen + 1)})
	if err != nil || got.Epoch != seen+2 || got.Holder != "controller-2" {
		t.Fatalf("Acquire from the epoch read now = %+v, %v", got, err)
	}
	// The holder asking again (its answer lost) gets its term unchanged.
	again, err := callOnce[leaseResponse](ctx, c, "Acquire", leaseRequest{Holder: "controller-2", Epoch: epochPtr(seen + 1)})
	if err != nil || again.Epoch != got.Epoch {
		t.Fatalf("the holder's Acquire again = %+v, %v", again, err)
	}
}

// A holder whose term ended, taken and given back by another controller
// meanwhile, cannot renew its way back into the lease, and its calls of
// the old epoch are refused even when the lease is free.
func TestFormerHolderCannotRenewBack(t *testing.T) {
	first, second := takenOver(t)
	second.Close()
	ctx := context.Background()
	_, err := callOnce[leaseResponse](ctx, first, "Renew", leaseRequest{Holder: "controller-1", Epoch: epochPtr(1)})
	wantCode(t, "the former holder's renewal", err, codes.FailedPrecondition)
	if !strings.Contains(err.Error(), leaseLost) {
		t.Fatalf("the refusal does not say the lease was lost: %v", err)
	}
	_, err = callOnce[[]any](ctx, first, "ListVolumes", empty{})
	wantCode(t, "a call of the former term", err, codes.Unavailable)
	// Taking the lease anew is a new term: the calls name it.
	hold(t, first, "controller-1")
	if e := first.epoch.Load(); e != 3 {
		t.Fatalf("the new term's epoch = %d, want 3", e)
	}
	if _, err := first.ListVolumes(ctx); err != nil {
		t.Fatalf("a call of the new term: %v", err)
	}
	_, err = callOnce[leaseResponse](ctx, first, "Renew", leaseRequest{Holder: "controller-1", Epoch: epochPtr(1)})
	wantCode(t, "the holder renewing an epoch before its own", err, codes.FailedPrecondition)
	// The holder's own call naming an epoch it no longer holds is refused.
	first.epoch.Store(1)
	_, err = callOnce[[]any](ctx, first, "ListVolumes", empty{})
	wantCode(t, "a call naming an epoch before the current one", err, codes.Unavailable)
	if !strings.Contains(err.Error(), "epoch 3") {
		t.Fatalf("the refusal does not name the current epoch: %v", err)
	}
}

// swappable serves whichever handler is set last: a target restarted on
// the same socket.
type swappable struct {
	mu sync.Mutex
	h  http.Handler
}

func (s *swappable) set(h http.Handler) { s.mu.Lock(); s.h = h; s.mu.Unlock() }
func (s *swappable) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	h := s.h
	s.mu.Unlock()
	h.ServeHTTP(w, r)
}

// A restarted target keeps its holder: the acting controller goes on
// (renewing first, as it does every 5 s), and another that asks during
// the holder's first term after the restart waits, rather than taking
// the lease the moment the target comes back. Once the holder stops
// renewing, its term runs out as before.
func TestLeaseSurvivesTargetRestart(t *testing.T) {
	clk := &clock{t: time.Now()}
	dir := t.TempDir()
	ctrl := blockController(t)
	srv := &swappable{}
	srv.set(leasedHandler(ctrl, leaseOn(t, dir, clk, nil)))
	addr := serveUnix(t, srv)
	first, second := dial(t, addr), dial(t, addr)
	hold(t, first, "controller-1")
	epoch := first.epoch.Load()

	clk.add(10 * time.Second) // the holder's term has 5 s left
	srv.set(leasedHandler(ctrl, leaseOn(t, dir, clk, nil)))
	clk.add(10 * time.Second) // past the old term; within one from the restart
	ctx := context.Background()
	if _, err := callOnce[[]any](ctx, first, "ListVolumes", empty{}); err != nil {
		t.Fatalf("the holder's call after the target restarted: %v", err)
	}
	if _, err := callOnce[leaseResponse](ctx, first, "Renew", leaseRequest{Holder: "controller-1", Epoch: epochPtr(epoch)}); err != nil {
		t.Fatalf("the holder's renewal after the target restarted: %v", err)
	}
	second.holder = "controller-2"
	err := second.acquire(ctx)
	wantCode(t, "another controller asking after the restart", err, codes.Unavailable)
	if !strings.Contains(err.Error(), "controller-1") {
		t.Fatalf("the refusal does not name the holder: %v", err)
	}
	clk.add(LeaseTerm)
	if err := second.acquire(ctx); err != nil || second.epoch.Load() != epoch+1 {
		t.Fatalf("taking the lease the holder stopped renewing: %v, epoch %d", err, second.epoch.Load())
	}
	// The record is the truth after the next restart too.
	srv.set(leasedHandler(ctrl, leaseOn(t, dir, clk, nil)))
	if l := leaseOf(t, first); l.Holder != "controller-2" || l.Epoch != epoch+1 {
		t.Fatalf("the lease after a second restart: %+v", l)
	}
}

// A record that cannot be read keeps the target from starting: it does
// not know whom to refuse.
func TestUnreadableLeaseRecordIsAnError(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, leaseRecordFile), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := newLease(dir, time.Now, nil)
	if err == nil || !strings.Contains(err.Error(), leaseRecordFile) {
		t.Fatalf("newLease over a corrupt record = %v", err)
	}
}

// slowList is a controller whose ListVolumes runs until its context ends,
// and returns only when let go: a call admitted just before the lease ran
// out, still running.
type slowList struct {
	*block.Controller
	started   chan struct{}
	cancelled chan error
	letGo     chan struct{}
}

func (s *slowList) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	close(s.started)
	<-ctx.Done()
	s.cancelled <- context.Cause(ctx)
	<-s.letGo
	return nil, ctx.Err()
}

// A call admitted before the lease ran out is cancelled when it does, and
// the next holder is admitted only once it has returned: no call of the
// former holder runs next to the successor's. One that ignores its
// cancellation past DrainLimit makes the target give up on it.
func TestInFlightCallDrainsBeforeHandOver(t *testing.T) {
	clk := &clock{t: time.Now()}
	slow := &slowList{Controller: blockController(t), started: make(chan struct{}), cancelled: make(chan error, 1), letGo: make(chan struct{})}
	var stuck []string
	var stuckMu sync.Mutex
	addr := serveUnix(t, leasedHandler(slow, leaseOn(t, "", clk, func(epoch uint64, calls int) {
		stuckMu.Lock()
		defer stuckMu.Unlock()
		stuck = append(stuck, fmt.Sprintf("epoch %d, %d calls", epoch, calls))
	})))
	first, second := dial(t, addr), dial(t, addr)
	hold(t, first, "controller-1")
	answered := make(chan error, 1)
	go func() {
		_, err := callOnce[[]any](context.Background(), first, "ListVolumes", empty{})
		answered <- err
	}()
	<-slow.started

	clk.add(LeaseTerm + time.Second)
	second.holder = "controller-2"
	ctx := context.Background()
	err := second.acquire(ctx)
	wantCode(t, "taking the lease while the former holder's call runs", err, codes.Unavailable)
	if !strings.Contains(err.Error(), "draining 1 calls") {
		t.Fatalf("the refusal does not say what it waits for: %v", err)
	}
	select {
	case cause := <-slow.cancelled:
		if !strings.Contains(fmt.Sprint(cause), "ran out") {
			t.Fatalf("the call was cancelled for %v", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the former holder's call was not cancelled when its lease ran out")
	}
	clk.add(DrainLimit)
	second.acquire(ctx)
	second.acquire(ctx)
	stuckMu.Lock()
	if len(stuck) != 1 || stuck[0] != "epoch 1, 1 calls" {
		t.Fatalf("the stuck function was called %q, want once for epoch 1", stuck)
	}
	stuckMu.Unlock()

	close(slow.letGo)
	err = <-answered
	wantCode(t, "the cancelled call's answer", err, codes.Unavailable)
	if !strings.HasPrefix(status.Convert(err).Message(), notTheHolder) || !strings.Contains(err.Error(), "cancelled") {
		t.Fatalf("the cancelled call's answer does not say why: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for second.acquire(ctx) != nil {
		if time.Now().After(deadline) {
			t.Fatal("the next holder was not admitted once the former holder's call returned")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if second.epoch.Load() != 2 {
		t.Fatalf("the successor's epoch = %d, want 2", second.epoch.Load())
	}
}

// A term that runs out with no one asking for the lease still ends: its
// running calls are cancelled by the term's timer, not at the next
// question.
func TestTermEndsOnItsOwn(t *testing.T) {
	l := leaseOn(t, "", &clock{t: time.Now()}, nil)
	l.now, l.length = time.Now, 200*time.Millisecond
	if _, err := l.acquire(leaseRequest{Holder: "controller-1", Epoch: epochPtr(0)}); err != nil {
		t.Fatal(err)
	}
	term, done, err := l.admit("controller-1", "1")
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	select {
	case <-term.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the term's calls were not cancelled when it ran out")
	}
}

// olderTarget answers as a target of lease version 1 does: no epochs, no
// Lease or Renew, and a request with fields it does not know refused.
func olderTarget(t *testing.T, clk *clock) http.Handler {
	current := leasedHandler(blockController(t), leaseOn(t, "", clk, nil))
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/Lease", http.NotFound)
	mux.HandleFunc("/v1/Renew", http.NotFound)
	mux.HandleFunc("/v1/Info", func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		current.ServeHTTP(rec, r)
		var env envelope
		var info infoResponse
		if jsonDecode(rec.Body, &env) != nil || json.Unmarshal(env.Result, &info) != nil {
			t.Error("Info did not answer")
		}
		info.LeaseVersion = 0
		env.Result, _ = json.Marshal(info)
		writeEnvelope(w, env)
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(epochHeader) != "" {
			t.Errorf("%s sent to a target that knows no epochs", epochHeader)
		}
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), `"epoch"`) || strings.Contains(string(body), `"peer"`) {
			writeEnvelope(w, envelope{Error: &wireError{Code: codes.InvalidArgument, Message: "unknown field"}})
			return
		}
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		current.ServeHTTP(w, r)
	})
	return mux
}

// Controllers and targets of the two lease versions work together, so
// that either may be upgraded first: a controller of this version holds
// an older target's lease as older controllers do, and an older
// controller (no epochs) holds this target's lease, renewing by acquiring.
func TestLeaseVersionsWorkTogether(t *testing.T) {
	clk := &clock{t: time.Now()}
	t.Run("older target", func(t *testing.T) {
		addr := serveUnix(t, olderTarget(t, clk))
		first, second := dial(t, addr), dial(t, addr)
		hold(t, first, "controller-1")
		// Renewed by acquiring, as the older target takes it: the term
		// lasts past the first one's end. callOnce, since call would take
		// a lapsed lease again.
		clk.add(LeaseTerm - time.Second)
		first.renew(context.Background())
		clk.add(LeaseTerm - time.Second)
		if _, err := callOnce[[]any](context.Background(), first, "ListVolumes", empty{}); err != nil {
			t.Fatalf("a call to an older target after renewing: %v", err)
		}
		second.holder = "controller-2"
		wantCode(t, "a second controller", second.acquire(context.Background()), codes.Unavailable)
		first.Close()
		hold(t, second, "controller-2")
	})
	t.Run("older controller", func(t *testing.T) {
		addr := serveLeased(t, clk)
		older, other := dial(t, addr), dial(t, addr)
		older.info.LeaseVersion = 0
		hold(t, older, "controller-1")
		clk.add(LeaseTerm - time.Second)
		older.renew(context.Background())
		clk.add(LeaseTerm - time.Second)
		if _, err := callOnce[[]any](context.Background(), older, "ListVolumes", empty{}); err != nil {
			t.Fatalf("an older controller's call after renewing: %v", err)
		}
		other.holder = "controller-2"
		wantCode(t, "another controller", other.acquire(context.Background()), codes.Unavailable)
		older.Close()
		hold(t, other, "controller-2")
		if l := leaseOf(t, other); l.Epoch != 2 {
			t.Fatalf("the epoch after an older controller's term: %+v", l)
		}
	})
}

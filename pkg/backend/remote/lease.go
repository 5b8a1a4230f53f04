package remote

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// One controller acts on a pool at a time. A controller on the pool's host
// holds the pool's lock file; a controller that reaches the pool through
// its target holds a lease on the target instead: it takes the lease
// before its first call (waiting while another controller holds it),
// renews it while it runs, and gives it back when it stops. The target
// answers every call but Info only for the lease's holder, so a controller
// that lost its lease (it stalled past the lease's term, or was cut off
// while another took over) is refused rather than acting next to its
// successor.

// holderHeader carries the caller's lease holder name on every call.
const holderHeader = "Modeguard-Controller"

// LeaseTerm is how long a lease lasts without a renewal: after a
// controller dies without giving its lease back, the next waits at most
// this long.
const LeaseTerm = 15 * time.Second

// renewEvery is how often a holder renews, well within LeaseTerm.
const renewEvery = LeaseTerm / 3

type leaseRequest struct {
	Holder string `json:"holder"`
}

type leaseResponse struct {
	Holder  string    `json:"holder"`
	Expires time.Time `json:"expires"`
}

// lease is the target's side.
type lease struct {
	mu      sync.Mutex
	holder  string
	expires time.Time
	now     func() time.Time
}

// acquire gives the lease to holder, or renews it, unless another holds
// it unexpired.
func (l *lease) acquire(holder string) (leaseResponse, error) {
	if holder == "" {
		return leaseResponse{}, status.Error(codes.InvalidArgument, "a lease needs a holder name")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if l.holder != "" && l.holder != holder && now.Before(l.expires) {
		return leaseResponse{Holder: l.holder, Expires: l.expires}, status.Errorf(codes.Unavailable,
			"another controller holds this storage target: %s (until %s unless it renews); one controller acts on a pool at a time",
			l.holder, l.expires.Format(time.RFC3339))
	}
	l.holder, l.expires = holder, now.Add(LeaseTerm)
	return leaseResponse{Holder: l.holder, Expires: l.expires}, nil
}

func (l *lease) release(holder string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holder == holder {
		l.holder, l.expires = "", time.Time{}
	}
}

// check lets a call through only from the lease's unexpired holder.
func (l *lease) check(holder string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if holder != "" && holder == l.holder && l.now().Before(l.expires) {
		return nil
	}
	if l.holder == "" || !l.now().Before(l.expires) {
		return status.Errorf(codes.Unavailable, "%s, and %q does not hold it (nobody does)", notTheHolder, holder)
	}
	return status.Errorf(codes.Unavailable, "%s: %s holds it, not %q", notTheHolder, l.holder, holder)
}

// notTheHolder begins every refusal of a call for want of the lease: the
// call was not carried out, and the client may take the lease (if no one
// else holds it) and call again.
const notTheHolder = "this storage target answers only the controller holding its lease"

// leased wraps the API's methods: only the holder gets through.
func (l *lease) leased(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/Info", "/v1/Acquire", "/v1/Release":
		default:
			if err := l.check(r.Header.Get(holderHeader)); err != nil {
				writeEnvelope(w, envelope{Error: toWire(err)})
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// Hold takes the target's lease as holder (a name saying which
// controller: host and pid), waiting while another controller holds it
// and calling waiting with why; then it renews the lease until Close. A
// renewal that fails is logged by the next call's refusal, and retried.
func (c *Client) Hold(ctx context.Context, holder string, waiting func(string)) error {
	c.holder = holder
	for {
		// Each try is bounded: a target that takes connections but does
		// not answer is waited for with a message, not silently.
		try, cancel := context.WithTimeout(ctx, renewEvery)
		_, err := call[leaseResponse](try, c, "Acquire", leaseRequest{Holder: holder})
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
		call[empty](rctx, c, "Release", leaseRequest{Holder: holder})
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
				call[leaseResponse](rctx, c, "Acquire", leaseRequest{Holder: holder})
				cancel()
			}
		}
	}()
	return nil
}

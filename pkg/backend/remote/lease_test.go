package remote

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
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
	return serveUnix(t, handler(blockController(t), clk.now))
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

// A controller that stopped renewing (stalled, cut off) loses the lease
// after its term; once another takes it, the first is refused, even when
// it comes back: it cannot act next to its successor.
func TestStaleControllerIsRefused(t *testing.T) {
	clk := &clock{t: time.Now()}
	addr := serveLeased(t, clk)
	first, second := dial(t, addr), dial(t, addr)
	hold(t, first, "controller-1")
	clk.add(LeaseTerm + time.Second)
	hold(t, second, "controller-2")
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

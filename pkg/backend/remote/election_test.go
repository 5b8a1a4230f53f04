package remote

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/modeguard/modeguard/pkg/election"
)

// electedController is one controller's view of the targets: a client of
// each, acting for its election.
type electedController struct {
	el      *election.Elector
	clients []*Client
	standby []string // why it stepped down, each time
}

func electOver(t *testing.T, holder string, clk *clocktesting.FakeClock, addrs ...string) *electedController {
	t.Helper()
	ec := &electedController{}
	var targets []election.Target
	for _, a := range addrs {
		c := dial(t, a)
		ec.clients = append(ec.clients, c)
		targets = append(targets, c)
	}
	el, err := election.New(election.Config{Holder: holder, Targets: targets, Clock: clk,
		Standby: func(why string) { ec.standby = append(ec.standby, why) }})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range ec.clients {
		c.Elected(holder, "", el.Epoch)
	}
	ec.el = el
	return ec
}

// TestElectionOverRealTargets: two controllers elect over two real
// targets' leases. One acts on both; the other's calls are refused before
// they leave it. When the acting one stops renewing, the other takes both
// leases once the targets' terms ran out, and the first, whose own count
// of its term ended earlier, sends nothing more and steps down when it
// learns it lost them.
func TestElectionOverRealTargets(t *testing.T) {
	targetClock := &clock{t: time.Unix(1_000_000, 0)}
	a1, a2 := serveLeased(t, targetClock), serveLeased(t, targetClock)
	ctrlClock := clocktesting.NewFakeClock(time.Unix(5_000_000, 0))
	step := func(d time.Duration) { targetClock.add(d); ctrlClock.Step(d) }
	ctx := context.Background()

	first := electOver(t, "first", ctrlClock, a1, a2)
	second := electOver(t, "second", ctrlClock, a1, a2)
	first.el.Tick(ctx)
	if !first.el.IsActive() {
		t.Fatal("the first controller did not take the free leases")
	}
	second.el.Tick(ctx)
	if second.el.IsActive() || !second.el.OtherActs() {
		t.Fatalf("the second controller: active %t, knows another acts %t; want a standby that knows", second.el.IsActive(), second.el.OtherActs())
	}
	for i, c := range first.clients {
		if _, err := c.ListVolumes(ctx); err != nil {
			t.Fatalf("the acting controller's call to target %d: %v", i, err)
		}
		_, err := second.clients[i].ListVolumes(ctx)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "not sent") {
			t.Fatalf("the standby's call to target %d = %v, want UNAVAILABLE, not sent", i, err)
		}
	}

	// The first renews for a while: the second keeps waiting.
	for range 30 {
		step(time.Second)
		first.el.Tick(ctx)
		second.el.Tick(ctx)
	}
	if second.el.IsActive() {
		t.Fatal("the standby took over from a controller that renews")
	}

	// The first stalls. Its own count of the term ends 3 s before the
	// targets' does: from then it sends nothing.
	stalled := ctrlClock.Now()
	step(12 * time.Second)
	if _, err := first.clients[0].ListVolumes(ctx); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "not sent") {
		t.Fatalf("the stalled controller's call, its term counted out: %v, want UNAVAILABLE, not sent", err)
	}
	// The second takes both only once the targets' terms have run out.
	for second.el.Tick(ctx); !second.el.IsActive(); second.el.Tick(ctx) {
		if waited := ctrlClock.Since(stalled); waited > 20*time.Second {
			t.Fatalf("the standby did not take over %v after the first stalled", waited)
		}
		step(500 * time.Millisecond)
	}
	if waited := ctrlClock.Since(stalled); waited < LeaseTerm-5*time.Second {
		t.Errorf("the standby took over %v after the first's last renewal, within the term", waited)
	}
	for i, c := range second.clients {
		if e, err := second.el.Epoch(c.Name()); err != nil || e != 2 {
			t.Errorf("the new acting controller on target %d: epoch %d, %v; want 2", i, e, err)
		}
		if _, err := c.ListVolumes(ctx); err != nil {
			t.Errorf("the new acting controller's call to target %d: %v", i, err)
		}
	}

	// The first wakes: its renewal is refused, it steps down, and it
	// sends nothing meanwhile.
	first.el.Tick(ctx)
	if first.el.IsActive() || len(first.standby) != 1 || !strings.Contains(first.standby[0], "lease lost") {
		t.Fatalf("the first controller after waking: active %t, stepped down for %q; want it standby, for a lost lease", first.el.IsActive(), first.standby)
	}
	if _, err := first.clients[1].ListVolumes(ctx); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "not sent") {
		t.Errorf("the former acting controller's call: %v, want UNAVAILABLE, not sent", err)
	}
	// Its stepping down gave back nothing of the second's.
	for i, c := range second.clients {
		if _, err := c.ListVolumes(ctx); err != nil {
			t.Errorf("the acting controller's call to target %d after the first stepped down: %v", i, err)
		}
	}
}

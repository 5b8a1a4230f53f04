package keylock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestTryLockTakesAllOrNone(t *testing.T) {
	var s Set
	unlockA, busy := s.TryLock("a")
	if unlockA == nil || busy != "" {
		t.Fatalf("TryLock(a) on a free set: busy %q", busy)
	}
	if u, busy := s.TryLock("b", "a"); u != nil || busy != "a" {
		t.Fatalf("TryLock(b, a) with a held: unlock %v, busy %q; want none taken, a busy", u != nil, busy)
	}
	// b was not kept by the failed attempt.
	unlockB, busy := s.TryLock("b")
	if unlockB == nil {
		t.Fatalf("b is %q after a TryLock that failed on a", busy)
	}
	unlockA()
	unlockB()
	if n := s.Len(); n != 0 {
		t.Fatalf("%d keys left in an idle set", n)
	}
}

func TestLockWaitsAndExcludes(t *testing.T) {
	var s Set
	var inside, most atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				unlock, err := s.Lock(context.Background(), "v", "v")
				if err != nil {
					t.Error(err)
					return
				}
				if n := inside.Add(1); n > most.Load() {
					most.Store(n)
				}
				inside.Add(-1)
				unlock()
			}
		}()
	}
	wg.Wait()
	if most.Load() != 1 {
		t.Fatalf("%d holders of one key at once", most.Load())
	}
	if n := s.Len(); n != 0 {
		t.Fatalf("%d keys left in an idle set", n)
	}
}

func TestLockGivesUpWithItsContextAndKeepsNothing(t *testing.T) {
	var s Set
	held := s.Hold("b")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.Lock(ctx, "a", "b"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Lock(a, b) with b held: %v, want the context's error", err)
	}
	// a was released when the wait for b gave up.
	if u, busy := s.TryLock("a"); u == nil {
		t.Fatalf("a is %q after a Lock that gave up", busy)
	} else {
		u()
	}
	// A free key is taken even with an ended context.
	held()
	if u, err := s.Lock(ctx, "b"); err != nil {
		t.Fatalf("Lock of a free key with an ended context: %v", err)
	} else {
		u()
	}
	if n := s.Len(); n != 0 {
		t.Fatalf("%d keys left in an idle set", n)
	}
}

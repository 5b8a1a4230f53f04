package driver

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestOpLocks(t *testing.T) {
	l := newOpLocks()
	releaseA, err := l.acquire("vol-a")
	if err != nil {
		t.Fatalf("first acquire: %v", err)
	}
	if _, err := l.acquire("vol-a"); status.Code(err) != codes.Aborted {
		t.Fatalf("second acquire of a busy key = %v, want Aborted", err)
	} else if !strings.Contains(status.Convert(err).Message(), "vol-a") {
		t.Errorf("message %q does not name the busy key", status.Convert(err).Message())
	}

	// All or nothing: a set with one busy key takes none of them.
	if _, err := l.acquire("name x", "vol-b", "vol-a"); status.Code(err) != codes.Aborted {
		t.Fatalf("acquire of a set holding a busy key = %v, want Aborted", err)
	}
	releaseB, err := l.acquire("vol-b")
	if err != nil {
		t.Fatalf("vol-b was taken by a failed multi-key acquire: %v", err)
	}
	releaseX, err := l.acquire("name x")
	if err != nil {
		t.Fatalf("name x was taken by a failed multi-key acquire: %v", err)
	}
	releaseX()
	releaseB()

	// Other keys are independent of a busy one.
	releaseC, err := l.acquire("vol-c")
	if err != nil {
		t.Fatalf("acquire of an idle key while another is busy: %v", err)
	}
	releaseC()

	// Release frees.
	releaseA()
	releaseA2, err := l.acquire("vol-a")
	if err != nil {
		t.Fatalf("acquire after release: %v", err)
	}
	releaseA2()

	// A multi-key acquire takes every key, and its release frees every key.
	releaseAll, err := l.acquire("k1", "k2", "k3")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"k1", "k2", "k3"} {
		if _, err := l.acquire(k); status.Code(err) != codes.Aborted {
			t.Errorf("%s not taken by the multi-key acquire: %v", k, err)
		}
	}
	releaseAll()
	for _, k := range []string{"k1", "k2", "k3"} {
		r, err := l.acquire(k)
		if err != nil {
			t.Errorf("%s not freed by the multi-key release: %v", k, err)
			continue
		}
		r()
	}
	if n := l.set.Len(); n != 0 {
		t.Errorf("%d keys still busy after every release", n)
	}
}

// TestOpLocksExclusive hammers one key from many goroutines: never two
// holders at once, and each attempt either holds it or gets Aborted.
func TestOpLocksExclusive(t *testing.T) {
	l := newOpLocks()
	var holders, maxHolders, won atomic.Int32
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				release, err := l.acquire("shared", "other-"+string(rune('a'+i%3)))
				if err != nil {
					if status.Code(err) != codes.Aborted {
						t.Errorf("acquire: %v, want Aborted", err)
					}
					continue
				}
				n := holders.Add(1)
				for {
					m := maxHolders.Load()
					if n <= m || maxHolders.CompareAndSwap(m, n) {
						break
					}
				}
				won.Add(1)
				holders.Add(-1)
				release()
			}
		}()
	}
	wg.Wait()
	if m := maxHolders.Load(); m != 1 {
		t.Errorf("at most %d goroutines held the key at once, want exactly 1", m)
	}
	if won.Load() == 0 {
		t.Error("nobody ever got the key")
	}
}

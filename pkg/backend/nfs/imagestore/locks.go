package imagestore

import (
	"context"
	"fmt"
	"slices"
	"sync"
)

// relLocks is a mutex per rel, taken and released on demand, whose waits
// end with the caller's context.
type relLocks struct {
	mu    sync.Mutex
	locks map[string]*relLock
}

type relLock struct {
	ch   chan struct{} // holds a value while the lock is held
	refs int           // holders and waiters; the entry goes at zero
}

// lock takes the locks of rels in sorted order (so two callers that want
// the same pair cannot deadlock) and returns the function that releases
// them all.
func (l *relLocks) lock(ctx context.Context, rels ...string) (func(), error) {
	keys := slices.Clone(rels)
	slices.Sort(keys)
	keys = slices.Compact(keys)
	var held []string
	unlock := func() {
		for i := len(held) - 1; i >= 0; i-- {
			l.release(held[i])
		}
	}
	for _, k := range keys {
		e := l.ref(k)
		// A free lock is taken whatever the context says, so that what
		// happens with an ended context does not depend on chance.
		select {
		case e.ch <- struct{}{}:
			held = append(held, k)
			continue
		default:
		}
		select {
		case e.ch <- struct{}{}:
			held = append(held, k)
		case <-ctx.Done():
			l.unref(k)
			unlock()
			return nil, fmt.Errorf("imagestore: waiting for other work on %s: %w", k, ctx.Err())
		}
	}
	return unlock, nil
}

func (l *relLocks) ref(k string) *relLock {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.locks == nil {
		l.locks = map[string]*relLock{}
	}
	e := l.locks[k]
	if e == nil {
		e = &relLock{ch: make(chan struct{}, 1)}
		l.locks[k] = e
	}
	e.refs++
	return e
}

func (l *relLocks) unref(k string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.locks[k]; e != nil {
		if e.refs--; e.refs == 0 {
			delete(l.locks, k)
		}
	}
}

func (l *relLocks) release(k string) {
	l.mu.Lock()
	e := l.locks[k]
	l.mu.Unlock()
	<-e.ch
	l.unref(k)
}

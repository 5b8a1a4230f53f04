// Package keylock is a lock per key (a volume id, a name, a path), made on
// demand and dropped once nobody holds or waits for it, so that work on
// different volumes never waits for each other and the set does not grow
// with every volume ever seen.
package keylock

import (
	"context"
	"slices"
	"sync"
)

// Set is a set of per-key locks. The zero value is ready to use.
type Set struct {
	mu    sync.Mutex
	locks map[string]*entry
}

type entry struct {
	ch   chan struct{} // holds a value while the lock is held
	refs int           // holders and waiters; the entry goes at zero
}

// keys sorts and deduplicates: two callers that want the same keys take
// them in the same order and cannot deadlock.
func sorted(keys []string) []string {
	out := slices.Clone(keys)
	slices.Sort(out)
	return slices.Compact(out)
}

// Lock takes every key, waiting as long as ctx allows, and returns the
// function that releases them all. A free lock is taken whatever ctx says,
// so that what happens with an ended context does not depend on chance; if
// ctx ends while it waits, Lock releases what it took and returns ctx's
// error.
func (s *Set) Lock(ctx context.Context, keys ...string) (unlock func(), err error) {
	var held []string
	unlock = func() { s.releaseAll(held) }
	for _, k := range sorted(keys) {
		e := s.ref(k)
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
			s.unref(k)
			unlock()
			return nil, ctx.Err()
		}
	}
	return unlock, nil
}

// Hold takes key, waiting as long as it takes.
func (s *Set) Hold(key string) (unlock func()) {
	unlock, _ = s.Lock(context.Background(), key)
	return unlock
}

// TryLock takes every key or none, without waiting. When one is taken it
// returns that key as busy and a nil unlock.
func (s *Set) TryLock(keys ...string) (unlock func(), busy string) {
	var held []string
	for _, k := range sorted(keys) {
		e := s.ref(k)
		select {
		case e.ch <- struct{}{}:
			held = append(held, k)
		default:
			s.unref(k)
			s.releaseAll(held)
			return nil, k
		}
	}
	return func() { s.releaseAll(held) }, ""
}

func (s *Set) ref(k string) *entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.locks == nil {
		s.locks = map[string]*entry{}
	}
	e := s.locks[k]
	if e == nil {
		e = &entry{ch: make(chan struct{}, 1)}
		s.locks[k] = e
	}
	e.refs++
	return e
}

func (s *Set) unref(k string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.locks[k]; e != nil {
		if e.refs--; e.refs == 0 {
			delete(s.locks, k)
		}
	}
}

func (s *Set) releaseAll(held []string) {
	for i := len(held) - 1; i >= 0; i-- {
		s.mu.Lock()
		e := s.locks[held[i]]
		s.mu.Unlock()
		<-e.ch
		s.unref(held[i])
	}
}

// Len is how many keys are held or waited for: zero when the set is idle.
func (s *Set) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.locks)
}

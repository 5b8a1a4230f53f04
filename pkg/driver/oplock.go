package driver

import (
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// opLocks serializes calls per volume (or snapshot, or name) without a
// global lock: a call that finds its key busy is answered ABORTED at once,
// which the spec defines as "operation pending, retry".
type opLocks struct {
	mu   sync.Mutex
	busy map[string]struct{}
}

func newOpLocks() *opLocks { return &opLocks{busy: map[string]struct{}{}} }

// acquire takes every key or none, and returns the function that releases them.
func (l *opLocks) acquire(keys ...string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range keys {
		if _, taken := l.busy[k]; taken {
			return nil, status.Errorf(codes.Aborted, "an operation on %s is already in progress; retry later", k)
		}
	}
	for _, k := range keys {
		l.busy[k] = struct{}{}
	}
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, k := range keys {
			delete(l.busy, k)
		}
	}, nil
}

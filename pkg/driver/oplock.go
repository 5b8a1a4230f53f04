package driver

// Per-volume operation locks: a second call on a volume in flight is
// ABORTED at once rather than queued.

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/keylock"
)

// opLocks serializes calls per volume (or snapshot, or name) without a
// global lock: a call that finds its key busy is answered ABORTED at once,
// which the spec defines as "operation pending, retry".
type opLocks struct{ set keylock.Set }

func newOpLocks() *opLocks { return &opLocks{} }

// acquire takes every key or none, and returns the function that releases them.
func (l *opLocks) acquire(keys ...string) (func(), error) {
	unlock, busy := l.set.TryLock(keys...)
	if unlock == nil {
		return nil, status.Errorf(codes.Aborted, "an operation on %s is already in progress; retry later", busy)
	}
	return unlock, nil
}

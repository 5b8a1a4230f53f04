package testenv

import (
	"context"
	"testing"
	"time"
)

// cleanupMargin is what Context leaves of the test binary's time for a
// failing test's cleanup: logs, VMs and processes stopped.
const cleanupMargin = time.Minute

// Context is a test's context for a long series of steps on slow parts
// (VMs under software emulation): it ends a minute before the test
// binary's -timeout, or after fallback without one, and with the test.
// A fixed budget of its own would fail the test whenever the machine is
// busy (a cold build beside it can double the time VMs take) while the
// steps themselves are all still progressing; a step that hangs is bounded
// by its own timeout, or by this one.
func Context(t testing.TB, fallback time.Duration) context.Context {
	deadline := time.Now().Add(fallback)
	if tt, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if d, ok := tt.Deadline(); ok {
			deadline = d.Add(-cleanupMargin)
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	t.Cleanup(cancel)
	return ctx
}

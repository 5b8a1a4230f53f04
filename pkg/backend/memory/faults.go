package memory

// Fault injection: what a test of the driver sets up to see how it copes
// with a backend that fails, is slow, or is busy at a chosen moment.

import (
	"context"
	"fmt"
	"reflect"
	"sync"
	"time"

	"google.golang.org/grpc/status"
)

// Faults holds, per method name ("CreateVolume", "Stage"), the errors its
// next calls return, a delay before each call acts and a hook each call
// runs first, and counts the calls. The zero value injects nothing; it is
// safe for concurrent use.
type Faults struct {
	methods map[string]bool // the names a fault may be set for

	mu     sync.Mutex
	next   map[string][]error
	delays map[string]time.Duration
	hooks  map[string]func(ctx context.Context) error
	calls  map[string]int
}

// newFaults accepts faults for the methods of the interface iface points
// to, so that a misspelt name fails the test that set it, not silently.
func newFaults(iface any) Faults {
	t := reflect.TypeOf(iface).Elem()
	methods := make(map[string]bool, t.NumMethod())
	for i := range t.NumMethod() {
		methods[t.Method(i).Name] = true
	}
	return Faults{methods: methods}
}

func (f *Faults) check(method string) {
	if !f.methods[method] {
		panic(fmt.Sprintf("memory: no method %q to inject a fault into", method))
	}
}

// FailNext makes the next call of method return err without acting;
// several FailNext calls queue up, one error per call.
func (f *Faults) FailNext(method string, err error) {
	f.check(method)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.next == nil {
		f.next = map[string][]error{}
	}
	f.next[method] = append(f.next[method], err)
}

// Delay makes every call of method wait d before it acts (0: no more),
// or until its context ends, which it then answers as gRPC would.
func (f *Faults) Delay(method string, d time.Duration) {
	f.check(method)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.delays == nil {
		f.delays = map[string]time.Duration{}
	}
	f.delays[method] = d
}

// Hook makes every call of method run fn before it acts (nil: no more);
// an error fn returns is the call's answer. fn runs without any lock of
// the backend held, so it may block until the test lets it go, or call
// the backend itself.
func (f *Faults) Hook(method string, fn func(ctx context.Context) error) {
	f.check(method)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hooks == nil {
		f.hooks = map[string]func(context.Context) error{}
	}
	f.hooks[method] = fn
}

// Calls is how many times method was called, faults included.
func (f *Faults) Calls(method string) int {
	f.check(method)
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[method]
}

// enter counts a call of method and applies its faults: the hook, the
// delay, then a queued error.
func (f *Faults) enter(ctx context.Context, method string) error {
	f.mu.Lock()
	if f.calls == nil {
		f.calls = map[string]int{}
	}
	f.calls[method]++
	hook, delay := f.hooks[method], f.delays[method]
	f.mu.Unlock()
	if hook != nil {
		if err := hook(ctx); err != nil {
			return err
		}
	}
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if queued := f.next[method]; len(queued) > 0 {
		f.next[method] = queued[1:]
		return queued[0]
	}
	return nil
}

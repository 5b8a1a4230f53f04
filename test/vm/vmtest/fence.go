package vmtest

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// FenceRecord is the n-th record a fenced writer appends: fixed width, so
// record n starts at n*len(FenceRecord(0)).
func FenceRecord(n int) string { return fmt.Sprintf("record %06d\n", n) }

// FencedWriter is a process on a node VM writing and fsyncing records
// through the LockHolder's open file while the node is fenced.
type FencedWriter struct {
	Holder   *LockHolder
	Acked    int   // records whose write and fsync succeeded, in order
	InFlight error // how the write in flight at the fence ended
	FencedAt time.Time
}

// Write writes and fsyncs record n, bounded by a minute.
func (w *FencedWriter) Write(ctx context.Context, n int) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	line := FenceRecord(n)
	return w.Holder.Write(ctx, int64(n*len(line)), []byte(line))
}

// WriteThroughFence writes records 0, 1, 2 (each must succeed), runs
// beforeFence (if set), then keeps writing while, a second later, fence
// runs (the CO's force-detach); it returns once the write in flight when
// fence returned has ended. It is an error if that takes more than two
// minutes, or if a write started after fence returned succeeds.
func WriteThroughFence(ctx context.Context, holder *LockHolder, beforeFence func(), fence func() error) (*FencedWriter, error) {
	w := &FencedWriter{Holder: holder}
	for n := range 3 {
		if err := w.Write(ctx, n); err != nil {
			return nil, fmt.Errorf("writing record %d before the fence: %w", n, err)
		}
	}
	if beforeFence != nil {
		beforeFence()
	}
	type result struct {
		acked  int
		failed error
	}
	stop, done := make(chan struct{}), make(chan result, 1)
	go func() {
		for n := 3; ; n++ {
			select {
			case <-stop:
				done <- result{acked: n}
				return
			default:
			}
			if err := w.Write(ctx, n); err != nil {
				done <- result{acked: n, failed: err}
				return
			}
		}
	}()
	time.Sleep(time.Second) // a few records under way
	err := fence()
	w.FencedAt = time.Now()
	close(stop)
	select {
	case r := <-done:
		w.Acked, w.InFlight = r.acked, r.failed
	case <-time.After(2 * time.Minute):
		return nil, fmt.Errorf("the write in flight at the fence neither finished nor failed within 2 minutes")
	}
	if err != nil {
		return w, fmt.Errorf("the fence: %w", err)
	}
	if err := w.Write(ctx, w.Acked); err == nil {
		return w, fmt.Errorf("record %d was written and fsync'd after the fence", w.Acked)
	}
	return w, nil
}

// CheckJournal says what is wrong with got, the journal as the next node
// reads it, unless it is exactly the records fsync'd before the fence, or
// those and the one whose fsync failed at the fence (it may have reached
// the server just before); and then the extra records the next node
// appended.
func (w *FencedWriter) CheckJournal(got []byte, extra int) error {
	var want strings.Builder
	for n := range w.Acked {
		want.WriteString(FenceRecord(n))
	}
	withInFlight := want.String() + FenceRecord(w.Acked)
	for n := w.Acked; n < w.Acked+extra; n++ {
		want.WriteString(FenceRecord(n))
	}
	switch {
	case string(got) == want.String():
	case extra == 0 && w.InFlight != nil && string(got) == withInFlight:
	default:
		tail := string(got)
		if len(tail) > 40 {
			tail = tail[len(tail)-40:]
		}
		return fmt.Errorf("the journal holds %d bytes ending %q; want the %d records fsync'd before the fence and %d after (%d bytes)",
			len(got), tail, w.Acked, extra, want.Len())
	}
	return nil
}

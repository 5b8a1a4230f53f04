package nfs

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/backend"
)

// CreateSnapshotGroup takes a group of volumes of which several are being
// written at one instant where the server can be held still for copies
// (the quota storage with the driver's own ganesha): every member's copy
// is prepared, then the server is held still once while all of their
// trees are read, so no member holds a write the server acknowledged
// after one missing from another. Elsewhere, and for groups with at most
// one writer, the members are taken one after the other
// (backend.SnapshotOneAtATime), which refuses several writers: each
// image's frozen filesystem is its own instant.
func (c *Controller) CreateSnapshotGroup(ctx context.Context, members []backend.GroupMember) ([]*backend.Snapshot, error) {
	sources := make([]*backend.Volume, len(members))
	writing := 0
	for i, m := range members {
		rec, err := c.record(m.Source)
		if err != nil {
			return nil, err
		}
		sources[i] = &rec.Volume
		if len(backend.Writers(&rec.Volume)) > 0 {
			writing++
		}
	}
	if writing <= 1 || c.cfg.Storage.CopiesAtOnePoint() {
		return backend.SnapshotOneAtATime(ctx, c, members)
	}
	for _, src := range sources {
		if _, err := c.copyable(src); err != nil {
			// Not a storage that copies while the server is held still:
			// the writers get the refusal that names them all.
			return backend.SnapshotOneAtATime(ctx, c, members)
		}
	}
	pc := c.cfg.Storage.(PausedCopier) // copyable checked

	projects := make([]uint32, len(members))
	for i, m := range members {
		_, project, err := c.reserve(ctx, m.ID.String(), false, sources[i].CapacityBytes)
		if err != nil {
			for j := range i {
				c.release(0, projects[j], sources[j].CapacityBytes)
			}
			return nil, err
		}
		projects[i] = project
	}

	// Each member's copy runs in a goroutine of its own up to the step
	// that reads its source, and hands that step over; once all have (or
	// one failed before), the reads run under one hold of the server.
	type handover struct {
		read func(context.Context) error
		done chan error
	}
	arrived := make(chan handover)             // unbuffered: once abandoned, no copy hands its read over
	early := make(chan struct{}, len(members)) // a copy that ended before its read
	abandon := make(chan struct{})
	errs := make([]error, len(members))
	var wg sync.WaitGroup
	for i, m := range members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reached := false
			errs[i] = pc.CopyPaused(ctx, c.volumeRel(m.Source), c.snapshotRel(m.ID), projects[i], sources[i].CapacityBytes,
				func(ctx context.Context, read func(context.Context) error) error {
					reached = true
					h := handover{read: read, done: make(chan error, 1)}
					select {
					case arrived <- h:
					case <-abandon:
						return errGroupAbandoned
					}
					return <-h.done
				})
			if !reached {
				early <- struct{}{}
			}
		}()
	}

	var reads []handover
	failedEarly := false
	for len(reads) < len(members) && !failedEarly {
		select {
		case h := <-arrived:
			reads = append(reads, h)
		case <-early:
			failedEarly = true
		}
	}
	if !failedEarly {
		results := make([]error, len(reads))
		err := c.whilePaused(ctx, fmt.Sprintf("a group of %d volumes", len(members)), func(rctx context.Context) error {
			for i, h := range reads {
				if results[i] = h.read(rctx); results[i] != nil {
					return results[i]
				}
			}
			return nil
		})
		for i, h := range reads {
			if err != nil && results[i] == nil {
				results[i] = err
			}
			h.done <- results[i]
		}
	} else {
		close(abandon)
		for _, h := range reads {
			h.done <- errGroupAbandoned
		}
	}
	wg.Wait()
	for i := range members {
		c.settle(ctx, c.volumeRel(members[i].Source))
	}

	var failed error
	for i, err := range errs {
		if err != nil && (failed == nil || errors.Is(failed, errGroupAbandoned)) {
			failed = err
			if cerr := c.copyError(members[i].Source.String(), err); cerr != nil {
				failed = cerr
			} else if !errors.Is(err, errGroupAbandoned) {
				failed = status.Errorf(codes.Internal, "copying %s: %v", members[i].Source, err)
			}
		}
	}
	if failed != nil {
		for i, err := range errs {
			if err == nil {
				_ = c.cfg.Storage.Remove(context.WithoutCancel(ctx), c.snapshotRel(members[i].ID), projects[i])
			}
			c.release(0, projects[i], sources[i].CapacityBytes)
		}
		return nil, failed
	}
	out := make([]*backend.Snapshot, 0, len(members))
	for i, m := range members {
		snap, err := c.recordSnapshot(ctx, m.ID, m.Name, sources[i], projects[i])
		if err != nil {
			for j := i + 1; j < len(members); j++ {
				_ = c.cfg.Storage.Remove(context.WithoutCancel(ctx), c.snapshotRel(members[j].ID), projects[j])
				c.release(0, projects[j], sources[j].CapacityBytes)
			}
			backend.DropGroup(ctx, c, out)
			return nil, err
		}
		out = append(out, snap)
	}
	return out, nil
}

// errGroupAbandoned ends a member's copy when another's failed before the
// server was held still for them all.
var errGroupAbandoned = errors.New("another member of the group could not be copied")

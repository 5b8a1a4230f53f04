package remote

import (
	"context"
	"net/http"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/netfence"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// The requests of the methods that take more than nothing.
type (
	infoResponse struct {
		Backend     accessmode.Backend `json:"backend"`
		Zones       []string           `json:"zones"`
		MinimumSize int64              `json:"minimumSize"`
		// LeaseVersion is the version of the target's lease (see
		// leaseVersion); absent from targets of version 1.
		LeaseVersion int `json:"leaseVersion,omitempty"`
	}
	empty     struct{}
	idRequest struct {
		ID volumeid.ID `json:"id"`
	}
	zoneRequest struct {
		Zone string `json:"zone"`
	}
	nodeRequest struct {
		Node string `json:"node"`
	}
	attachmentsRequest struct {
		ID          volumeid.ID             `json:"id"`
		Attachments []accessmode.Attachment `json:"attachments"`
	}
	expandRequest struct {
		ID    volumeid.ID `json:"id"`
		Bytes int64       `json:"bytes"`
	}
	modifyRequest struct {
		ID      volumeid.ID       `json:"id"`
		Mutable map[string]string `json:"mutable"`
	}
	snapshotRequest struct {
		ID     volumeid.ID `json:"id"`
		Name   string      `json:"name"`
		Source volumeid.ID `json:"source"`
	}
)

// wireSnapshot carries what a snapshot's record leaves out: whether its
// data is still being copied (ready_to_use is false until it is).
type wireSnapshot struct {
	backend.Snapshot
	Cutting bool `json:"cutting"`
}

func toWireSnapshot(s *backend.Snapshot, err error) (*wireSnapshot, error) {
	if err != nil || s == nil {
		return nil, err
	}
	return &wireSnapshot{Snapshot: *s, Cutting: s.Cutting}, nil
}

func fromWireSnapshot(w *wireSnapshot, err error) (*backend.Snapshot, error) {
	if err != nil || w == nil {
		return nil, err
	}
	s := w.Snapshot
	s.Cutting = w.Cutting
	return &s, nil
}

// Handler serves c with its lease in memory: a restart forgets the
// holder. Tests and a target on the controller's own host use it; a
// storage target uses NewHandler.
func Handler(c backend.Controller) http.Handler {
	l, _ := newLease("", time.Now, nil)
	f, _ := newFenceRecord("")
	return handler(c, l, f)
}

// ServerConfig is what a storage target's handler keeps across restarts
// and does when stuck.
type ServerConfig struct {
	// StateDir holds the lease's record (a restarted target still knows
	// which controller holds it) and the controller's network fence list.
	// It must be on the target's own disk, and locked by the process (as
	// its pools are).
	StateDir string
}

// NewHandler serves c. Authentication is the listener's (TLS with client
// certificates, or a unix socket only root may open): the handler takes
// every request that reaches it as a controller's, and answers one
// controller at a time, the holder of its lease (see Client.Hold). Calls
// of a former holder that do not return within DrainLimit of its
// successor asking for the lease make the process exit.
func NewHandler(c backend.Controller, cfg ServerConfig) (http.Handler, error) {
	l, err := newLease(cfg.StateDir, time.Now, exitWhenStuck)
	if err != nil {
		return nil, err
	}
	f, err := newFenceRecord(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	return handler(c, l, f), nil
}

func handler(c backend.Controller, l *lease, f *fenceRecord) http.Handler {
	mux := http.NewServeMux()
	handle(mux, "Lease", func(context.Context, empty) (leaseResponse, error) { return l.state(), nil })
	handle(mux, "Acquire", func(_ context.Context, r leaseRequest) (leaseResponse, error) { return l.acquire(r) })
	handle(mux, "Renew", func(_ context.Context, r leaseRequest) (leaseResponse, error) { return l.renew(r) })
	handle(mux, "Release", func(_ context.Context, r leaseRequest) (empty, error) { return empty{}, l.release(r) })
	handle(mux, "Info", func(context.Context, empty) (infoResponse, error) {
		return infoResponse{Backend: c.Backend(), Zones: c.Zones(), MinimumSize: c.MinimumSize(), LeaseVersion: leaseVersion}, nil
	})
	handle(mux, "Fences", func(context.Context, empty) (wireFences, error) {
		s := f.load()
		return wireFences{Stored: s, Found: s.Found}, nil
	})
	handle(mux, "StoreFences", func(_ context.Context, s netfence.Stored) (empty, error) { return empty{}, f.store(s) })
	handle(mux, "NodeExpansionRequired", func(_ context.Context, v backend.Volume) (bool, error) {
		return c.NodeExpansionRequired(&v), nil
	})
	handle(mux, "Capacity", func(ctx context.Context, r zoneRequest) (int64, error) { return c.Capacity(ctx, r.Zone) })
	handle(mux, "Pools", func(ctx context.Context, _ empty) ([]backend.PoolStats, error) { return c.Pools(ctx) })
	handle(mux, "CreateVolume", c.CreateVolume)
	handle(mux, "Creating", func(ctx context.Context, r idRequest) (bool, error) { return c.Creating(ctx, r.ID) })
	handle(mux, "ZonesFillableFrom", func(ctx context.Context, r zoneRequest) ([]string, error) {
		return c.ZonesFillableFrom(ctx, r.Zone)
	})
	handle(mux, "SnapshotBlocks", c.SnapshotBlocks)
	handle(mux, "Volume", func(ctx context.Context, r idRequest) (*backend.Volume, error) { return c.Volume(ctx, r.ID) })
	handle(mux, "DeleteVolume", func(ctx context.Context, r idRequest) (empty, error) { return empty{}, c.DeleteVolume(ctx, r.ID) })
	handle(mux, "SetAttachments", func(ctx context.Context, r attachmentsRequest) (*backend.Volume, error) {
		return c.SetAttachments(ctx, r.ID, r.Attachments)
	})
	handle(mux, "ExpandVolume", func(ctx context.Context, r expandRequest) (*backend.Volume, error) {
		return c.ExpandVolume(ctx, r.ID, r.Bytes)
	})
	handle(mux, "ModifyVolume", func(ctx context.Context, r modifyRequest) (*backend.Volume, error) {
		return c.ModifyVolume(ctx, r.ID, r.Mutable)
	})
	handle(mux, "ListVolumes", func(ctx context.Context, _ empty) ([]*backend.Volume, error) { return c.ListVolumes(ctx) })
	handle(mux, "VolumesOn", func(ctx context.Context, r nodeRequest) ([]*backend.Volume, error) { return c.VolumesOn(ctx, r.Node) })
	handle(mux, "VolumeHealth", func(ctx context.Context, r idRequest) (backend.Health, error) { return c.VolumeHealth(ctx, r.ID) })
	handle(mux, "CreateSnapshot", func(ctx context.Context, r snapshotRequest) (*wireSnapshot, error) {
		return toWireSnapshot(c.CreateSnapshot(ctx, r.ID, r.Name, r.Source))
	})
	handle(mux, "CreateSnapshotGroup", func(ctx context.Context, members []backend.GroupMember) ([]*wireSnapshot, error) {
		list, err := c.CreateSnapshotGroup(ctx, members)
		if err != nil {
			return nil, err
		}
		out := make([]*wireSnapshot, len(list))
		for i, s := range list {
			out[i], _ = toWireSnapshot(s, nil)
		}
		return out, nil
	})
	handle(mux, "Snapshot", func(ctx context.Context, r idRequest) (*wireSnapshot, error) {
		return toWireSnapshot(c.Snapshot(ctx, r.ID))
	})
	handle(mux, "DeleteSnapshot", func(ctx context.Context, r idRequest) (empty, error) { return empty{}, c.DeleteSnapshot(ctx, r.ID) })
	handle(mux, "ListSnapshots", func(ctx context.Context, _ empty) ([]*wireSnapshot, error) {
		list, err := c.ListSnapshots(ctx)
		if err != nil {
			return nil, err
		}
		out := make([]*wireSnapshot, len(list))
		for i, s := range list {
			out[i], _ = toWireSnapshot(s, nil)
		}
		return out, nil
	})
	return l.leased(mux)
}

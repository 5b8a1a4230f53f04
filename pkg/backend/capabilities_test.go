package backend_test

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/backend/zoned"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// capabilities answers every controller capability as a backend that has
// it, in ways a wrapper's own answers (none: false, nil) cannot match by
// chance. A capability added to backend.ControllerCapabilities must be
// given here before this compiles.
type capabilities struct {
	creating volumeid.ID // the volume being created in the background
	blocks   bool        // whether it answers block metadata
	groups   bool        // whether it takes group snapshots
	fillable []string    // the zones it fills from a source of its own
}

var _ backend.ControllerCapabilities = capabilities{}

func (c capabilities) Creating(_ context.Context, id volumeid.ID) (bool, error) {
	return id == c.creating, nil
}

// SnapshotBlocks answers a page made of the request, so that a wrapper
// that loses part of it on the way is seen to.
func (c capabilities) SnapshotBlocks(_ context.Context, req backend.BlockRangesRequest) (*backend.BlockRanges, error) {
	if !c.blocks {
		return nil, nil
	}
	return &backend.BlockRanges{CapacityBytes: 1 << 30, Ranges: []backend.BlockRange{{Offset: req.From, Length: int64(req.Limit)}},
		Done: req.Delta()}, nil
}

// CreateSnapshotGroup answers a snapshot per member, made of the request
// (one still being cut), so that a wrapper that loses a member, a field or
// the Cutting flag on the way is seen to.
func (c capabilities) CreateSnapshotGroup(_ context.Context, members []backend.GroupMember) ([]*backend.Snapshot, error) {
	if !c.groups {
		return nil, nil
	}
	out := make([]*backend.Snapshot, 0, len(members))
	for i, m := range members {
		out = append(out, &backend.Snapshot{ID: m.ID.String(), Name: m.Name, SourceVolumeID: m.Source.String(), Cutting: i == 0})
	}
	return out, nil
}

// ZonesFillableFrom answers zones no wrapper knows of, for its own zone
// only, so that a wrapper that asks another part, or answers itself, is
// seen to.
func (c capabilities) ZonesFillableFrom(_ context.Context, sourceZone string) ([]string, error) {
	if len(c.fillable) == 0 || sourceZone != c.fillable[0] {
		return nil, nil
	}
	return slices.Clone(c.fillable), nil
}

// basics stands for what every controller does; nil, as no probe asks it.
// It sits one level deeper in capableController than capabilities, so that
// the capabilities' methods are the ones promoted.
type basics struct{ backend.Controller }

// capableController is the block controller of one zone with every
// capability on.
type capableController struct {
	basics
	capabilities
	zone string
}

func (c *capableController) Backend() accessmode.Backend { return accessmode.BackendBlock }
func (c *capableController) Zones() []string             { return []string{c.zone} }
func (c *capableController) MinimumSize() int64          { return 0 }

func volumeIn(t *testing.T, zone string) volumeid.ID {
	return objectIn(t, zone, volumeid.Volume, "probed")
}

func objectIn(t *testing.T, zone string, kind volumeid.Kind, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendBlock, zone, kind, volumeid.KeyFor("test", kind, name))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// controllerProbe asks a controller capability a question that a
// controller with it answers otherwise than one without (without).
type controllerProbe struct {
	capability string // its method in backend.ControllerCapabilities
	ask        func(context.Context, *testing.T, backend.Controller) (any, error)
	without    any
}

var controllerProbes = []controllerProbe{
	{"Creating", func(ctx context.Context, t *testing.T, c backend.Controller) (any, error) {
		return c.Creating(ctx, volumeIn(t, "zone-a"))
	}, false},
	{"SnapshotBlocks", func(ctx context.Context, t *testing.T, c backend.Controller) (any, error) {
		return c.SnapshotBlocks(ctx, backend.BlockRangesRequest{
			Base:   objectIn(t, "zone-a", volumeid.Snapshot, "base"),
			Target: objectIn(t, "zone-a", volumeid.Snapshot, "target"),
			From:   4096, Limit: 3,
		})
	}, (*backend.BlockRanges)(nil)},
	{"CreateSnapshotGroup", func(ctx context.Context, t *testing.T, c backend.Controller) (any, error) {
		var members []backend.GroupMember
		for _, name := range []string{"log", "data"} {
			members = append(members, backend.GroupMember{ID: objectIn(t, "zone-a", volumeid.Snapshot, name), Name: "group/2/" + name,
				Source: objectIn(t, "zone-a", volumeid.Volume, name)})
		}
		return c.CreateSnapshotGroup(ctx, members)
	}, ([]*backend.Snapshot)(nil)},
	{"ZonesFillableFrom", func(ctx context.Context, t *testing.T, c backend.Controller) (any, error) {
		return c.ZonesFillableFrom(ctx, "zone-a")
	}, ([]string)(nil)},
}

// serve puts c behind a storage target's API on a unix socket and returns
// the client the controller would use.
func serve(t *testing.T, c backend.Controller) backend.Controller {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "target.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: remote.Handler(c)}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	client, err := remote.Dial(context.Background(), remote.Target{Address: "unix://" + sock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	if err := client.Hold(context.Background(), "test", func(string) {}); err != nil {
		t.Fatal(err)
	}
	return client
}

// join puts parts behind one controller, as the driver gets its zones.
func join(t *testing.T, parts ...backend.Controller) backend.Controller {
	t.Helper()
	c, err := zoned.New(parts...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestWrappersForwardEveryCapability: every capability a backend has
// answers through each wrapper as it does underneath. Each capability has
// a probe; the zone-a controller has every capability on, and a zone-b
// controller beside it in a join has nothing going on, so that a wrapper
// that asks the wrong zone answers otherwise too.
func TestWrappersForwardEveryCapability(t *testing.T) {
	declared := reflect.TypeFor[backend.ControllerCapabilities]()
	for i := range declared.NumMethod() {
		name := declared.Method(i).Name
		if !slices.ContainsFunc(controllerProbes, func(p controllerProbe) bool { return p.capability == name }) {
			t.Errorf("capability %s has no probe in controllerProbes", name)
		}
	}

	zoneA := &capableController{zone: "zone-a", capabilities: capabilities{creating: volumeIn(t, "zone-a"), blocks: true, groups: true,
		fillable: []string{"zone-a", "zone-a-2"}}}
	zoneB := &capableController{zone: "zone-b"}
	wrappers := []struct {
		name string
		wrap func(*testing.T) backend.Controller
	}{
		{"zoned", func(t *testing.T) backend.Controller { return join(t, zoneB, zoneA) }},
		{"remote", func(t *testing.T) backend.Controller { return serve(t, zoneA) }},
		{"zoned over remote", func(t *testing.T) backend.Controller { return join(t, serve(t, zoneB), serve(t, zoneA)) }},
	}
	ctx := context.Background()
	for _, w := range wrappers {
		t.Run(w.name, func(t *testing.T) {
			wrapped := w.wrap(t)
			for _, p := range controllerProbes {
				want, err := p.ask(ctx, t, zoneA)
				if err != nil || reflect.DeepEqual(want, p.without) {
					t.Fatalf("%s underneath: %v, %v; the probe cannot tell a backend with it from one without", p.capability, want, err)
				}
				got, err := p.ask(ctx, t, wrapped)
				if err != nil || !reflect.DeepEqual(got, want) {
					t.Errorf("%s through %s: %v, %v; underneath: %v", p.capability, w.name, got, err, want)
				}
			}
		})
	}
}

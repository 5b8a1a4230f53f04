package zoned

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

func pool(t *testing.T, zone string) *block.Controller {
	t.Helper()
	c, err := block.NewController(map[string]string{zone: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func volID(t *testing.T, zone, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func create(t *testing.T, c backend.Controller, id volumeid.ID, nodes ...string) {
	t.Helper()
	ctx := context.Background()
	if _, err := c.CreateVolume(ctx, backend.VolumeSpec{ID: id, Name: id.Key, CapacityBytes: 1 << 20, AccessType: accessmode.Block,
		Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}}); err != nil {
		t.Fatal(err)
	}
	var att []accessmode.Attachment
	for _, n := range nodes {
		att = append(att, accessmode.Attachment{Node: nodeid.Node{Name: n, Zone: id.Zone}, Mode: accessmode.MultiNodeMultiWriter})
	}
	if _, err := c.SetAttachments(ctx, id, att); err != nil {
		t.Fatal(err)
	}
}

func ids(list []*backend.Volume) []string {
	var out []string
	for _, v := range list {
		out = append(out, v.ID)
	}
	return out
}

// Each volume goes to its zone's part; listings ask every part and come
// back sorted as one backend's would.
func TestJoinRoutesByZone(t *testing.T) {
	a, b := pool(t, "zone-a"), pool(t, "zone-b")
	c, err := New(a, b)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Zones(), []string{"zone-a", "zone-b"}) || c.Backend() != accessmode.BackendBlock {
		t.Fatalf("the join serves %s %v", c.Backend(), c.Zones())
	}
	ctx := context.Background()
	va, vb, vb2 := volID(t, "zone-a", "a"), volID(t, "zone-b", "b"), volID(t, "zone-b", "b2")
	create(t, c, va, "worker-1")
	create(t, c, vb, "worker-1", "worker-2")
	create(t, c, vb2)
	if list, _ := a.ListVolumes(ctx); !slices.Equal(ids(list), []string{va.String()}) {
		t.Fatalf("zone-a's pool holds %v", ids(list))
	}
	if list, _ := b.ListVolumes(ctx); len(list) != 2 {
		t.Fatalf("zone-b's pool holds %v", ids(list))
	}
	all, err := c.ListVolumes(ctx)
	want := []string{va.String(), vb.String(), vb2.String()}
	slices.Sort(want)
	if err != nil || !slices.Equal(ids(all), want) {
		t.Fatalf("ListVolumes = %v, %v; want %v", ids(all), err, want)
	}
	on, err := c.VolumesOn(ctx, "worker-1")
	wantOn := []string{va.String(), vb.String()}
	slices.Sort(wantOn)
	if err != nil || !slices.Equal(ids(on), wantOn) {
		t.Fatalf("VolumesOn(worker-1) = %v, %v; want %v", ids(on), err, wantOn)
	}
	if v, err := c.Volume(ctx, vb); err != nil || v.Zone != "zone-b" {
		t.Fatalf("Volume(%s) = %+v, %v", vb, v, err)
	}
	if pools, err := c.Pools(ctx); err != nil || len(pools) != 2 || pools[0].Zone != "zone-a" || pools[1].CommittedBytes != 2<<20 {
		t.Fatalf("Pools = %+v, %v", pools, err)
	}
	_, err = c.Volume(ctx, volID(t, "zone-c", "c"))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "zone-a, zone-b") {
		t.Fatalf("a zone served by no part: %v", err)
	}
	if err := c.DeleteVolume(ctx, volID(t, "zone-c", "c")); err != nil {
		t.Fatalf("deleting in a zone served by no part: %v", err)
	}
	if err := c.DeleteVolume(ctx, vb2); err != nil {
		t.Fatal(err)
	}
	if list, _ := b.ListVolumes(ctx); len(list) != 1 {
		t.Fatalf("zone-b's pool after the delete holds %v", ids(list))
	}
}

func TestJoinRefusesOverlaps(t *testing.T) {
	if _, err := New(pool(t, "zone-a"), pool(t, "zone-a")); err == nil || !strings.Contains(err.Error(), "served twice") {
		t.Fatalf("two parts of one zone: %v", err)
	}
	if _, err := New(); err == nil {
		t.Fatal("an empty join was made")
	}
}

// A listing with a part that cannot answer fails: leaving the zone out
// would tell the CO its volumes are gone.
func TestListingFailsWithAnUnreachablePart(t *testing.T) {
	a := pool(t, "zone-a")
	sock := filepath.Join(t.TempDir(), "target.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: remote.Handler(pool(t, "zone-b"))}
	go srv.Serve(lis)
	b, err := remote.Dial(context.Background(), remote.Target{Address: "unix://" + sock})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Hold(context.Background(), "test", func(string) {}); err != nil {
		t.Fatal(err)
	}
	c, err := New(a, b)
	if err != nil {
		t.Fatal(err)
	}
	create(t, c, volID(t, "zone-a", "a"))
	srv.Close()
	b.Close()
	if list, err := c.ListVolumes(context.Background()); status.Code(err) != codes.Unavailable {
		t.Fatalf("ListVolumes with zone-b's target gone = %v, %v; want UNAVAILABLE", ids(list), err)
	}
	// The reachable zone still works.
	if _, err := c.Volume(context.Background(), volID(t, "zone-a", "a")); err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotBlocksOfTwoZones: snapshots in two zones cannot be of one
// volume, and the question goes to neither zone.
func TestSnapshotBlocksOfTwoZones(t *testing.T) {
	c, err := New(pool(t, "zone-a"), pool(t, "zone-b"))
	if err != nil {
		t.Fatal(err)
	}
	snapIn := func(zone string) volumeid.ID {
		id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "s"))
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	_, err = c.SnapshotBlocks(context.Background(), backend.BlockRangesRequest{Base: snapIn("zone-a"), Target: snapIn("zone-b"), Limit: 1})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "one volume") {
		t.Errorf("snapshots of two zones: %v, want INVALID_ARGUMENT saying they cannot be of one volume", err)
	}
}

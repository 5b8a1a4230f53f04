package block

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// scannedSpare is what the pool of zone can promise by the full scan the
// running totals replace: free space minus what every volume's image has
// not allocated yet, stat'd now, minus the reservations in flight.
func scannedSpare(t *testing.T, c *Controller, zone string) int64 {
	t.Helper()
	p := c.pools[zone]
	vols, err := c.ListVolumes(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var promised []int64
	for _, v := range vols {
		id := mustID(t, v.ID)
		if id.Zone != zone {
			continue
		}
		image, err := p.imagePath(id)
		if err != nil {
			t.Fatal(err)
		}
		allocated, err := allocatedBytes(image)
		if err != nil {
			t.Fatal(err)
		}
		promised = append(promised, outstanding(v.CapacityBytes, allocated))
	}
	free, err := freeBytes(p.dir)
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	reserved := c.reserved[zone]
	c.mu.Unlock()
	return spare(free, promised, reserved)
}

// writeInto writes n bytes at offset 0 of a volume's image, as a node
// writing through its loop device would, and syncs them.
func writeInto(t *testing.T, image string, n int) {
	t.Helper()
	f, err := os.OpenFile(image, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(make([]byte, n), 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// The pool's promises are kept as running totals instead of a stat of
// every image per creation; after every kind of change, and after a
// restart, they must come to what a full scan finds.
func TestPoolUsageMatchesAFreshScan(t *testing.T) {
	requireRoot(t)
	root := testRoot(t)
	dir := filepath.Join(root, "pool-a")
	mountTmpfs(t, dir, "512m") // a pool of its own: nothing else changes its free space
	f := openFixture(t, root, map[string]string{"a": dir})
	ctx := context.Background()
	check := func(step string) {
		t.Helper()
		got, err := f.ctrl.Capacity(ctx, "a")
		if err != nil {
			t.Fatalf("%s: Capacity: %v", step, err)
		}
		if want := scannedSpare(t, f.ctrl, "a"); got != want {
			t.Fatalf("%s: the pool offers %d bytes, a full scan says %d", step, got, want)
		}
	}
	check("empty pool")

	raw := backend.VolumeSpec{ID: volID(t, "a", "raw"), Name: "raw", CapacityBytes: 64 << 20,
		AccessType: accessmode.Block, Modes: []accessmode.Mode{accessmode.SingleNodeWriter}}
	f.create(t, raw)
	fs := f.create(t, mountSpec(t, "a", "fs", "ext4", 48<<20))
	ro := mountSpec(t, "a", "ro", "ext4", 32<<20) // formatted at create: an image with blocks
	ro.Modes = []accessmode.Mode{accessmode.MultiNodeReaderOnly}
	f.create(t, ro)
	check("after three creates")

	// A node holds raw and writes to it: its image is stat'd at each check.
	f.attach(t, raw.ID, writer("n1"))
	writeInto(t, imageOf(t, f, raw.ID), 8<<20)
	check("while a node writes to a held volume")
	f.attach(t, raw.ID)
	check("after the node let it go")

	if _, err := f.ctrl.ExpandVolume(ctx, mustID(t, fs.ID), 96<<20); err != nil {
		t.Fatal(err)
	}
	check("after an expansion")
	// No deadline: the call waits for the copy to end.
	if s, err := f.ctrl.CreateSnapshot(ctx, snapID(t, "a", "snap"), "snap", raw.ID); err != nil || s.Cutting {
		t.Fatalf("CreateSnapshot: %+v, %v; want a complete snapshot", s, err)
	}
	check("after a snapshot")
	if err := f.ctrl.DeleteVolume(ctx, mustID(t, fs.ID)); err != nil {
		t.Fatal(err)
	}
	check("after a delete")

	before, err := f.ctrl.Capacity(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	f = openFixture(t, root, f.pools) // a restart loads the totals from the images
	check("after a restart")
	if after, _ := f.ctrl.Capacity(ctx, "a"); after != before {
		t.Fatalf("a restart changed what the pool offers from %d to %d bytes", before, after)
	}

	// An idle volume written to anyway (a node force-detached while still
	// running): the stale share can only make the pool offer less.
	writeInto(t, imageOf(t, f, raw.ID), 16<<20)
	got, _ := f.ctrl.Capacity(ctx, "a")
	if want := scannedSpare(t, f.ctrl, "a"); got > want {
		t.Fatalf("after writes to an idle volume the pool offers %d bytes, more than the %d a full scan finds", got, want)
	}
	f.attach(t, raw.ID, writer("n1"))
	f.attach(t, raw.ID)
	check("after the volume was held and let go again")
}

func mustID(t *testing.T, raw string) volumeid.ID {
	t.Helper()
	id, err := volumeid.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

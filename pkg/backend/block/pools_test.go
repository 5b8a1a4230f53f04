package block

import (
	"context"
	"path/filepath"
	"testing"
)

// Pools reports each zone's filesystem size and free space and the
// capacities promised to its volumes, in zone order.
func TestPoolsReportSizeFreeAndCommitted(t *testing.T) {
	requireRoot(t)
	root := testRoot(t)
	pools := map[string]string{"zone-a": filepath.Join(root, "pool-a"), "zone-b": filepath.Join(root, "pool-b")}
	mountTmpfs(t, pools["zone-a"], "64m")
	mountTmpfs(t, pools["zone-b"], "32m")
	f := openFixture(t, root, pools)
	ctx := context.Background()
	f.create(t, mountSpec(t, "zone-a", "one", "", 16*mib))
	f.create(t, mountSpec(t, "zone-a", "two", "", 8*mib))

	stats, err := f.ctrl.Pools(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(stats) != 2 || stats[0].Zone != "zone-a" || stats[1].Zone != "zone-b" {
		t.Fatalf("Pools = %+v, want zone-a then zone-b", stats)
	}
	for i, want := range []struct{ size, committed int64 }{{64 * mib, 24 * mib}, {32 * mib, 0}} {
		s := stats[i]
		if s.SizeBytes != want.size {
			t.Errorf("%s: size %d, want %d", s.Zone, s.SizeBytes, want.size)
		}
		if s.FreeBytes <= 0 || s.FreeBytes > s.SizeBytes {
			t.Errorf("%s: free %d of %d", s.Zone, s.FreeBytes, s.SizeBytes)
		}
		if s.CommittedBytes != want.committed {
			t.Errorf("%s: committed %d, want %d", s.Zone, s.CommittedBytes, want.committed)
		}
	}
	// The images are sparse: promised, not yet used.
	if stats[0].FreeBytes < 60*mib {
		t.Errorf("zone-a: free %d after creating sparse volumes, want nearly all of 64 MiB", stats[0].FreeBytes)
	}
}

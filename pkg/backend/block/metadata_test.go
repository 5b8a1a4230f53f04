package block

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
	"google.golang.org/grpc/codes"
)

const kib = int64(1) << 10

// Writes of whole 4 KiB blocks, so that what the pools' filesystems report
// (in 4 KiB blocks on xfs and ext4, 4 KiB pages on tmpfs) can be held to
// exactly the bytes written.
var (
	writtenBefore = []backend.BlockRange{{Offset: 0, Length: 8 * kib}, {Offset: mib, Length: 64 * kib}, {Offset: 10*mib + 4*kib, Length: 8 * kib}}
	// writtenBetween overwrites the middle of a range written before,
	// fills a hole, and writes past everything written before.
	writtenBetween = []backend.BlockRange{{Offset: mib + 16*kib, Length: 4 * kib}, {Offset: 5 * mib, Length: 4 * kib}, {Offset: 20 * mib, Length: 128 * kib}}
)

// merged is ranges sorted, with overlapping and touching ones joined.
func merged(ranges ...[]backend.BlockRange) []backend.BlockRange {
	all := slices.Concat(ranges...)
	slices.SortFunc(all, func(a, b backend.BlockRange) int { return int(a.Offset - b.Offset) })
	var out []backend.BlockRange
	for _, r := range all {
		out = appendRange(out, r)
	}
	return out
}

// covers reports whether every byte of inner lies in outer.
func covers(outer, inner []backend.BlockRange) bool {
	for _, r := range inner {
		if !slices.ContainsFunc(outer, func(o backend.BlockRange) bool { return o.Offset <= r.Offset && r.End() <= o.End() }) {
			return false
		}
	}
	return true
}

// allRanges asks for every page of req, limit ranges at a time, and joins
// them, checking that each page keeps to its limit and that the pages
// follow one another.
func allRanges(t *testing.T, c backend.Controller, req backend.BlockRangesRequest, limit int) (ranges []backend.BlockRange, capacity int64) {
	t.Helper()
	req.Limit = limit
	for pages := 0; ; pages++ {
		if pages > 1000 {
			t.Fatalf("%+v: no end after 1000 pages", req)
		}
		page, err := c.SnapshotBlocks(context.Background(), req)
		if err != nil {
			t.Fatalf("SnapshotBlocks %+v: %v", req, err)
		}
		if len(page.Ranges) > limit {
			t.Fatalf("page of %d ranges; the limit is %d", len(page.Ranges), limit)
		}
		for _, r := range page.Ranges {
			if r.Length <= 0 || r.End() <= req.From || len(ranges) > 0 && r.Offset <= ranges[len(ranges)-1].End() {
				t.Fatalf("range %+v after %v (from %d): empty, before the start, overlapping or touching", r, ranges, req.From)
			}
			ranges = append(ranges, r)
		}
		capacity = page.CapacityBytes
		if page.Done {
			return ranges, capacity
		}
		req.From = page.Ranges[len(page.Ranges)-1].End()
	}
}

// metadataPool is a pool filesystem as the tests of block metadata see it.
type metadataPool struct {
	name string
	dir  func(t *testing.T) string
	// exactDelta: snapshots are reflink clones, so the delta is exactly
	// what was written between them.
	exactDelta bool
}

var metadataPools = []metadataPool{
	{"xfs with reflinks", func(t *testing.T) string { return testenv.ReflinkXFS(t, 400*mib) }, true},
	{"btrfs", func(t *testing.T) string { return testenv.LoopFilesystem(t, 400*mib, "btrfs", "-q") }, true},
	{"ext4", func(t *testing.T) string { return testenv.LoopFilesystem(t, 128*mib, "ext4", "-q", "-F") }, false},
	{"tmpfs", func(t *testing.T) string { return testenv.Tmpfs(t, "128m") }, false},
}

// twoSnapshots makes a raw block volume of 32 MiB on a pool in dir, writes
// writtenBefore, snapshots it (before), writes writtenBetween and
// snapshots it again (after).
func twoSnapshots(t *testing.T, dir string) (f *fixture, vol, before, after volumeid.ID) {
	t.Helper()
	pool := filepath.Join(dir, "pool")
	if err := os.Mkdir(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	f = openFixture(t, dir, map[string]string{"zone-a": pool})
	spec := mountSpec(t, "zone-a", "tracked", "", 32*mib)
	spec.AccessType = accessmode.Block
	f.create(t, spec)
	ctx := context.Background()
	testenv.WriteRanges(t, imageOf(t, f, spec.ID), 0xa5, writtenBefore...)
	before, after = snapID(t, "zone-a", "before"), snapID(t, "zone-a", "after")
	if _, err := f.ctrl.CreateSnapshot(ctx, before, "before", spec.ID); err != nil {
		t.Fatal(err)
	}
	testenv.WriteRanges(t, imageOf(t, f, spec.ID), 0x5a, writtenBetween...)
	if _, err := f.ctrl.CreateSnapshot(ctx, after, "after", spec.ID); err != nil {
		t.Fatal(err)
	}
	return f, spec.ID, before, after
}

// TestSnapshotBlocksAgainstKnownWrites: the allocated ranges of each
// snapshot are exactly what was written up to it, and the changes between
// the two are exactly what was written between them where the snapshots
// are reflink clones, and, where they are byte copies, everything either
// holds: a superset of the true change.
func TestSnapshotBlocksAgainstKnownWrites(t *testing.T) {
	testenv.RequireRoot(t)
	for _, p := range metadataPools {
		t.Run(p.name, func(t *testing.T) {
			f, _, before, after := twoSnapshots(t, p.dir(t))

			allocatedBefore, capacity := allRanges(t, f.ctrl, backend.BlockRangesRequest{Target: before}, 100)
			if want := merged(writtenBefore); !slices.Equal(allocatedBefore, want) {
				t.Errorf("allocated before: %v, want exactly what was written %v", allocatedBefore, want)
			}
			if capacity != 32*mib {
				t.Errorf("capacity %d, want %d", capacity, 32*mib)
			}
			allocatedAfter, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Target: after}, 100)
			if want := merged(writtenBefore, writtenBetween); !slices.Equal(allocatedAfter, want) {
				t.Errorf("allocated after: %v, want exactly what was written %v", allocatedAfter, want)
			}

			delta, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Base: before, Target: after}, 100)
			if !covers(delta, writtenBetween) {
				t.Fatalf("delta %v misses some of what was written between the snapshots, %v", delta, writtenBetween)
			}
			want := merged(writtenBetween)
			if !p.exactDelta {
				// Byte copies share nothing: all either snapshot holds.
				want = merged(allocatedBefore, allocatedAfter)
			}
			if !slices.Equal(delta, want) {
				t.Errorf("delta %v, want %v", delta, want)
			}
			// Which blocks differ does not depend on which side is
			// the base.
			if reverse, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Base: after, Target: before}, 100); !slices.Equal(reverse, want) {
				t.Errorf("delta from after to before %v, want %v", reverse, want)
			}
		})
	}
}

// TestSnapshotBlocksPages: one range a page, and starting offsets inside a
// range, between ranges and at the end, give the ranges from there on.
func TestSnapshotBlocksPages(t *testing.T) {
	testenv.RequireRoot(t)
	f, _, before, after := twoSnapshots(t, testenv.ReflinkXFS(t, 400*mib))
	whole, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Target: after}, 1000)
	if one, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Target: after}, 1); !slices.Equal(one, whole) {
		t.Errorf("a range a page: %v; all at once: %v", one, whole)
	}
	delta, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Base: before, Target: after}, 1000)
	if one, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Base: before, Target: after}, 1); !slices.Equal(one, delta) {
		t.Errorf("delta a range a page: %v; all at once: %v", one, delta)
	}
	for _, tc := range []struct {
		from int64
		want []backend.BlockRange
	}{
		// Inside the range at 1 MiB: cut to begin at the offset.
		{mib + 8*kib, []backend.BlockRange{{Offset: mib + 8*kib, Length: 56 * kib}, {Offset: 5 * mib, Length: 4 * kib},
			{Offset: 10*mib + 4*kib, Length: 8 * kib}, {Offset: 20 * mib, Length: 128 * kib}}},
		// At the end of a range: the next one.
		{mib + 64*kib, []backend.BlockRange{{Offset: 5 * mib, Length: 4 * kib}, {Offset: 10*mib + 4*kib, Length: 8 * kib}, {Offset: 20 * mib, Length: 128 * kib}}},
		// Not on a block boundary, inside the last range.
		{20*mib + 100, []backend.BlockRange{{Offset: 20*mib + 100, Length: 128*kib - 100}}},
		// After every range, and at the very end.
		{21 * mib, nil},
		{32 * mib, nil},
	} {
		for _, limit := range []int{1, 2, 1000} {
			got, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Target: after, From: tc.from}, limit)
			if !slices.Equal(got, tc.want) {
				t.Errorf("from %d, %d a page: %v, want %v", tc.from, limit, got, tc.want)
			}
		}
	}
	// A delta from inside the changed range at 20 MiB.
	got, _ := allRanges(t, f.ctrl, backend.BlockRangesRequest{Base: before, Target: after, From: 20*mib + 64*kib}, 1)
	if want := []backend.BlockRange{{Offset: 20*mib + 64*kib, Length: 64 * kib}}; !slices.Equal(got, want) {
		t.Errorf("delta from 20 MiB + 64 KiB: %v, want %v", got, want)
	}
}

// TestSnapshotBlocksRefusals: what names no snapshot here, two snapshots of
// different volumes, and offsets outside the volume.
func TestSnapshotBlocksRefusals(t *testing.T) {
	testenv.RequireRoot(t)
	f, vol, before, after := twoSnapshots(t, testenv.Tmpfs(t, "128m"))
	other := mountSpec(t, "zone-a", "other", "", 16*mib)
	other.AccessType = accessmode.Block
	f.create(t, other)
	otherSnap := snapID(t, "zone-a", "of-other")
	if _, err := f.ctrl.CreateSnapshot(context.Background(), otherSnap, "of-other", other.ID); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		req  backend.BlockRangesRequest
		want codes.Code
	}{
		{"unknown target", backend.BlockRangesRequest{Target: snapID(t, "zone-a", "never"), Limit: 1}, codes.NotFound},
		{"unknown base", backend.BlockRangesRequest{Base: snapID(t, "zone-a", "never"), Target: after, Limit: 1}, codes.NotFound},
		{"a volume for a snapshot", backend.BlockRangesRequest{Target: vol, Limit: 1}, codes.InvalidArgument},
		{"a zone without a pool", backend.BlockRangesRequest{Target: snapID(t, "zone-z", "before"), Limit: 1}, codes.InvalidArgument},
		{"snapshots of two volumes", backend.BlockRangesRequest{Base: otherSnap, Target: after, Limit: 1}, codes.InvalidArgument},
		{"negative offset", backend.BlockRangesRequest{Target: before, From: -1, Limit: 1}, codes.OutOfRange},
		{"offset past the end", backend.BlockRangesRequest{Target: before, From: 32*mib + 1, Limit: 1}, codes.OutOfRange},
		{"no room for a range", backend.BlockRangesRequest{Target: before}, codes.InvalidArgument},
	} {
		_, err := f.ctrl.SnapshotBlocks(context.Background(), tc.req)
		if codeOf(err) != tc.want {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.want)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := f.ctrl.SnapshotBlocks(ctx, backend.BlockRangesRequest{Target: before, Limit: 1}); codeOf(err) != codes.Canceled {
		t.Errorf("a cancelled call: %v, want Canceled", err)
	}
}

// TestDiffering holds the comparison of extent maps to its rules on maps
// made up to show each: shared blocks are unchanged, anything else stored
// on either side is changed, and an address that says nothing says
// "changed".
func TestDiffering(t *testing.T) {
	e := func(logical, length, physical int64) extent {
		return extent{logical: logical, length: length, physical: physical, known: true}
	}
	span := func(offset, length int64) backend.BlockRange {
		return backend.BlockRange{Offset: offset, Length: length}
	}
	unknown := func(logical, length int64) extent { return extent{logical: logical, length: length} }
	for _, tc := range []struct {
		name         string
		base, target []extent
		want         []backend.BlockRange
	}{
		{"shared", []extent{e(0, 100, 1000)}, []extent{e(0, 100, 1000)}, nil},
		{"moved", []extent{e(0, 100, 1000)}, []extent{e(0, 100, 5000)}, []backend.BlockRange{span(0, 100)}},
		{"middle rewritten", []extent{e(0, 100, 1000)}, []extent{e(0, 40, 1000), e(40, 20, 9000), e(60, 40, 1060)},
			[]backend.BlockRange{span(40, 20)}},
		{"stored on one side only", []extent{e(0, 10, 1000)}, []extent{e(50, 10, 2000)}, []backend.BlockRange{span(0, 10), span(50, 10)}},
		{"no addresses", []extent{unknown(0, 10)}, []extent{unknown(0, 10)}, []backend.BlockRange{span(0, 10)}},
		{"adjacent changes merged", []extent{e(0, 10, 1000)}, []extent{e(0, 10, 3000), e(10, 10, 4000)}, []backend.BlockRange{span(0, 20)}},
		{"allocated", nil, []extent{e(0, 10, 1000), e(10, 10, 7000), e(30, 5, 8000)}, []backend.BlockRange{span(0, 20), span(30, 5)}},
	} {
		if got := differing(tc.base, tc.target); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

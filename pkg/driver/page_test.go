package driver

import (
	"fmt"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// volumeIDs returns n distinct volume ids spread over two zones, sorted.
func volumeIDs(t *testing.T, n int) []string {
	t.Helper()
	var out []string
	for i := 0; i < n; i++ {
		zone := []string{"zone-a", "zone-b"}[i%2]
		id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Volume, volumeid.KeyFor("page-test", volumeid.Volume, fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, id.String())
	}
	slices.Sort(out)
	return out
}

func self(s string) string { return s }

// walk pages through items (re-read before every page, as ListVolumes does)
// and returns every entry seen and the number of calls.
func walk(t *testing.T, items func() []string, max int32) ([]string, int) {
	t.Helper()
	var seen []string
	token := ""
	for calls := 1; ; calls++ {
		if calls > 1000 {
			t.Fatalf("max %d: paging does not end", max)
		}
		got, next, err := page(items(), self, token, max, validVolumeToken)
		if err != nil {
			t.Fatalf("max %d, token %q: %v", max, token, err)
		}
		if max > 0 && len(got) > int(max) {
			t.Fatalf("max %d: page of %d entries", max, len(got))
		}
		seen = append(seen, got...)
		if next == "" {
			return seen, calls
		}
		if len(got) == 0 {
			t.Fatalf("max %d: empty page with next token %q", max, next)
		}
		if next != got[len(got)-1] {
			t.Fatalf("max %d: next token %q is not the last id of the page (%q)", max, next, got[len(got)-1])
		}
		token = next
	}
}

func TestPageFullWalk(t *testing.T) {
	for _, n := range []int{0, 1, 2, 7, 10} {
		items := volumeIDs(t, n)
		for max := int32(0); max <= int32(n)+2; max++ {
			seen, calls := walk(t, func() []string { return items }, max)
			if !slices.Equal(seen, items) {
				t.Errorf("n=%d max=%d: walk gave %v, want every item once, in order", n, max, seen)
			}
			wantCalls := 1
			if max > 0 && n > 0 {
				wantCalls = (n + int(max) - 1) / int(max)
			}
			if calls != wantCalls {
				t.Errorf("n=%d max=%d: %d calls, want %d", n, max, calls, wantCalls)
			}
		}
	}
}

func TestPageSurvivesDeletionOfToken(t *testing.T) {
	all := volumeIDs(t, 10)
	for max := int32(1); max <= 9; max++ {
		items := slices.Clone(all)
		first, next, err := page(items, self, "", max, validVolumeToken)
		if err != nil || next == "" {
			t.Fatalf("max %d: first page %v, %q, %v", max, first, next, err)
		}
		// The last entry of the page, which is the token, goes away.
		items = slices.DeleteFunc(items, func(s string) bool { return s == next })
		var seen []string
		token := next
		for token != "" {
			got, nt, err := page(items, self, token, max, validVolumeToken)
			if err != nil {
				t.Fatalf("max %d after deletion, token %q: %v", max, token, err)
			}
			seen = append(seen, got...)
			token = nt
		}
		want := all[int(max):]
		if !slices.Equal(seen, want) {
			t.Errorf("max %d: after deleting the token, the walk went on with %v, want %v", max, seen, want)
		}
	}
}

func TestPageChangesBetweenPages(t *testing.T) {
	all := volumeIDs(t, 9)
	items := slices.Clone(all)
	got, next, err := page(items, self, "", 3, validVolumeToken)
	if err != nil {
		t.Fatal(err)
	}
	seen := slices.Clone(got)
	// Between pages, an entry not yet listed is deleted and one that sorts
	// before the token is added: the deleted one is not listed, the added
	// one is not either (it belongs to a page already read), and no entry
	// is listed twice or skipped.
	items = slices.DeleteFunc(items, func(s string) bool { return s == all[5] })
	for i := 0; ; i++ {
		id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("extra", volumeid.Volume, fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		if s := id.String(); s < next && !slices.Contains(items, s) {
			items = append(items, s)
			slices.Sort(items)
			break
		}
	}
	for next != "" {
		got, next, err = page(items, self, next, 3, validVolumeToken)
		if err != nil {
			t.Fatal(err)
		}
		seen = append(seen, got...)
	}
	want := slices.DeleteFunc(slices.Clone(all), func(s string) bool { return s == all[5] })
	if !slices.Equal(seen, want) {
		t.Errorf("walk = %v, want %v", seen, want)
	}
}

func TestPageBadArguments(t *testing.T) {
	items := volumeIDs(t, 4)
	snap, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Snapshot, volumeid.KeyFor("x", volumeid.Snapshot, "s"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"garbage", "2", "../../etc", "block:zone-a:vol-../../x", snap.String(), items[0] + "x", "\x00"} {
		got, next, err := page(items, self, tok, 2, validVolumeToken)
		if status.Code(err) != codes.Aborted {
			t.Errorf("token %q: %v, %q, %v; want Aborted", tok, got, next, err)
		}
	}
	for _, max := range []int32{-1, -100} {
		got, next, err := page(items, self, "", max, validVolumeToken)
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("max %d: %v, %q, %v; want InvalidArgument", max, got, next, err)
		}
	}
	// A well-formed token beyond every entry (the last entry was deleted)
	// ends the listing rather than failing it.
	last := items[len(items)-1]
	got, next, err := page(items[:len(items)-1], self, last, 2, validVolumeToken)
	if err != nil || len(got) != 0 || next != "" {
		t.Errorf("token past the end: %v, %q, %v; want an empty last page", got, next, err)
	}
}

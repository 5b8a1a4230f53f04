package netfence

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/nodeid"
)

func TestParseCIDR(t *testing.T) {
	tests := []struct {
		in      string
		want    string // "" when refused
		errHint string // what the refusal must say
	}{
		{"10.90.89.66/32", "10.90.89.66/32", ""},
		{"11.67.12.0/24", "11.67.12.0/24", ""},
		{"0.0.0.0/0", "0.0.0.0/0", ""},
		{"2001:db8::/64", "2001:db8::/64", ""},
		{"2001:db8::1/128", "2001:db8::1/128", ""},
		{"", "", "empty"},
		{"10.90.89.66", "", "10.90.89.66/32"},
		{"2001:db8::1", "", "2001:db8::1/128"},
		{"11.67.12.42/24", "", "11.67.12.0/24"},
		{"10.0.0.1/33", "", "not a CIDR block"},
		{"10.0.0.1/-1", "", "not a CIDR block"},
		{"fe80::1%eth0/64", "", "not a CIDR block"},
		{"::ffff:10.0.0.1/128", "", "IPv4"},
		{"10.0.0.0/8,10.1.0.0/16", "", "not a CIDR block"},
		{"node-1", "", "not a CIDR block"},
		{" 10.0.0.0/8", "", "not a CIDR block"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			p, err := ParseCIDR(tt.in)
			if tt.want == "" {
				if err == nil {
					t.Fatalf("ParseCIDR(%q) = %s, want a refusal", tt.in, p)
				}
				if !strings.Contains(err.Error(), tt.errHint) {
					t.Fatalf("ParseCIDR(%q): %v; want it to say %q", tt.in, err, tt.errHint)
				}
				return
			}
			if err != nil || p.String() != tt.want {
				t.Fatalf("ParseCIDR(%q) = %s, %v; want %s", tt.in, p, err, tt.want)
			}
		})
	}
}

func TestParseCIDRsSortsAndDropsRepeats(t *testing.T) {
	got, err := ParseCIDRs([]string{"10.0.0.0/8", "2001:db8::/64", "10.0.0.0/8", "10.0.0.0/16", "192.0.2.7/32"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.0/8", "10.0.0.0/16", "192.0.2.7/32", "2001:db8::/64"}
	if s := toStrings(got); !slices.Equal(s, want) {
		t.Fatalf("ParseCIDRs = %v, want %v", s, want)
	}
	for _, bad := range [][]string{nil, {}, {"10.0.0.0/8", "x"}, make([]string, MaxFences+1)} {
		if _, err := ParseCIDRs(bad); err == nil {
			t.Errorf("ParseCIDRs(%d blocks, %q...) accepted", len(bad), bad)
		}
	}
}

func toStrings(ps []netip.Prefix) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}

func blocks(t *testing.T, s ...string) []netip.Prefix {
	t.Helper()
	ps, err := ParseCIDRs(s)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

func node(name, addr string) nodeid.Node {
	return nodeid.Node{Name: name, Zone: "zone-a", Address: addr}
}

// TestListFencesAndRemembers: a list fences the nodes in its blocks, keeps
// a node it caught fenced under any other address, survives a reopen, and
// lets go on Remove.
func TestListFencesAndRemembers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fences.json")
	l, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if by, err := l.Catch(context.Background(), node("n1", "10.0.0.5")); err != nil || by != nil {
		t.Fatalf("empty list: Catch = %v, %v", by, err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("an empty list that never changed wrote %s (%v)", path, err)
	}
	if !l.Missing() {
		t.Error("a list without a file is not reported missing")
	}
	now := time.Date(2026, 11, 27, 3, 0, 0, 0, time.UTC)
	if err := l.Add(context.Background(), blocks(t, "10.0.0.0/24", "192.0.2.7/32"), now); err != nil {
		t.Fatal(err)
	}
	// Adding a fenced block again keeps its time.
	if err := l.Add(context.Background(), blocks(t, "10.0.0.0/24"), now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		n    nodeid.Node
		want []string
	}{
		{node("n1", "10.0.0.5"), []string{"10.0.0.0/24"}},
		{node("n2", "10.0.1.5"), nil},
		{node("n3", "192.0.2.7"), []string{"192.0.2.7/32"}},
		{node("n4", "2001:db8::5"), nil},
		{node("n5", ""), nil},
		// n1 again under another address: caught before, still fenced.
		{node("n1", "10.0.1.9"), []string{"10.0.0.0/24"}},
		{node("n1", ""), []string{"10.0.0.0/24"}},
	}
	for _, c := range cases {
		by, err := l.Catch(context.Background(), c.n)
		if err != nil {
			t.Fatal(err)
		}
		if got := toStrings(by); !slices.Equal(got, c.want) && len(got)+len(c.want) > 0 {
			t.Errorf("Catch(%s at %q) = %v, want %v", c.n.Name, c.n.Address, got, c.want)
		}
	}
	// What was caught is on disk: a controller started again knows it.
	again, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if by, _ := again.Catch(context.Background(), node("n1", "10.9.9.9")); len(by) != 1 {
		t.Errorf("after a reopen, n1 at another address: fenced by %v, want 10.0.0.0/24", by)
	}
	fences := again.Fences()
	if len(fences) != 2 || !fences[0].Since.Equal(now) || !slices.Equal(fences[0].Nodes, []string{"n1"}) || !slices.Equal(fences[1].Nodes, []string{"n3"}) {
		t.Errorf("reopened fences: %+v", fences)
	}
	// Lifting 10.0.0.0/24 frees n1 wherever it is; a block never fenced
	// is fine to lift.
	if err := again.Remove(context.Background(), blocks(t, "10.0.0.0/24", "172.16.0.0/12")); err != nil {
		t.Fatal(err)
	}
	for _, n := range []nodeid.Node{node("n1", "10.0.0.5"), node("n1", "10.0.1.9")} {
		if by, _ := again.Catch(context.Background(), n); by != nil {
			t.Errorf("after the lift, n1 at %s is fenced by %v", n.Address, by)
		}
	}
	if got := Blocks(again.Fences()); !slices.Equal(got, []string{"192.0.2.7/32"}) {
		t.Errorf("after the lift: %v", got)
	}
	third, err := Open(path)
	if err != nil || !slices.Equal(Blocks(third.Fences()), []string{"192.0.2.7/32"}) || third.Missing() {
		t.Errorf("reopened after the lift: %v, %v", third, err)
	}
	// Emptied is not missing.
	if err := third.Remove(context.Background(), blocks(t, "192.0.2.7/32")); err != nil {
		t.Fatal(err)
	}
	if fourth, err := Open(path); err != nil || len(fourth.Fences()) != 0 || fourth.Missing() {
		t.Errorf("an emptied list reopened: %+v, %v", fourth, err)
	}
}

// TestListRefusesWhatItCannotRead: a damaged list is an error, never an
// empty list (which would lift every fence); so is a list that cannot be
// written (the change is not made).
func TestListRefusesWhatItCannotRead(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"garbage":   "{not json",
		"host bits": `{"fences":[{"cidr":"10.0.0.5/24","since":"2026-11-27T00:00:00Z"}]}`,
		"no block":  `{"fences":[{"cidr":"","since":"2026-11-27T00:00:00Z"}]}`,
	} {
		p := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := Open(p); err == nil {
			t.Errorf("%s: Open accepted %s", name, content)
		}
	}
	l, err := Open(filepath.Join(dir, "missing-dir", "fences.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Add(context.Background(), blocks(t, "10.0.0.0/8"), time.Now()); err == nil {
		t.Fatal("Add into a directory that does not exist succeeded")
	}
	if got := l.Fences(); len(got) != 0 {
		t.Errorf("a fence that could not be written is in force: %v", got)
	}
}

func TestListBounded(t *testing.T) {
	l, err := Open(filepath.Join(t.TempDir(), "fences.json"))
	if err != nil {
		t.Fatal(err)
	}
	var all []netip.Prefix
	for i := range MaxFences + 1 {
		all = append(all, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24))
	}
	if err := l.Add(context.Background(), all[:MaxFences], time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := l.Add(context.Background(), all[MaxFences:], time.Now()); err == nil {
		t.Fatalf("the list took a fence past %d", MaxFences)
	}
}

package driver

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

func TestGroupSources(t *testing.T) {
	vol := func(backend accessmode.Backend, zone, name string) string {
		id, err := volumeid.New(backend, zone, volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
		if err != nil {
			t.Fatal(err)
		}
		return id.String()
	}
	a, b := vol(accessmode.BackendBlock, "zone-a", "a"), vol(accessmode.BackendBlock, "zone-a", "b")
	for _, tc := range []struct {
		name    string
		sources []string
		code    codes.Code
	}{
		{"one", []string{a}, codes.OK},
		{"two of one zone", []string{b, a}, codes.OK},
		{"none", nil, codes.InvalidArgument},
		{"one twice", []string{a, b, a}, codes.InvalidArgument},
		{"not an id", []string{a, "non-existing-volume-id"}, codes.NotFound},
		{"a snapshot id", []string{a, "block:zone-a:snap-" + volumeid.KeyFor("test", volumeid.Snapshot, "s")}, codes.NotFound},
		{"two zones", []string{a, vol(accessmode.BackendBlock, "zone-b", "c")}, codes.FailedPrecondition},
		{"two backends", []string{a, vol(accessmode.BackendNFS, "", "d")}, codes.FailedPrecondition},
	} {
		got, err := groupSources(tc.sources)
		if status.Code(err) != tc.code {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.code)
			continue
		}
		for i := 1; err == nil && i < len(got); i++ {
			if got[i-1].String() >= got[i].String() {
				t.Errorf("%s: sources not sorted: %v", tc.name, got)
			}
		}
	}
}

// TestGroupMemberIsDerived: a snapshot is a group's member only if its id is
// the one the group and its source derive; a snapshot a CO named like a
// member is no member.
func TestGroupMemberIsDerived(t *testing.T) {
	d := &Driver{cfg: Config{DriverName: "test.csi"}}
	group, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.GroupSnapshot, volumeid.KeyFor("test.csi", volumeid.GroupSnapshot, "g"))
	source, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test.csi", volumeid.Volume, "v"))
	member := &backend.Snapshot{ID: d.memberID(group, source).String(), Name: memberName(group, 2, source),
		SourceVolumeID: source.String(), CreatedAt: time.Now()}
	if g, n, ok := d.groupMember(member); !ok || g != group || n != 2 {
		t.Fatalf("groupMember(member) = %v, %d, %v; want %s, 2, true", g, n, ok, group)
	}
	if csi := d.csiSnapshot(member); csi.GetGroupSnapshotId() != group.String() {
		t.Errorf("a member is reported with group %q, want %s", csi.GetGroupSnapshotId(), group)
	}
	impostor := *member
	impostor.ID = "block:zone-a:snap-" + volumeid.KeyFor("test.csi", volumeid.Snapshot, member.Name)
	if _, _, ok := d.groupMember(&impostor); ok {
		t.Error("a snapshot named like a member, with a CO-derived id, counts as a member")
	}
	other := *member
	other.SourceVolumeID = "block:zone-a:vol-" + volumeid.KeyFor("test.csi", volumeid.Volume, "w")
	if _, _, ok := d.groupMember(&other); ok {
		t.Error("a member whose recorded source differs from its name counts as a member")
	}
	for _, name := range []string{"", "g", "a/b/c", group.String() + "/0/" + source.String(), group.String() + "/x/" + source.String()} {
		s := *member
		s.Name = name
		if _, _, ok := d.groupMember(&s); ok {
			t.Errorf("name %q read as a member", name)
		}
	}
}

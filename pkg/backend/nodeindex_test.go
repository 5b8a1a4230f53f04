package backend

import (
	"slices"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

func TestNodeIndexFollowsAttachments(t *testing.T) {
	att := func(ids ...string) []accessmode.Attachment {
		var out []accessmode.Attachment
		for _, id := range ids {
			out = append(out, accessmode.Attachment{Node: nodeid.MustParse(id)})
		}
		return out
	}
	type set struct {
		vol           string
		before, after []accessmode.Attachment
	}
	tests := []struct {
		name string
		sets []set
		want map[string][]string // node key -> volumes
	}{
		{"nothing recorded", nil, map[string][]string{"n1": {}}},
		{"one volume on two nodes",
			[]set{{"v1", nil, att("n1@zone-a", "n2@zone-a@10.0.0.2")}},
			map[string][]string{"n1": {"v1"}, "n2": {"v1"}, "n3": {}}},
		{"volumes come back sorted",
			[]set{{"v3", nil, att("n1@zone-a")}, {"v1", nil, att("n1@zone-a")}, {"v2", nil, att("n1@zone-a")}},
			map[string][]string{"n1": {"v1", "v2", "v3"}}},
		{"a node id's attributes do not matter, its key does",
			[]set{{"v1", nil, att("n1@zone-a@10.0.0.1")}, {"v2", nil, att("n1@zone-a@10.0.0.9@16")}},
			map[string][]string{"n1": {"v1", "v2"}, "n1@zone-a@10.0.0.1": {}}},
		{"moving a volume from one node to another",
			[]set{{"v1", nil, att("n1@zone-a")}, {"v1", att("n1@zone-a"), att("n2@zone-a")}},
			map[string][]string{"n1": {}, "n2": {"v1"}}},
		{"letting go of every node",
			[]set{{"v1", nil, att("n1@zone-a", "n2@zone-a")}, {"v1", att("n1@zone-a", "n2@zone-a"), nil}},
			map[string][]string{"n1": {}, "n2": {}}},
		{"one node's volume goes, the other's stays",
			[]set{{"v1", nil, att("n1@zone-a")}, {"v2", nil, att("n1@zone-a")}, {"v1", att("n1@zone-a"), nil}},
			map[string][]string{"n1": {"v2"}}},
		{"a node id that followed its node's new address",
			[]set{{"v1", nil, att("n1@zone-a@10.0.0.1")}, {"v1", att("n1@zone-a@10.0.0.1"), att("n1@zone-a@10.0.0.2")}},
			map[string][]string{"n1": {"v1"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var x NodeIndex
			for _, s := range tt.sets {
				x.Set(s.vol, s.before, s.after)
			}
			for node, want := range tt.want {
				if got := x.On(node); !slices.Equal(got, want) {
					t.Errorf("On(%q) = %v, want %v", node, got, want)
				}
			}
			if x.byNode != nil {
				for node, ids := range x.byNode {
					if len(ids) == 0 {
						t.Errorf("node %q stays in the index with no volumes", node)
					}
				}
			}
		})
	}
}

package backend

import (
	"slices"

	"github.com/modeguard/modeguard/pkg/accessmode"
)

// NodeIndex maps each node key (accessmode.Attachment.Node.Name) to the
// volumes attached to it, so that what one node holds is found at a cost
// that follows the node's count, not the number of volumes there are. A
// backend keeps it next to its volume records and changes both under the
// same lock; NodeIndex itself does no locking.
type NodeIndex struct {
	byNode map[string]map[string]struct{}
}

// Set records that volume id is attached exactly as attachments say,
// replacing what was recorded for it before (before: its previous
// attachments, nil for a volume new to the index).
func (x *NodeIndex) Set(id string, before, attachments []accessmode.Attachment) {
	for _, a := range before {
		if ids := x.byNode[a.Node.Name]; ids != nil {
			delete(ids, id)
			if len(ids) == 0 {
				delete(x.byNode, a.Node.Name)
			}
		}
	}
	for _, a := range attachments {
		if x.byNode == nil {
			x.byNode = map[string]map[string]struct{}{}
		}
		ids := x.byNode[a.Node.Name]
		if ids == nil {
			ids = map[string]struct{}{}
			x.byNode[a.Node.Name] = ids
		}
		ids[id] = struct{}{}
	}
}

// On returns the ids of the volumes attached to node key, sorted.
func (x *NodeIndex) On(node string) []string {
	ids := make([]string, 0, len(x.byNode[node]))
	for id := range x.byNode[node] {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Volumes returns what get makes of each volume node key holds (a copy of
// its record), sorted by id.
func (x *NodeIndex) Volumes(node string, get func(id string) *Volume) []*Volume {
	ids := x.On(node)
	out := make([]*Volume, 0, len(ids))
	for _, id := range ids {
		out = append(out, get(id))
	}
	return out
}

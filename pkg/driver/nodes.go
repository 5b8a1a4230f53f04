package driver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// The controller knows a node by its key (nodeid.Node.Name); the rest of
// its id (zone, address, volume limit) are attributes the node reports
// anew whenever its plugin starts. Every attach and detach of a node runs
// under that node's lock, so that counting its volumes against its limit
// and moving its attachments to a new address see one consistent picture.

// nodeLocks serializes the calls that change one node's attachments. A call
// waits for the node (attaches of different volumes to one node are
// ordinary and short) but gives up with its context.
type nodeLocks struct {
	mu   sync.Mutex
	held map[string]*nodeLock
}

type nodeLock struct {
	sem   chan struct{}
	users int // holders and waiters; the entry goes when it drops to 0
}

func newNodeLocks() *nodeLocks { return &nodeLocks{held: map[string]*nodeLock{}} }

// lock takes the node's lock, waiting at most as long as ctx allows.
func (l *nodeLocks) lock(ctx context.Context, key string) (func(), error) {
	l.mu.Lock()
	nl, ok := l.held[key]
	if !ok {
		nl = &nodeLock{sem: make(chan struct{}, 1)}
		l.held[key] = nl
	}
	nl.users++
	l.mu.Unlock()
	done := func() {
		l.mu.Lock()
		nl.users--
		if nl.users == 0 {
			delete(l.held, key)
		}
		l.mu.Unlock()
	}
	select {
	case nl.sem <- struct{}{}:
		return func() { <-nl.sem; done() }, nil
	case <-ctx.Done():
		done()
		return nil, status.Errorf(codes.Aborted, "waiting for another call on node %s: %v; retry later", key, ctx.Err())
	}
}

// heldBy lists the volumes node key holds, read after its lock was taken,
// sorted by id. Each backend keeps an index by node, so the cost follows
// what the node holds, not how many volumes there are.
func (d *Driver) heldBy(ctx context.Context, key string) ([]*backend.Volume, error) {
	var out []*backend.Volume
	for _, b := range slices.Sorted(maps.Keys(d.cfg.Controllers)) {
		vols, err := d.cfg.Controllers[b].VolumesOn(ctx, key)
		if err != nil {
			return nil, err
		}
		out = append(out, vols...)
	}
	slices.SortFunc(out, func(a, b *backend.Volume) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// heldZones is each volume of held that node key holds, with the zone of
// the id its attachment was recorded under ("" when that id does not
// parse): what tells whether the node now claims another zone.
func heldZones(key string, held []*backend.Volume) []accessmode.HeldVolume {
	var out []accessmode.HeldVolume
	for _, v := range held {
		for _, a := range v.Attachments {
			if a.Node.Name != key {
				continue
			}
			out = append(out, accessmode.HeldVolume{VolumeID: v.ID, NodeZone: a.Node.Zone})
		}
	}
	return out
}

// followNode records node's newest id in every attachment it holds that
// still carries an older one, so that for NFS the export's client list
// moves from the old address to the new one (the old address loses its
// access in the same step). current is the volume whose lock the caller
// holds; every other volume's lock is tried, and a busy one makes the call
// ABORTED for the CO to retry, since waiting for it under the node's lock
// could deadlock with a call holding that volume and waiting for the node.
// It returns current as it is afterwards (nil if the node holds none).
func (d *Driver) followNode(ctx context.Context, node nodeid.Node, held []*backend.Volume, current string) (*backend.Volume, error) {
	id := node.String()
	// A node that moved into a fenced block is fenced wherever it follows.
	fenced, err := d.fencedBy(ctx, node)
	if err != nil {
		return nil, err
	}
	var after *backend.Volume
	for _, v := range held {
		stale := slices.ContainsFunc(v.Attachments, func(a accessmode.Attachment) bool {
			return a.Node.Name == node.Name && a.Node != node
		})
		if !stale {
			if v.ID == current {
				after = v
			}
			continue
		}
		vid, ctrl, err := d.controllerOfVolume(v.ID)
		if err != nil {
			return nil, err
		}
		if v.ID != current {
			release, err := d.locks.acquire(v.ID)
			if err != nil {
				return nil, status.Errorf(codes.Aborted,
					"node %s reports a new id %s, and volume %s it holds is busy, so its attachment cannot follow yet; retry later", node.Name, id, v.ID)
			}
			defer release()
			// Read again under the lock: the list was read before it.
			if v, err = ctrl.Volume(ctx, vid); err != nil {
				if status.Code(err) == codes.NotFound {
					continue
				}
				return nil, err
			}
		}
		atts := slices.Clone(v.Attachments)
		var from []string
		for i, a := range atts {
			if a.Node.Name == node.Name && a.Node != node {
				from = append(from, a.Node.String())
				atts[i].Node = node
				atts[i].Fenced = a.Fenced || len(fenced) > 0
			}
		}
		if len(from) == 0 {
			continue
		}
		updated, err := ctrl.SetAttachments(ctx, vid, atts)
		if err != nil {
			return nil, fmt.Errorf("moving the attachment of volume %s from %s to node id %s: %w", v.ID, strings.Join(from, ", "), id, err)
		}
		klog.InfoS("A node's attachment follows its new id", "volumeID", v.ID, "node", node.Name, "from", from, "to", id)
		if v.ID == current {
			after = updated
		}
	}
	return after, nil
}

// controllerOfVolume parses a recorded volume id and finds its backend.
func (d *Driver) controllerOfVolume(raw string) (volumeid.ID, backend.Controller, error) {
	id, err := volumeid.ParseKind(raw, volumeid.Volume)
	if err != nil {
		return volumeid.ID{}, nil, status.Errorf(codes.Internal, "a recorded volume id %q does not parse: %v", raw, err)
	}
	ctrl, err := d.controllerFor(id)
	if err != nil {
		return volumeid.ID{}, nil, err
	}
	return id, ctrl, nil
}

// nodeZonesFor returns the zone of every node the controller knows (from
// the ids its attachments were made with, the newest of each node), when
// the topology names a node without its zone; nil otherwise, the usual
// case (Kubernetes names both), so no volume list is read for it.
func (d *Driver) nodeZonesFor(ctx context.Context, req *csi.TopologyRequirement) (map[string]string, error) {
	needed := false
	for _, t := range append(slices.Clone(req.GetRequisite()), req.GetPreferred()...) {
		_, zone := t.GetSegments()[TopologyZoneKey]
		_, node := t.GetSegments()[TopologyNodeKey]
		needed = needed || (node && !zone)
	}
	if !needed {
		return nil, nil
	}
	all, err := d.allVolumes(ctx)
	if err != nil {
		return nil, err
	}
	zones := map[string]string{}
	for _, v := range all {
		for _, a := range v.Attachments {
			zones[a.Node.Name] = a.Node.Zone
		}
	}
	return zones, nil
}

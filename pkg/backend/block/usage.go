package block

import (
	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"k8s.io/klog/v2"
)

// What a zone's volumes have promised is the part of their capacities
// their sparse images have not allocated yet (outstanding). Summing it by
// a stat of every image made each creation cost as much as the zone had
// volumes. Only a volume some node holds can change its allocation (the
// node writes through its loop device), so the sum is kept in two parts:
//
//   - idle: the volumes no node holds, their share taken from a stat of
//     the image when they became idle (created, let go by the last node,
//     grown, loaded at start) and kept in a running total per zone;
//   - held: the volumes attached to a node, whose images are stat'd at
//     each check, as before: their number is bounded by the nodes' limits,
//     not by the number of volumes.
//
// An idle image does not grow unless a node writes to it after it was
// detached (a node force-detached while still running), and then the pool
// reports less free space while the stale share stays as large: the check
// promises less, never more.

// usage is the promise bookkeeping of one controller, under its mu.
type usage struct {
	idleTotal map[string]int64               // zone -> sum of idle shares
	idleShare map[string]int64               // volume id -> its share in idleTotal
	held      map[string]map[string]struct{} // zone -> ids of the volumes a node holds
}

func newUsage() usage {
	return usage{idleTotal: map[string]int64{}, idleShare: map[string]int64{}, held: map[string]map[string]struct{}{}}
}

// track counts v as it is now; untrack must have removed what it was.
// Called with c.mu held.
func (c *Controller) track(v *backend.Volume) {
	id, err := volumeid.Parse(v.ID)
	if err != nil {
		return
	}
	if len(v.Attachments) > 0 {
		if c.usage.held[id.Zone] == nil {
			c.usage.held[id.Zone] = map[string]struct{}{}
		}
		c.usage.held[id.Zone][v.ID] = struct{}{}
		return
	}
	share := v.CapacityBytes // what an image that cannot be read may still take: all of it
	if p, ok := c.pools[id.Zone]; ok {
		if image, err := p.imagePath(id); err == nil {
			if allocated, err := allocatedBytes(image); err == nil {
				share = outstanding(v.CapacityBytes, allocated)
			} else {
				klog.ErrorS(err, "Counting a volume's whole capacity as promised: its image cannot be read", "volumeID", v.ID)
			}
		}
	}
	c.usage.idleShare[v.ID] = share
	c.usage.idleTotal[id.Zone] += share
}

// untrack removes what track counted for volume id. Called with c.mu held.
func (c *Controller) untrack(raw string) {
	id, err := volumeid.Parse(raw)
	if err != nil {
		return
	}
	if share, ok := c.usage.idleShare[raw]; ok {
		c.usage.idleTotal[id.Zone] -= share
		delete(c.usage.idleShare, raw)
	}
	if held := c.usage.held[id.Zone]; held != nil {
		delete(held, raw)
	}
}

// putVolume makes v the recorded state of its volume in the index, the
// node index and the promise bookkeeping. Called with c.mu held.
func (c *Controller) putVolume(v *backend.Volume) {
	var before []accessmode.Attachment
	if old, ok := c.volumes[v.ID]; ok {
		before = old.Attachments
		c.untrack(v.ID)
	}
	c.volumes[v.ID] = v
	c.nodes.Set(v.ID, before, v.Attachments)
	c.track(v)
}

// dropVolume forgets volume raw everywhere putVolume recorded it. Called
// with c.mu held.
func (c *Controller) dropVolume(raw string) {
	old, ok := c.volumes[raw]
	if !ok {
		return
	}
	c.nodes.Set(raw, old.Attachments, nil)
	c.untrack(raw)
	delete(c.volumes, raw)
}

// promised returns the zone's idle total and the images and capacities of
// its held volumes, for spareIn to stat outside the lock.
func (c *Controller) promised(p *pool) (idle int64, held []commitment) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for raw := range c.usage.held[p.zone] {
		id, err := volumeid.Parse(raw)
		if err != nil {
			continue
		}
		if image, err := p.imagePath(id); err == nil {
			held = append(held, commitment{image: image, capacity: c.volumes[raw].CapacityBytes})
		}
	}
	return c.usage.idleTotal[p.zone], held
}

// commitment is a held volume's image and capacity.
type commitment struct {
	image    string
	capacity int64
}

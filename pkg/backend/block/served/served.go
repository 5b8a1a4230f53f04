// Package served is a storage target's block controller: the zone's pools
// (package block) with every volume served over iSCSI from the kernel's
// LIO target (package lio), its access list kept equal to the volume's
// attachments. It is what `modeguard --roles target` serves to the
// controller when the target is given an iSCSI portal.
//
// # What a node gets
//
// A volume's target name, portal and unit serial are derived from its id
// and the target's configuration, never stored, and travel to the node in
// the volume context (package iscsi: FromContext): the
// node logs in with the CHAP secret of its own name and finds the disk by
// the serial.
//
// # The device under each volume
//
// LIO serves each image through a loop device on the target's host,
// attached read/write (the access list decides who writes), so that an
// expansion reaches the nodes: the image grows, then the device, whose
// new size LIO reports at the nodes' next rescan. The device is found
// again by the image it is bound to after a restart of this process (LIO
// keeps it open) and made anew after a reboot; DeleteVolume detaches it
// after the unexport. For the copies of snapshots and clones, the writers
// of an image are whom LIO lets write, not that device.
//
// # The access list
//
// SetAttachments changes the target first and the record after, so the
// record never says a node is detached while the target still lets it in:
// a node that leaves is removed from the target (which ends its sessions,
// the fence) before the call returns; a node that comes is let in with
// the write protection the attachment says. Each node is known to the
// target by the iSCSI initiator name in its node id (package nodeid) and
// authenticates with CHAP under its node key, with the secret in
// <CHAPDir>/<node key> (a Kubernetes Secret with a key per node, mounted
// as a directory).
package served

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// DefaultPrefix names the targets when the configuration names none.
const DefaultPrefix = "iqn.2026-11.dev.csi.modeguard"

// Config is the target's iSCSI side.
type Config struct {
	LIO lio.Config
	// CHAPDir holds one file per node key with that node's CHAP secret.
	CHAPDir string
}

// Controller is package block's controller with its volumes served over
// iSCSI.
type Controller struct {
	*block.Controller
	target  *lio.Target
	portal  netip.AddrPort
	prefix  string
	chapDir string
}

var _ backend.Controller = (*Controller)(nil)

// New serves the volumes of pools over iSCSI. It checks that LIO is there
// and brings the kernel's exports back in line with the records: after a
// reboot of the target's host LIO is empty, and every attached volume is
// exported again with its access list, so the nodes' sessions come back.
func New(ctx context.Context, pools *block.Controller, cfg Config) (*Controller, error) {
	if cfg.LIO.Prefix == "" {
		cfg.LIO.Prefix = DefaultPrefix
	}
	if cfg.CHAPDir == "" || !filepath.IsAbs(cfg.CHAPDir) {
		return nil, fmt.Errorf("the iSCSI target needs the directory of the nodes' CHAP secrets (absolute), not %q", cfg.CHAPDir)
	}
	t, err := lio.New(cfg.LIO)
	if err != nil {
		return nil, err
	}
	c := &Controller{Controller: pools, target: t, portal: cfg.LIO.Portal, prefix: cfg.LIO.Prefix, chapDir: cfg.CHAPDir}
	pools.SetWriters(c.writers)
	vols, err := pools.ListVolumes(ctx)
	if err != nil {
		return nil, err
	}
	for _, v := range vols {
		id, err := volumeid.Parse(v.ID)
		if err != nil {
			return nil, err
		}
		if err := c.serve(ctx, v, id, v.Attachments); err != nil {
			// One node's missing secret must not take every volume
			// down: the nodes that cannot be let in are left out (and
			// said so), the others keep their access.
			var servable []accessmode.Attachment
			for _, a := range v.Attachments {
				if _, err := c.initiators([]accessmode.Attachment{a}); err != nil {
					klog.ErrorS(err, "A node attached to a volume cannot be let in to it; it is left out of the volume's access list", "volume", v.ID, "node", a.Node.String())
					continue
				}
				servable = append(servable, a)
			}
			if err := c.serve(ctx, v, id, servable); err != nil {
				return nil, fmt.Errorf("serving volume %s again: %w", v.ID, err)
			}
		}
	}
	return c, nil
}

// lunName names the volume in configfs and in its target's IQN: a hash
// of its id, so that volumes of one name in two pools differ and the name
// fits LIO's.
func lunName(id volumeid.ID) string {
	sum := sha256.Sum256([]byte("lun\x00" + id.String()))
	return "mg-" + hex.EncodeToString(sum[:])[:24]
}

// Serial is the volume's unit serial (iscsi.VolumeSerial).
func Serial(id volumeid.ID) string { return iscsi.VolumeSerial(id.String()) }

// withContext adds what a node needs to reach v.
func (c *Controller) withContext(v *backend.Volume) *backend.Volume {
	if v == nil {
		return nil
	}
	id, err := volumeid.Parse(v.ID)
	if err != nil {
		return v
	}
	if v.Context == nil {
		v.Context = map[string]string{}
	}
	maps.Copy(v.Context, iscsi.Volume{Target: c.target.IQN(lunName(id)), Portal: c.portal, Serial: Serial(id)}.Context())
	return v
}

// initiators is the access list for attachments: every attached node's
// initiator name, read-only as attached, with its CHAP secret; a fenced
// node is left off, which ends its sessions (lio.Target.SetInitiators).
func (c *Controller) initiators(attachments []accessmode.Attachment) ([]lio.Initiator, error) {
	var list []lio.Initiator
	for _, a := range accessmode.Served(attachments) {
		n := a.Node
		if n.Initiator == "" {
			return nil, status.Errorf(codes.FailedPrecondition,
				"node %s reports no iSCSI initiator name, and this volume is served over iSCSI: start its node plugin with --iscsi-initiator-name-file", n.Name)
		}
		secret, err := os.ReadFile(filepath.Join(c.chapDir, n.Name))
		if err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "node %s has no CHAP secret in %s (a key %q in the target's CHAP Secret): %v", n.Name, c.chapDir, n.Name, err)
		}
		s := strings.TrimRight(string(secret), "\r\n")
		if !iscsi.ValidCHAPSecret(s) {
			return nil, status.Errorf(codes.FailedPrecondition, "node %s's CHAP secret in %s is not 12 to 255 printable ASCII characters without blanks", n.Name, c.chapDir)
		}
		list = append(list, lio.Initiator{IQN: n.Initiator, ReadOnly: a.ReadOnly, User: n.Name, Secret: s})
	}
	return list, nil
}

// serve exports v (idempotent) with the access list of attachments.
func (c *Controller) serve(ctx context.Context, v *backend.Volume, id volumeid.ID, attachments []accessmode.Attachment) error {
	list, err := c.initiators(attachments)
	if err != nil {
		return err
	}
	image, err := c.Controller.ImagePath(id)
	if err != nil {
		return err
	}
	dev, err := device(ctx, image)
	if err != nil {
		return status.Errorf(codes.Internal, "serving %s: %v", id, err)
	}
	name := lunName(id)
	if err := c.target.Export(lio.LUN{Name: name, Image: dev, Size: v.CapacityBytes, Serial: Serial(id)}); err != nil {
		return status.Errorf(codes.Internal, "exporting %s over iSCSI: %v", id, err)
	}
	if err := c.target.SetInitiators(name, list); err != nil {
		return status.Errorf(codes.Internal, "setting the iSCSI access list of %s: %v", id, err)
	}
	return nil
}

func (c *Controller) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	v, err := c.Controller.CreateVolume(ctx, spec)
	if err != nil {
		return nil, err
	}
	if err := c.serve(ctx, v, spec.ID, v.Attachments); err != nil {
		return nil, err
	}
	return c.withContext(v), nil
}

func (c *Controller) Volume(ctx context.Context, id volumeid.ID) (*backend.Volume, error) {
	v, err := c.Controller.Volume(ctx, id)
	return c.withContext(v), err
}

// SetAttachments changes the target, then the record (see the package
// comment). When the record cannot be written, the target is set back to
// the recorded list, so the two agree again; the caller gets the error.
func (c *Controller) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	old, err := c.Controller.Volume(ctx, id)
	if err != nil {
		return nil, err
	}
	if err := c.serve(ctx, old, id, attachments); err != nil {
		return nil, err
	}
	v, err := c.Controller.RecordAttachments(ctx, id, attachments)
	if err != nil {
		if rerr := c.serve(context.WithoutCancel(ctx), old, id, old.Attachments); rerr != nil {
			klog.ErrorS(rerr, "Setting the iSCSI access list back to the record after the record could not be written", "volume", id.String())
		}
		return nil, err
	}
	return c.withContext(v), nil
}

// DeleteVolume takes the volume off the target first, then lets go of
// its device: the image goes only once no node can reach it.
func (c *Controller) DeleteVolume(ctx context.Context, id volumeid.ID) error {
	if err := c.target.Unexport(lunName(id)); err != nil {
		return status.Errorf(codes.Internal, "unexporting %s: %v", id, err)
	}
	image, err := c.Controller.ImagePath(id)
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	current, stale, err := loop.Bound(image)
	if err != nil {
		return status.Errorf(codes.Internal, "looking for the device of %s: %v", id, err)
	}
	for _, dev := range append(current, stale...) {
		if _, err := loop.DetachIfBackedBy(ctx, dev, image); err != nil {
			return status.Errorf(codes.Internal, "detaching %s, the device %s was served from: %v", dev, id, err)
		}
	}
	return c.Controller.DeleteVolume(ctx, id)
}

// ExpandVolume grows the image, then its device, which LIO serves at its
// size of the moment: the nodes see the new size at their next rescan
// (NodeExpandVolume).
func (c *Controller) ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*backend.Volume, error) {
	v, err := c.Controller.ExpandVolume(ctx, id, bytes)
	if err != nil {
		return nil, err
	}
	image, err := c.Controller.ImagePath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	dev, err := device(ctx, image)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "growing %s: %v", id, err)
	}
	if err := loop.Refresh(ctx, dev); err != nil {
		return nil, status.Errorf(codes.Internal, "growing %s's device %s: %v", id, dev, err)
	}
	if size, err := loop.Size(dev); err != nil || size < v.CapacityBytes {
		return nil, status.Errorf(codes.Internal, "%s's device %s has %d bytes after growing to %d (%v)", id, dev, size, v.CapacityBytes, err)
	}
	return c.withContext(v), nil
}

// device is the loop device LIO serves image through: the one bound to it
// already (LIO keeps it open across a restart of this process), or a new
// one. It is read/write: the access list, not the device, decides who
// writes. A device under the image is what lets the volume grow while
// served: LIO reads a block device's size anew for every READ CAPACITY,
// where a file backstore keeps the size it was enabled with.
func device(ctx context.Context, image string) (string, error) {
	current, _, err := loop.Bound(image)
	if err != nil {
		return "", err
	}
	switch len(current) {
	case 0:
		dev, err := loop.Attach(ctx, image, false)
		if err != nil {
			return "", err
		}
		return dev.Path, nil
	case 1:
		return current[0], nil
	}
	return "", fmt.Errorf("%d loop devices are bound to %s (%s); there should be one", len(current), image, strings.Join(current, ", "))
}

// writers is who may be writing a volume's image besides its read-write
// attachments: whoever its target lets write, as LIO says. The device
// under the image is read/write for every volume and says nothing.
func (c *Controller) writers(id volumeid.ID, image string) (string, error) {
	list, err := c.target.Initiators(lunName(id))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", nil // not served: nobody reaches it
		}
		return "", err
	}
	for _, i := range list {
		if !i.ReadOnly {
			return "writable by " + i.IQN + " at the iSCSI target", nil
		}
	}
	return "", nil
}

func (c *Controller) ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*backend.Volume, error) {
	v, err := c.Controller.ModifyVolume(ctx, id, mutable)
	return c.withContext(v), err
}

func (c *Controller) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	list, err := c.Controller.ListVolumes(ctx)
	for _, v := range list {
		c.withContext(v)
	}
	return list, err
}

func (c *Controller) VolumesOn(ctx context.Context, node string) ([]*backend.Volume, error) {
	list, err := c.Controller.VolumesOn(ctx, node)
	for _, v := range list {
		c.withContext(v)
	}
	return list, err
}

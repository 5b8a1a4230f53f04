// This file holds the loop transport: a node that shares a zone's pool
// attaches a volume's image there as a loop device. Nothing but the
// pool's metadata stands between a node and an image, so the node itself
// refuses a stage the controller has not attached, and every device is
// checked to be bound to the very image (same inode) before it is used,
// refreshed or detached: the kernel reuses loop device names.

package block

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/loop"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

var _ transport = (*loopTransport)(nil)

// loopTransport reaches the volumes of the zones whose pools this node
// shares. It never writes to a pool: what it may do is decided by the
// metadata the controller wrote.
type loopTransport struct {
	pools map[string]*pool
	zones []string
}

// fpStageAttached is the step after the loop device is bound, before
// anything records it.
var fpStageAttached = faultpoint.New("block.stage.attached")

// shares tells whether this node has the zone's pool.
func (t *loopTransport) shares(zone string) bool {
	_, ok := t.pools[zone]
	return ok
}

// locate finds a volume's pool and image on this node. A zone without a
// pool here is a scheduling problem, not a missing volume.
func (t *loopTransport) locate(id volumeid.ID) (*pool, string, error) {
	if id.Backend != accessmode.BackendBlock || id.Kind != volumeid.Volume {
		return nil, "", status.Errorf(codes.InvalidArgument, "%s is not a block volume id", id)
	}
	p, ok := t.pools[id.Zone]
	if !ok {
		return nil, "", status.Errorf(codes.FailedPrecondition,
			"this node has no block pool for zone %q (it has: %s); the volume can only be staged on nodes in its zone", id.Zone, strings.Join(t.zones, ", "))
	}
	image, err := p.imagePath(id)
	if err != nil {
		return nil, "", status.Error(codes.Internal, err.Error())
	}
	return p, image, nil
}

func (t *loopTransport) readVolume(p *pool, id volumeid.ID) (*backend.Volume, error) {
	metaPath, err := p.metaPath(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	var v backend.Volume
	if err := fsutil.ReadJSON(metaPath, &v); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			if serr := p.checkShared(); serr != nil {
				return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not in this node's pool: %v", id, serr)
			}
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", id)
		}
		return nil, status.Errorf(codes.Internal, "reading metadata of %s: %v", id, err)
	}
	return &v, nil
}

// admit refuses a node the controller has not attached: the pool is
// shared, so this check is what keeps a node from using a volume
// ControllerPublishVolume never granted it.
func (t *loopTransport) admit(req backend.StageRequest) (admission, error) {
	p, _, err := t.locate(req.VolumeID)
	if err != nil {
		return admission{}, err
	}
	vol, err := t.readVolume(p, req.VolumeID)
	if err != nil {
		return admission{}, err
	}
	att, attached := attachmentOf(vol.Attachments, req.Node)
	if !attached {
		return admission{}, status.Errorf(codes.FailedPrecondition,
			"volume %s is not attached to node %s (attached to: %s); ControllerPublishVolume must succeed first",
			vol.ID, req.Node, describeAttachments(vol.Attachments))
	}
	if !req.ReadOnly && (att.ReadOnly || accessmode.IsReadOnly(att.Mode)) {
		// The servers combine this already; refusing here as well keeps a
		// read-only attachment read-only even if a caller gets it wrong.
		return admission{}, status.Errorf(codes.FailedPrecondition,
			"volume %s is attached to node %s read-only (%s); a read/write stage is refused", vol.ID, req.Node, accessmode.Name(att.Mode))
	}
	if req.Mode != 0 && !accessmode.Within(req.Mode, att.Mode) {
		return admission{}, status.Errorf(codes.FailedPrecondition,
			"volume %s is attached to node %s as %s; a stage as %s would allow more than that", vol.ID, req.Node,
			accessmode.Name(att.Mode), accessmode.Name(req.Mode))
	}
	if req.AccessType != vol.AccessType {
		return admission{}, status.Errorf(codes.FailedPrecondition,
			"volume %s was created for access type %s, not %s", vol.ID, vol.AccessType, req.AccessType)
	}
	kib, hasReadAhead := vol.ReadAheadKiB()
	return admission{
		fsType:       vol.FsType,
		readAheadKiB: kib,
		hasReadAhead: hasReadAhead,
		writable:     !accessmode.AllReadOnly(vol.Modes),
	}, nil
}

// attachmentOf finds this node's attachment by its key: the controller
// records the id the node had when it was attached, and the node may have
// restarted under a new address since.
func attachmentOf(attachments []accessmode.Attachment, node nodeid.Node) (accessmode.Attachment, bool) {
	for _, a := range attachments {
		if a.Node.Name == node.Name {
			return a, true
		}
	}
	return accessmode.Attachment{}, false
}

func describeAttachments(attachments []accessmode.Attachment) string {
	if len(attachments) == 0 {
		return "no node"
	}
	names := make([]string, 0, len(attachments))
	for _, a := range attachments {
		names = append(names, a.Node.String())
	}
	return strings.Join(names, ", ")
}

// attach binds the image to a loop device, read-only when the stage is, so
// that the kernel itself refuses writes (EROFS) whatever the mount flags
// say.
func (t *loopTransport) attach(ctx context.Context, req backend.StageRequest) (string, error) {
	_, image, err := t.locate(req.VolumeID)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(image); err != nil {
		return "", status.Errorf(codes.Internal, "image of volume %s: %v", req.VolumeID, err)
	}
	// A stage interrupted between attaching and recording (the plugin
	// killed) leaves a device bound to the image that nothing uses; the
	// retry detaches it rather than binding the image once more and
	// leaking it. Only then: where several node plugins share one kernel
	// (tests), another's staged raw block device looks unused too.
	if req.Recover {
		if err := detachUnused(ctx, req.VolumeID.String(), image); err != nil {
			return "", err
		}
	}
	dev, err := loop.Attach(ctx, image, req.ReadOnly)
	if err != nil {
		return "", status.Errorf(codes.Internal, "attaching volume %s: %v", req.VolumeID, err)
	}
	fpStageAttached.Hit()
	return dev.Path, nil
}

// release detaches the staged loop device, but only while it is bound to
// this volume's image: the kernel reuses device names, and another
// volume's device must never be taken away. With no device recorded (an
// interrupted stage being undone), it detaches the devices bound to the
// image that nothing uses.
func (t *loopTransport) release(ctx context.Context, id volumeid.ID, staged *backend.Staged) error {
	_, image, err := t.locate(id)
	if err != nil {
		return err
	}
	if staged.Device == "" {
		return detachUnused(ctx, staged.VolumeID, image)
	}
	if !loop.ValidDevice(staged.Device) {
		return status.Errorf(codes.Internal, "staged device %q is not a loop device; refusing to touch it", staged.Device)
	}
	if _, err := loop.DetachIfBackedBy(ctx, staged.Device, image); err != nil {
		return status.Errorf(codes.Internal, "detaching %s: %v", staged.Device, err)
	}
	return nil
}

// detachUnused detaches the loop devices bound to image that nothing uses
// (no mount of their filesystem, no bind mount of their node).
func detachUnused(ctx context.Context, volumeID, image string) error {
	unused, err := loop.Unused(image)
	if err != nil {
		return status.Errorf(codes.Internal, "looking for loop devices left bound to %s: %v", image, err)
	}
	for _, d := range unused {
		if _, err := loop.DetachIfBackedBy(ctx, d, image); err != nil {
			return status.Errorf(codes.Internal, "detaching %s, left bound to %s: %v", d, image, err)
		}
		klog.InfoS("Detached a loop device an interrupted stage left bound to the volume's image", "volumeID", volumeID, "device", d)
	}
	return nil
}

// bound compares by inode: a device still bound to a deleted image of
// this name is not the volume's.
func (t *loopTransport) bound(id volumeid.ID, device string) (bool, bool, error) {
	_, image, err := t.locate(id)
	if err != nil || device == "" {
		return false, false, err
	}
	if ours, err := boundTo(device, image); err != nil || !ours {
		return false, false, err
	}
	ro, err := loop.ReadOnly(device)
	if err != nil {
		return false, false, status.Errorf(codes.Internal, "inspecting %s: %v", device, err)
	}
	return true, ro, nil
}

// owns takes a loop device bound to the volume's image: the staged device
// and every read-only device made over the image alike.
func (t *loopTransport) owns(id volumeid.ID, name string) (bool, error) {
	_, image, err := t.locate(id)
	if err != nil {
		return false, err
	}
	dev := "/dev/" + name
	if !loop.ValidDevice(dev) {
		return false, nil
	}
	return boundTo(dev, image)
}

// health checks that the image and the loop device bound to it are still
// in place.
func (t *loopTransport) health(id volumeid.ID, staged *backend.Staged) backend.Health {
	_, image, err := t.locate(id)
	if err != nil {
		return backend.Health{Abnormal: true, Reason: "NoPool", Message: status.Convert(err).Message()}
	}
	if _, err := os.Stat(image); err != nil {
		return backend.Health{Abnormal: true, Reason: "ImageMissing", Message: fmt.Sprintf("the volume's image is gone: %v", err)}
	}
	backing, err := loop.BackingFile(staged.Device)
	switch {
	case err != nil:
		return backend.Health{Abnormal: true, Reason: "LoopDeviceUnreadable", Message: err.Error()}
	case backing == "":
		return backend.Health{Abnormal: true, Reason: "LoopDeviceDetached", Message: fmt.Sprintf("loop device %s is no longer attached", staged.Device)}
	}
	if ours, err := loop.NamedBy(staged.Device, image); err != nil || !ours {
		return backend.Health{Abnormal: true, Reason: "LoopDeviceReassigned", Message: fmt.Sprintf("loop device %s is now backed by %s, not by the volume's image", staged.Device, backing)}
	}
	if same, err := loop.BoundTo(staged.Device, image); err != nil || !same {
		return backend.Health{Abnormal: true, Reason: "ImageReplaced", Message: fmt.Sprintf("loop device %s is backed by another file of the volume's image name (%s), not by the image there now", staged.Device, backing)}
	}
	return backend.Health{}
}

// refresh has the loop device take the image's size. The image itself,
// by inode: a device still bound to a deleted image of this name would be
// refreshed to that file's size. The kernel lets a read-only loop device
// take a new capacity: the flag forbids writes to the device, not a change
// of its size.
func (t *loopTransport) refresh(ctx context.Context, id volumeid.ID, staged *backend.Staged) (int64, error) {
	_, image, err := t.locate(id)
	if err != nil {
		return 0, err
	}
	if ours, err := boundTo(staged.Device, image); err != nil {
		return 0, err
	} else if !ours {
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s is not attached at %s any more; stage it again", staged.VolumeID, staged.Device)
	}
	if err := loop.Refresh(ctx, staged.Device); err != nil {
		return 0, status.Errorf(codes.Internal, "refreshing size of %s: %v", staged.Device, err)
	}
	size, err := loop.Size(staged.Device)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "reading size of %s: %v", staged.Device, err)
	}
	return size, nil
}

// modes come from the volume's metadata; nil if it cannot be read.
func (t *loopTransport) modes(id volumeid.ID) []accessmode.Mode {
	p, _, err := t.locate(id)
	if err != nil {
		return nil
	}
	vol, err := t.readVolume(p, id)
	if err != nil {
		return nil
	}
	return vol.Modes
}

// viewSource binds the image once more.
func (t *loopTransport) viewSource(id volumeid.ID, staged *backend.Staged) (string, error) {
	_, image, err := t.locate(id)
	return image, err
}

// releaseView detaches a device still bound to the volume's image (a
// device since reused for another image stays).
func (t *loopTransport) releaseView(ctx context.Context, id volumeid.ID, device string) error {
	_, image, err := t.locate(id)
	if err != nil {
		return err
	}
	if _, err := loop.DetachIfBackedBy(ctx, device, image); err != nil {
		return status.Errorf(codes.Internal, "detaching %s: %v", device, err)
	}
	return nil
}

package driver

// ControllerPublishVolume and ControllerUnpublishVolume: which nodes may
// hold a volume. The decision is accessmode.DecideAttach's; these calls
// gather its facts under the volume's and the node's locks and the fence
// gate, and apply its answer through the backend.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

func attachedNodes(vol *backend.Volume) string {
	var out []string
	for _, a := range vol.Attachments {
		rw := "rw"
		if a.ReadOnly {
			rw = "ro"
		}
		out = append(out, fmt.Sprintf("%s (%s, %s)", a.Node, accessmode.Name(a.Mode), rw))
	}
	return strings.Join(out, ", ")
}

func (s *controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	if req.GetNodeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "node id is required")
	}
	accessType, fsType, mode, err := parseCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	id, ctrl, vol, release, err := s.d.lockedVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer release()
	node, err := nodeid.Parse(req.GetNodeId())
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "node %q is not known to this driver, whose node plugins report ids of the form %s: %v",
			req.GetNodeId(), nodeid.Format, err)
	}
	unlockNode, err := s.d.nodes.lock(ctx, node.Name)
	if err != nil {
		return nil, err
	}
	defer unlockNode()
	// Read under the node's lock, so that two attaches to the node cannot
	// both pass its volume limit.
	held, err := s.d.heldBy(ctx, node.Name)
	if err != nil {
		return nil, err
	}
	// Until the attachment is recorded, the fence list cannot change.
	s.d.fenceGate.RLock()
	defer s.d.fenceGate.RUnlock()
	fencedBy, err := s.d.fencedBy(ctx, node)
	if err != nil {
		return nil, err
	}
	_, overISCSI, _ := iscsi.FromContext(vol.ID, vol.Context)
	decision := accessmode.DecideAttach(accessmode.AttachFacts{
		VolumeID: vol.ID, Backend: id.Backend, ServedOverISCSI: overISCSI, VolumeZone: vol.Zone,
		VolumeAccessType: vol.AccessType, VolumeFsType: vol.FsType, VolumeModes: vol.Modes, Attachments: vol.Attachments,
		AccessType: accessType, FsType: fsType, Mode: mode, ReadOnly: req.GetReadonly(),
		Node:        node,
		NodeVolumes: len(held), NodeHeld: heldZones(node.Name, held),
		FencedBy: fencedBy, FencesInForce: s.d.fenceBlocks(),
	})
	if decision.FollowNode {
		if now, err := s.d.followNode(ctx, node, held, vol.ID); err != nil {
			return nil, err
		} else if now != nil {
			vol = now
		}
	}
	if !decision.Allowed() {
		return nil, s.d.refuseAttach(id, mode, decision.Decision, "node", req.GetNodeId())
	}
	want := decision.Attachment
	if !decision.Idempotent {
		// The others' marks follow the list too, which mends what a
		// fence pass could not reach.
		attachments, _, err := s.d.withFences(ctx, append(slices.Clone(vol.Attachments), want))
		if err != nil {
			return nil, err
		}
		if _, err := ctrl.SetAttachments(ctx, id, attachments); err != nil {
			return nil, err
		}
		klog.InfoS("Volume published to node", "volumeID", vol.ID, "node", req.GetNodeId(),
			"mode", accessmode.Name(mode), "readOnly", want.ReadOnly)
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{
		PublishContextReadOnly: strconv.FormatBool(want.ReadOnly),
		PublishContextMode:     accessmode.Name(mode),
		PublishContextCapacity: strconv.FormatInt(vol.CapacityBytes, 10),
	}}, nil
}

func (s *controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	}
	id, err := volumeid.ParseKind(req.GetVolumeId(), volumeid.Volume)
	if err != nil {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	release, err := s.d.locks.acquire(id.String())
	if err != nil {
		return nil, err
	}
	defer release()
	_, ctrl, vol, err := s.d.lookupVolume(ctx, req.GetVolumeId())
	if status.Code(err) == codes.NotFound {
		// The spec: a volume that cannot be found is unpublished already.
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if req.GetNodeId() == "" {
		// Every node: nothing to match, no node to follow.
		if len(vol.Attachments) > 0 {
			if _, err := ctrl.SetAttachments(ctx, id, nil); err != nil {
				return nil, err
			}
			klog.InfoS("Volume unpublished from every node", "volumeID", vol.ID)
		}
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	// The node is matched by its key, so a node that came back under a
	// new address can still let go of what it held under the old one,
	// and one whose id this driver cannot parse (a node plugin of another
	// version) of what it held under an id it could.
	node, err := nodeid.Parse(req.GetNodeId())
	parsed := err == nil
	key := node.Name
	if !parsed {
		key = nodeid.KeyOf(req.GetNodeId())
	}
	unlockNode, err := s.d.nodes.lock(ctx, key)
	if err != nil {
		return nil, err
	}
	defer unlockNode()
	// The marks of those who stay follow the fence list, as on publish.
	s.d.fenceGate.RLock()
	defer s.d.fenceGate.RUnlock()
	keep := slices.DeleteFunc(slices.Clone(vol.Attachments), func(a accessmode.Attachment) bool { return a.Node.Name == key })
	if len(keep) < len(vol.Attachments) {
		keep, _, err := s.d.withFences(ctx, keep)
		if err != nil {
			return nil, err
		}
		if _, err := ctrl.SetAttachments(ctx, id, keep); err != nil {
			return nil, err
		}
		klog.InfoS("Volume unpublished from node", "volumeID", vol.ID, "node", req.GetNodeId())
	}
	// The id is the node's newest: what else it holds follows it, unless
	// it claims another zone (which its publishes then refuse).
	if !parsed {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	held, err := s.d.heldBy(ctx, key)
	if err != nil {
		return nil, err
	}
	if accessmode.CheckNodeZone(node.Name, node.Zone, heldZones(node.Name, held)).Allowed() {
		if _, err := s.d.followNode(ctx, node, held, vol.ID); err != nil {
			return nil, err
		}
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

package accessmode

import (
	"time"

	"google.golang.org/grpc/codes"
)

// Workload names the pod (or allocation) behind a target path, when the CO
// tells the driver (Kubernetes does with podInfoOnMount).
type Workload struct {
	Name      string `json:"name,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	UID       string `json:"uid,omitempty"`
}

// String is how a workload is named in messages.
func (w Workload) String() string {
	switch {
	case w.Name == "":
		return "an unnamed workload"
	case w.Namespace == "":
		return "pod " + w.Name
	default:
		return "pod " + w.Namespace + "/" + w.Name
	}
}

// Holder is one workload's hold on a volume within a node, as recorded in the
// node's lock file at NodePublishVolume.
type Holder struct {
	TargetPath string `json:"targetPath"`
	Mode       Mode   `json:"mode"`
	ReadOnly   bool   `json:"readOnly"`
	// Fingerprint identifies every other argument of the publish (the
	// spec's P): a repeat with the same target and another fingerprint is
	// ALREADY_EXISTS.
	Fingerprint string    `json:"fingerprint"`
	Workload    Workload  `json:"workload,omitempty"`
	Since       time.Time `json:"since"`
	// Device is a device made for this holder alone: a read-only publish of
	// a raw block volume staged read/write gets its own read-only loop
	// device, because the kernel does not honour a read-only bind mount of
	// a device node. Empty otherwise.
	Device string `json:"device,omitempty"`
}

// CheckPublish decides whether req may join the holders already on this node
// (NodePublishVolume), following the spec's table for a plugin that
// advertises SINGLE_NODE_MULTI_WRITER.
func CheckPublish(holders []Holder, req Holder) Decision {
	if !Valid(req.Mode) {
		return refuse(codes.InvalidArgument, ReasonInvalidMode, "access mode %v is not a defined CSI access mode", req.Mode)
	}
	for _, h := range holders {
		if h.TargetPath != req.TargetPath {
			continue
		}
		if h.Fingerprint == req.Fingerprint {
			return repeat()
		}
		return refuse(codes.AlreadyExists, ReasonPublishedWithOtherArguments,
			"volume is already published at %s with other arguments (mode %s, readonly=%t); unpublish it there first",
			h.TargetPath, Name(h.Mode), h.ReadOnly)
	}
	for _, h := range holders {
		if SingleWorkload(req.Mode) || SingleWorkload(h.Mode) {
			single := req.Mode // name the mode that forbids a second workload
			if !SingleWorkload(single) {
				single = h.Mode
			}
			return refuse(codes.FailedPrecondition, ReasonHeldByOtherWorkload,
				"volume is in use by %s at %s; access mode %s allows one workload at a time: stop that workload first",
				h.Workload, h.TargetPath, Name(single))
		}
		if h.Mode != req.Mode {
			// The spec asks COs not to publish one volume with two
			// capabilities on one node, and plugins to refuse it.
			return refuse(codes.FailedPrecondition, ReasonOtherAccessMode,
				"volume is published on this node as %s (at %s); a second publish as %s is refused: use one access mode per node",
				Name(h.Mode), h.TargetPath, Name(req.Mode))
		}
	}
	return allow()
}

// CheckWithinNode decides whether a stage or publish as req stays within the
// mode the volume holds on this node: the mode ControllerPublishVolume
// attached it with (checked at stage, as held="attached"), or the mode the
// stage was made with (checked at publish, as held="staged"). Without it a
// volume attached as SINGLE_NODE_SINGLE_WRITER could be staged and
// published as SINGLE_NODE_MULTI_WRITER and reach two workloads.
func CheckWithinNode(held Mode, heldAs string, req Mode) Decision {
	if !Valid(req) {
		return refuse(codes.InvalidArgument, ReasonInvalidMode, "access mode %v is not a defined CSI access mode", req)
	}
	if !Valid(held) {
		return refuse(codes.FailedPrecondition, ReasonBeyondNodeMode,
			"the mode the volume was %s with on this node is unknown (%v); %s it again", heldAs, held, redo(heldAs))
	}
	if Within(req, held) {
		return allow()
	}
	return refuse(codes.FailedPrecondition, ReasonBeyondNodeMode,
		"volume is %s on this node as %s; %s would allow more than that: use the capability it was %s with, or %s it again as %s",
		heldAs, Name(held), Name(req), heldAs, redo(heldAs), Name(req))
}

func redo(heldAs string) string {
	if heldAs == "attached" {
		return "unpublish it from this node and publish it"
	}
	return "unstage it and stage it"
}

// CheckNodePublish is the whole rule of NodePublishVolume: the publish stays
// within the mode the volume was attached to this node with and the mode it
// was staged with, and the spec's table lets it join the workloads already
// holding the volume here (CheckPublish).
func CheckNodePublish(attached, staged Mode, holders []Holder, req Holder) Decision {
	if d := CheckWithinNode(attached, "attached", req.Mode); !d.Allowed() {
		return d
	}
	if d := CheckWithinNode(staged, "staged", req.Mode); !d.Allowed() {
		return d
	}
	return CheckPublish(holders, req)
}

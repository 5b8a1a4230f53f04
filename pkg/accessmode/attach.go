package accessmode

import (
	"encoding/json"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/nodeid"
)

// Attachment is one node's hold on a volume, as the controller records it at
// ControllerPublishVolume.
type Attachment struct {
	// Node is the node as its id said when it was attached (or when the
	// attachment last followed the node's newer id); a record holds it as
	// that id string. Attachments are matched by its key (Node.Name), not
	// by the whole id, whose zone, address and limit are attributes a node
	// may report differently after a restart.
	Node     nodeid.Node `json:"nodeID"`
	Mode     Mode        `json:"mode"`
	ReadOnly bool        `json:"readOnly"`
	// Fingerprint identifies the rest of the capability (access type, fs
	// type, mount flags): the same node asking again with another one is
	// refused with ALREADY_EXISTS rather than silently changed.
	Fingerprint string `json:"fingerprint,omitempty"`
	// Fenced says the node is cut off from the volume by a network fence
	// (csi-addons NetworkFence) while the CO still has it attached: the
	// storage serves it nothing, but the attachment still counts for the
	// rules, so the volume is not free for another writer until the CO
	// unpublishes the fenced node (its force-detach).
	Fenced bool `json:"fenced,omitempty"`
}

// UnmarshalJSON loads a recorded attachment, refusing one that names no
// node (its node id missing or null): it would match no node, and a volume
// held by a node the record no longer names could be given to another.
func (a *Attachment) UnmarshalJSON(data []byte) error {
	type plain Attachment // without this method
	var r plain
	if err := json.Unmarshal(data, &r); err != nil {
		return err
	}
	if r.Node == (nodeid.Node{}) {
		return errors.New("an attachment names no node (no nodeID)")
	}
	*a = Attachment(r)
	return nil
}

// Served is the attachments the storage must serve: every one but the
// fenced. An export's client list and a target's access list are these.
func Served(attachments []Attachment) []Attachment {
	var out []Attachment
	for _, a := range attachments {
		if !a.Fenced {
			out = append(out, a)
		}
	}
	return out
}

// CheckAttach decides whether req may join the existing attachments
// (ControllerPublishVolume, across nodes). req.ReadOnly must already be the
// effective value (see EffectiveReadOnly). Nodes are told apart by their
// key (Attachment.Node.Name): a node asking again under a new address is
// the same node.
func CheckAttach(existing []Attachment, req Attachment) Decision {
	if !Valid(req.Mode) {
		return refuse(codes.InvalidArgument, ReasonInvalidMode, "access mode %v is not a defined CSI access mode", req.Mode)
	}
	var others []Attachment
	for _, a := range existing {
		if a.Node.Name != req.Node.Name {
			others = append(others, a)
			continue
		}
		if a.Mode == req.Mode && a.ReadOnly == req.ReadOnly && a.Fingerprint == req.Fingerprint {
			return repeat()
		}
		return refuse(codes.AlreadyExists, ReasonPublishedWithOtherArguments,
			"volume is already published to node %q as %s (readonly=%t) with another capability; unpublish it from that node first",
			a.Node, Name(a.Mode), a.ReadOnly)
	}
	if len(others) == 0 {
		return allow()
	}
	want, _ := limitsOf(req.Mode)
	if want.nodes == 1 {
		return refuse(codes.FailedPrecondition, ReasonHeldByOtherNode,
			"volume is published to node %q; access mode %s allows one node at a time: unpublish it there (stop the workload) before publishing to node %q",
			others[0].Node, Name(req.Mode), req.Node)
	}
	// Every holder's mode bounds the writer nodes of all of them, the
	// request's included, and whether or not the request itself writes: a
	// reader whose mode allows no writer may no more join a writer than a
	// writer may join it, so the outcome does not depend on who came first.
	writerLimit, limiter := want.writerNodes, req
	writers := []string{}
	for _, o := range others {
		l, _ := limitsOf(o.Mode)
		if l.nodes == 1 {
			return refuse(codes.FailedPrecondition, ReasonHeldByOtherNode,
				"volume is published to node %q as %s, which allows one node at a time; unpublish it there before publishing to node %q",
				o.Node, Name(o.Mode), req.Node)
		}
		if l.writerNodes < writerLimit {
			writerLimit, limiter = l.writerNodes, o
		}
		if !o.ReadOnly {
			writers = append(writers, o.Node.String())
		}
	}
	total := len(writers)
	if !req.ReadOnly {
		total++
	}
	if total <= writerLimit {
		return allow()
	}
	allows := "no writer node"
	if writerLimit == 1 {
		allows = "one writer node"
	}
	rule := fmt.Sprintf("access mode %s allows %s", Name(req.Mode), allows)
	if limiter.Node.Name != req.Node.Name {
		rule = fmt.Sprintf("node %q holds it as %s, which allows %s", limiter.Node, Name(limiter.Mode), allows)
	}
	if len(writers) == 0 { // req is the only writer
		if limiter.Node.Name == req.Node.Name {
			return refuse(codes.FailedPrecondition, ReasonWriterLimit,
				"volume is published read-only to node %q; access mode %s allows no writer node; publish read-only instead",
				others[0].Node, Name(req.Mode))
		}
		return refuse(codes.FailedPrecondition, ReasonWriterLimit,
			"volume is published read-only to node %q as %s, which allows no writer node; publish read-only instead",
			limiter.Node, Name(limiter.Mode))
	}
	advice := "publish read-only or unpublish it there first"
	if req.ReadOnly {
		advice = "unpublish it there first"
	}
	return refuse(codes.FailedPrecondition, ReasonWriterLimit,
		"volume is published read/write to node %q; %s; %s", writers[0], rule, advice)
}

// SoleWriterLeft reports whether a node that was a volume's only permitted
// writer wrote under the attachments old and does not under now: it was
// unpublished (perhaps force-detached after it died, which looks the same)
// or holds the volume read-only now, and its mode allows one writer node
// (every SINGLE_NODE_* mode that writes, MULTI_NODE_SINGLE_WRITER). A
// server must then drop what that node's client holds on the volume, its
// open files and locks, before the next writer comes: a partitioned client
// keeps its lease alive through its other volumes, and its locks would
// block the new writer forever. With several writer nodes allowed
// (MULTI_NODE_MULTI_WRITER) the writers that stay share that state, and a
// node leaving frees nothing of theirs. A fenced attachment writes nothing:
// fencing the sole writer is its leaving, and unpublishing it afterwards
// is not.
func SoleWriterLeft(old, now []Attachment) bool {
	writesNow := map[string]bool{}
	for _, a := range Served(now) {
		if !a.ReadOnly {
			writesNow[a.Node.Name] = true
		}
	}
	for _, a := range Served(old) {
		if a.ReadOnly || writesNow[a.Node.Name] {
			continue
		}
		if l, ok := limitsOf(a.Mode); ok && l.writerNodes == 1 {
			return true
		}
	}
	return false
}

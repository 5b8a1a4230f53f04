package accessmode

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

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

// AttachFacts is everything the attach decision depends on, gathered by
// the controller under the volume's and the node's locks and the fence
// gate: the volume's record, the CO's request, the node as its id
// describes it, what the node holds, and the network fences.
type AttachFacts struct {
	// The volume, as recorded.
	VolumeID string
	Backend  Backend
	// ServedOverISCSI says the volume's storage target serves it over
	// iSCSI (the volume context names the transport), which lets in only
	// nodes that report an initiator name.
	ServedOverISCSI  bool
	VolumeZone       string // "" for a volume every zone reaches (NFS)
	VolumeAccessType AccessType
	VolumeFsType     string // "" until a filesystem is made
	VolumeModes      []Mode // the modes it was created for
	// Attachments are the volume's, as recorded: the node's own may
	// still carry an older id of it.
	Attachments []Attachment

	// The request's capability and read-only flag, as the CO gave them.
	AccessType AccessType
	FsType     string
	Mode       Mode
	ReadOnly   bool

	// Node is the node asking, as its id parsed.
	Node nodeid.Node

	// NodeVolumes is how many volumes the node holds, this one included
	// if it does.
	NodeVolumes int
	// NodeHeld is each volume the node holds with the zone of the id its
	// attachment was recorded under.
	NodeHeld []HeldVolume

	// FencedBy is the fenced blocks that hold the node's address, or
	// caught the node under an address it had before.
	FencedBy []netip.Prefix
	// FencesInForce is every fenced block (none without a fence list).
	FencesInForce []string
}

// HeldVolume is a volume a node holds and the zone the node id of its
// attachment names.
type HeldVolume struct {
	VolumeID string
	NodeZone string
}

// AttachDecision is DecideAttach's answer. Its Message is whole, as the CO
// sees it. Reason is empty for a refusal that stands whoever holds the
// volume (it was made for another access type or filesystem, the
// transport cannot reach the node): the metrics count the contests over
// who may hold a volume, and these are none.
type AttachDecision struct {
	Decision
	// Attachment is the node's hold as it is to be recorded and answered
	// in the publish context, with its effective read-only flag.
	Attachment Attachment
	// FollowNode says the node's attachments recorded under an older id
	// of it are to follow its id before the answer is given. They follow
	// once the node and the request passed every rule of their own (1 to
	// 6 of DecideAttach), so that a node refused only for the volume's
	// other holders or its own limit still reaches what it holds under
	// its new address; a node refused for itself (another zone, no NFS
	// address, a fence) or for a request the volume cannot take changes
	// nothing.
	FollowNode bool
}

// DecideAttach decides ControllerPublishVolume: may the node hold the
// volume as asked, and what is recorded if so. The rules are applied in
// a fixed order, and the first that refuses is the answer:
//
//  1. the node lies in the volume's zone;
//  2. an NFS volume's node reports the address its export opens to;
//  3. the access type and filesystem are the volume's;
//  4. the mode is within a mode the volume was created for;
//  5. the node reports the zone it holds its other volumes in;
//  6. the node is not fenced, and can be told from a fenced one;
//  7. the volume's holders allow one more (CheckAttach), or the node
//     repeats its own attachment;
//  8. a new attachment leaves the node within its volume limit;
//  9. a volume served over iSCSI lets in only a node with an initiator.
func DecideAttach(f AttachFacts) AttachDecision {
	out := AttachDecision{Attachment: Attachment{
		Node:        f.Node,
		Mode:        f.Mode,
		ReadOnly:    EffectiveReadOnly(f.Mode, f.ReadOnly, false),
		Fingerprint: string(f.AccessType) + "/" + f.FsType,
	}}
	answer := func(d Decision) AttachDecision {
		out.Decision = d
		return out
	}
	if f.VolumeZone != "" && f.Node.Zone != f.VolumeZone {
		return answer(refuse(codes.FailedPrecondition, ReasonOtherZone,
			"volume %s lives in zone %s and node %s is in zone %s; a volume can only be published to nodes of its zone",
			f.VolumeID, f.VolumeZone, f.Node.Name, f.Node.Zone))
	}
	if f.Backend == BackendNFS && f.Node.Address == "" {
		return answer(refuse(codes.FailedPrecondition, "",
			"node %s reported no NFS client address, so no export can be opened to it; start its node plugin with --node-address", f.Node.Name))
	}
	if d := CheckUse(f.VolumeID, f.VolumeAccessType, f.VolumeFsType, f.AccessType, f.FsType); !d.Allowed() {
		return answer(d)
	}
	if d := CheckCreatedModes(f.VolumeID, f.VolumeModes, f.Mode); !d.Allowed() {
		return answer(d)
	}
	if d := CheckNodeZone(f.Node.Name, f.Node.Zone, f.NodeHeld); !d.Allowed() {
		return answer(d)
	}
	if d := checkNotFenced(f); !d.Allowed() {
		return answer(d)
	}
	out.FollowNode = true
	// What the node holds is judged under the id it asks with, as it is
	// recorded once its attachments followed it.
	followed := slices.Clone(f.Attachments)
	for i, a := range followed {
		if a.Node.Name == f.Node.Name {
			followed[i].Node = f.Node
		}
	}
	d := CheckAttach(followed, out.Attachment)
	if !d.Allowed() {
		d.Message = fmt.Sprintf("volume %s: %s", f.VolumeID, d.Message)
		return answer(d)
	}
	if d.Idempotent {
		return answer(d)
	}
	if f.Node.MaxVolumes > 0 && int64(f.NodeVolumes) >= f.Node.MaxVolumes {
		// A CO that ignores NodeGetInfo's limit must still be stopped:
		// loop devices and mounts per node are finite.
		return answer(refuse(codes.ResourceExhausted, ReasonAttachLimit,
			"node %s already holds %d volumes, the limit it reports (--max-volumes-per-node on that node); unpublish one first",
			f.Node.Name, f.NodeVolumes))
	}
	if f.ServedOverISCSI && f.Node.Initiator == "" {
		return answer(refuse(codes.FailedPrecondition, "",
			"node %s reports no iSCSI initiator name, and this volume is served over iSCSI: start its node plugin with --iscsi-initiator-name-file", f.Node.Name))
	}
	return answer(allow())
}

// CheckUse refuses an access type or filesystem the volume was not created
// with.
func CheckUse(volumeID string, created AccessType, createdFsType string, t AccessType, fsType string) Decision {
	if t != created {
		return refuse(codes.InvalidArgument, "", "volume %s was created with access type %s, not %s", volumeID, created, t)
	}
	if fsType != "" && createdFsType != "" && fsType != createdFsType {
		return refuse(codes.InvalidArgument, "", "volume %s holds a %s filesystem, not %s", volumeID, createdFsType, fsType)
	}
	return allow()
}

// CheckCreatedModes refuses a mode that allows more than the modes the
// volume was created for.
func CheckCreatedModes(volumeID string, created []Mode, m Mode) Decision {
	if WithinAny(m, created) {
		return allow()
	}
	return refuse(codes.FailedPrecondition, ReasonModeNotAllowed,
		"volume %s was created for access modes %s; %s would allow more than that", volumeID, Names(created), Name(m))
}

// CheckNodeZone refuses a node that reports a zone other than the one
// its volumes were attached in: a node does not move between zones, and
// a zonal volume must not follow a node that claims to have. A hold whose
// zone is not known ("") proves nothing.
func CheckNodeZone(nodeName, zone string, held []HeldVolume) Decision {
	var inOther []string
	was := ""
	for _, h := range held {
		if h.NodeZone != "" && h.NodeZone != zone {
			was = h.NodeZone
			inOther = append(inOther, h.VolumeID)
		}
	}
	if len(inOther) == 0 {
		return allow()
	}
	return refuse(codes.FailedPrecondition, ReasonOtherZone,
		"node %s now reports zone %s but holds %s as a node of zone %s; a node does not change zones: restart its plugin with --zone=%s, or unpublish those volumes from it first",
		nodeName, zone, strings.Join(inOther, ", "), was, was)
}

// checkNotFenced refuses a fenced node, and a node without an address
// while fences are in force: whether it is fenced cannot be told.
func checkNotFenced(f AttachFacts) Decision {
	if len(f.FencedBy) > 0 {
		where := "an address it had when the fence caught it"
		blocks := make([]string, len(f.FencedBy))
		for i, p := range f.FencedBy {
			blocks[i] = p.String()
			if a, err := netip.ParseAddr(f.Node.Address); err == nil && p.Contains(a) {
				where = "address " + f.Node.Address
			}
		}
		return refuse(codes.FailedPrecondition, ReasonFenced,
			"node %s is fenced from the storage by the network fence on %s (%s): nothing is attached to it until that fence is lifted (UnfenceClusterNetwork; in Kubernetes, its NetworkFence's fenceState set to Unfenced)",
			f.Node.Name, strings.Join(blocks, ", "), where)
	}
	if f.Node.Address == "" && len(f.FencesInForce) > 0 {
		return refuse(codes.FailedPrecondition, ReasonFenced,
			"network fences are in force (%s) and node %s reports no address, so whether it is fenced cannot be told: start its node plugin with --node-address, or lift the fences",
			strings.Join(f.FencesInForce, ", "), f.Node.Name)
	}
	return allow()
}

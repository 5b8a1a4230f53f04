package accessmode

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/nodeid"
)

// The transports a volume reaches a node by, and what each asks of it.
type transport string

const (
	loop      transport = "loop"  // a block pool every node shares: nothing
	overISCSI transport = "iSCSI" // a storage target's block volume: an initiator name
	nfs       transport = "NFS"   // an export: the node's address
)

// The network fences around an attach.
type fenceState string

const (
	notFenced   fenceState = "not fenced"
	nodeFenced  fenceState = "node fenced"
	otherFenced fenceState = "another attachment fenced"
)

const (
	nodeB   = "node-b@zone-a@10.0.0.2@8@iqn.2026-11.io.example:node-b"
	volumeB = "zone-a/block/pv-1"
)

// firstAttach is node-b asking for a volume of tr created for m, which
// nobody holds, with no fence in force.
func firstAttach(tr transport, m Mode) AttachFacts {
	f := AttachFacts{
		VolumeID: volumeB, Backend: BackendBlock, VolumeZone: "zone-a",
		VolumeAccessType: Block, VolumeModes: []Mode{m},
		AccessType: Block, Mode: m,
		Node: nodeid.Node{Name: "node-b", Zone: "zone-a", Address: "10.0.0.2",
			MaxVolumes: 8, Initiator: "iqn.2026-11.io.example:node-b"},
	}
	switch tr {
	case overISCSI:
		f.ServedOverISCSI = true
	case nfs:
		f.VolumeID, f.Backend, f.VolumeZone = "nfs/pv-1", BackendNFS, ""
		f.VolumeAccessType, f.AccessType = Mount, Mount
	}
	return f
}

// underFence puts f under the fence state s: node-b's own address fenced, or
// node-a holding the volume (read/write where m allows) behind a fence.
func underFence(f AttachFacts, s fenceState) AttachFacts {
	switch s {
	case nodeFenced:
		f.FencedBy = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}
		f.FencesInForce = []string{"10.0.0.0/24"}
	case otherFenced:
		f.Attachments = []Attachment{{Node: nodeid.MustParse("node-a@zone-a@10.0.1.1"), Mode: f.Mode, ReadOnly: IsReadOnly(f.Mode),
			Fingerprint: string(f.AccessType) + "/", Fenced: true}}
		f.FencesInForce = []string{"10.0.1.1/32"}
	}
	return f
}

// refusedBeforeFollowing are the reasons of the rules about the node and
// the request themselves, which leave the node's other attachments as
// they are.
var refusedBeforeFollowing = []string{ReasonOtherZone, ReasonModeNotAllowed, ReasonFenced}

// outcome is a decision's code and reason.
type outcome struct {
	code   codes.Code
	reason string
}

// TestDecideAttachMatrix: every mode over every transport in every fence
// state, node-b attaching a volume made for that mode. A fenced node gets
// nothing; a fenced holder still holds the volume, so it counts as any
// other holder would until the CO unpublishes it. The transport changes
// none of these outcomes: what it asks of the node, node-b has.
func TestDecideAttachMatrix(t *testing.T) {
	allowed := outcome{OK, ""}
	refusedFenced := outcome{FP, ReasonFenced}
	tests := []struct {
		mode Mode
		// node-b's outcome with nothing fenced, with its own address
		// fenced, and with node-a holding the volume behind a fence
		clear, ownFenced, holderFenced outcome
	}{
		{SNW, allowed, refusedFenced, outcome{FP, ReasonHeldByOtherNode}},
		{SNRO, allowed, refusedFenced, outcome{FP, ReasonHeldByOtherNode}},
		{MNRO, allowed, refusedFenced, allowed},
		{MNSW, allowed, refusedFenced, outcome{FP, ReasonWriterLimit}},
		{MNMW, allowed, refusedFenced, allowed},
		{SNSW, allowed, refusedFenced, outcome{FP, ReasonHeldByOtherNode}},
		{SNMW, allowed, refusedFenced, outcome{FP, ReasonHeldByOtherNode}},
	}
	for _, tt := range tests {
		for _, tr := range []transport{loop, overISCSI, nfs} {
			for _, c := range []struct {
				fence fenceState
				want  outcome
			}{{notFenced, tt.clear}, {nodeFenced, tt.ownFenced}, {otherFenced, tt.holderFenced}} {
				fence, want := c.fence, c.want
				t.Run(Name(tt.mode)+"/"+string(tr)+"/"+string(fence), func(t *testing.T) {
					f := underFence(firstAttach(tr, tt.mode), fence)
					d := DecideAttach(f)
					if got := (outcome{d.Code, d.Reason}); got != want {
						t.Fatalf("= %v (%q), want %v", got, d.Message, want)
					}
					if d.Idempotent {
						t.Errorf("a first attach of the node is taken for a repeat")
					}
					if follow := !slices.Contains(refusedBeforeFollowing, d.Reason); d.FollowNode != follow {
						t.Errorf("FollowNode = %t, want %t", d.FollowNode, follow)
					}
					if !d.Allowed() {
						return
					}
					want := Attachment{Node: nodeid.MustParse(nodeB), Mode: tt.mode, ReadOnly: IsReadOnly(tt.mode), Fingerprint: string(f.AccessType) + "/"}
					if d.Attachment != want {
						t.Errorf("attachment to record = %+v, want %+v", d.Attachment, want)
					}
				})
			}
		}
	}
}

// with is f changed by change.
func with(f AttachFacts, change func(*AttachFacts)) AttachFacts {
	change(&f)
	return f
}

// mountExt4 is a loop volume made as an ext4 filesystem for modes.
func mountExt4(m Mode, modes ...Mode) AttachFacts {
	return with(firstAttach(loop, m), func(f *AttachFacts) {
		f.VolumeAccessType, f.VolumeFsType, f.AccessType, f.FsType = Mount, "ext4", Mount, "ext4"
		f.VolumeModes = append([]Mode{m}, modes...)
	})
}

func holding(f AttachFacts, a ...Attachment) AttachFacts {
	f.Attachments = a
	f.NodeVolumes = len(a)
	return f
}

// TestDecideAttach: each rule of the attach decision, with a row for every
// refusal it can give. (InvalidMode cannot come: a mode that is none is
// within none of the volume's modes, which refuses it first.)
func TestDecideAttach(t *testing.T) {
	type row struct {
		name    string
		facts   AttachFacts
		code    codes.Code
		reason  string
		idem    bool
		follow  bool
		ro      bool     // the attachment to record is read-only (when allowed)
		mention []string // the message names each
	}
	snw := firstAttach(loop, SNW)
	tests := []row{
		// Zones.
		{"node in another zone", with(snw, func(f *AttachFacts) { f.Node.Zone = "zone-b" }),
			FP, ReasonOtherZone, false, false, false, []string{"zone-a", "zone-b", volumeB}},
		{"an NFS volume is in every zone", with(firstAttach(nfs, SNW), func(f *AttachFacts) { f.Node.Zone = "zone-b" }),
			OK, "", false, true, false, nil},
		{"node claims another zone than it holds volumes in", with(snw, func(f *AttachFacts) {
			f.NodeHeld, f.NodeVolumes = []HeldVolume{{VolumeID: "zone-a/block/pv-0", NodeZone: "zone-b"}}, 1
		}), FP, ReasonOtherZone, false, false, false, []string{"zone-a/block/pv-0", "--zone=zone-b"}},
		{"a hold under an id that does not parse proves no zone", with(snw, func(f *AttachFacts) {
			f.NodeHeld, f.NodeVolumes = []HeldVolume{{VolumeID: "zone-a/block/pv-0"}}, 1
		}), OK, "", false, true, false, nil},

		// What each transport needs of the node.
		{"NFS node without an address", with(firstAttach(nfs, MNMW), func(f *AttachFacts) { f.Node.Address = "" }),
			FP, "", false, false, false, []string{"--node-address"}},
		{"loop node without an address or an initiator", with(snw, func(f *AttachFacts) { f.Node.Address, f.Node.Initiator = "", "" }),
			OK, "", false, true, false, nil},
		{"iSCSI node without an initiator", with(firstAttach(overISCSI, SNW), func(f *AttachFacts) { f.Node.Initiator = "" }),
			FP, "", false, true, false, []string{"node-b", "--iscsi-initiator-name-file"}},
		{"iSCSI node without an initiator repeats its attachment", with(firstAttach(overISCSI, SNW), func(f *AttachFacts) {
			f.Node.Initiator = ""
			*f = holding(*f, Attachment{Node: nodeid.MustParse(nodeB), Mode: SNW, Fingerprint: "block/"})
		}), OK, "", true, true, false, nil},

		// The volume's own access type, filesystem and modes.
		{"another access type", with(snw, func(f *AttachFacts) { f.AccessType, f.FsType = Mount, "ext4" }),
			INV, "", false, false, false, []string{"access type block, not mount"}},
		{"another filesystem", with(mountExt4(SNW), func(f *AttachFacts) { f.FsType = "xfs" }),
			INV, "", false, false, false, []string{"ext4 filesystem, not xfs"}},
		{"no filesystem named", with(mountExt4(SNW), func(f *AttachFacts) { f.FsType = "" }),
			OK, "", false, true, false, nil},
		{"a mode beyond the volume's", with(snw, func(f *AttachFacts) { f.Mode = MNMW }),
			FP, ReasonModeNotAllowed, false, false, false, []string{"SINGLE_NODE_WRITER", "MULTI_NODE_MULTI_WRITER"}},
		{"a mode within the volume's", with(snw, func(f *AttachFacts) { f.Mode = SNSW }),
			OK, "", false, true, false, nil},
		{"not a mode", with(snw, func(f *AttachFacts) { f.Mode = Mode(0) }),
			FP, ReasonModeNotAllowed, false, false, false, nil},

		// Fences.
		{"node fenced at its address", underFence(snw, nodeFenced),
			FP, ReasonFenced, false, false, false, []string{"10.0.0.0/24", "address 10.0.0.2"}},
		{"node fenced under an address it had", with(snw, func(f *AttachFacts) {
			f.FencedBy, f.FencesInForce = []netip.Prefix{netip.MustParsePrefix("10.9.0.0/16")}, []string{"10.9.0.0/16"}
		}), FP, ReasonFenced, false, false, false, []string{"an address it had when the fence caught it"}},
		{"node without an address while fences are in force", with(snw, func(f *AttachFacts) {
			f.Node.Address, f.FencesInForce = "", []string{"10.9.0.0/16"}
		}), FP, ReasonFenced, false, false, false, []string{"10.9.0.0/16", "--node-address"}},
		{"a fenced holder of a multi-writer volume leaves room", underFence(firstAttach(loop, MNMW), otherFenced),
			OK, "", false, true, false, nil},

		// The node's volume limit counts new attachments only.
		{"node at its limit", with(snw, func(f *AttachFacts) { f.Node.MaxVolumes, f.NodeVolumes = 2, 2 }),
			codes.ResourceExhausted, ReasonAttachLimit, false, true, false, []string{"node-b", "2 volumes"}},
		{"node at its limit repeats an attachment", with(holding(snw, Attachment{Node: nodeid.MustParse(nodeB), Mode: SNW, Fingerprint: "block/"}),
			func(f *AttachFacts) { f.Node.MaxVolumes, f.NodeVolumes = 2, 2 }), OK, "", true, true, false, nil},
		{"node one below its limit", with(snw, func(f *AttachFacts) { f.Node.MaxVolumes, f.NodeVolumes = 2, 1 }),
			OK, "", false, true, false, nil},
		{"node without a limit", with(snw, func(f *AttachFacts) { f.Node.MaxVolumes, f.NodeVolumes = 0, 5000 }),
			OK, "", false, true, false, nil},

		// The same node again.
		{"same node, same arguments", holding(mountExt4(SNW), Attachment{Node: nodeid.MustParse(nodeB), Mode: SNW, Fingerprint: "mount/ext4"}),
			OK, "", true, true, false, nil},
		{"same node, another fingerprint", holding(with(mountExt4(SNW), func(f *AttachFacts) { f.FsType = "" }),
			Attachment{Node: nodeid.MustParse(nodeB), Mode: SNW, Fingerprint: "mount/ext4"}),
			AE, ReasonPublishedWithOtherArguments, false, true, false, []string{volumeB + ": ", `"` + nodeB + `"`}},
		{"same node, another read-only flag", holding(with(firstAttach(loop, MNMW), func(f *AttachFacts) { f.ReadOnly = true }),
			Attachment{Node: nodeid.MustParse(nodeB), Mode: MNMW, Fingerprint: "block/"}),
			AE, ReasonPublishedWithOtherArguments, false, true, false, nil},
		{"same node under an older address repeats", holding(snw, Attachment{Node: nodeid.MustParse("node-b@zone-a@10.0.0.1"), Mode: SNW, Fingerprint: "block/"}),
			OK, "", true, true, false, nil},
		// Its attachment is judged as it is once it followed the node's id.
		{"same node under an older address, other arguments", holding(with(snw, func(f *AttachFacts) { f.ReadOnly = true }),
			Attachment{Node: nodeid.MustParse("node-b@zone-a@10.0.0.1"), Mode: SNW, Fingerprint: "block/"}),
			AE, ReasonPublishedWithOtherArguments, false, true, false, []string{`"` + nodeB + `"`}},

		// Other holders, and read-only.
		{"a single-node volume held by another node", holding(snw, Attachment{Node: nodeid.MustParse("node-a@zone-a"), Mode: SNW, Fingerprint: "block/"}),
			FP, ReasonHeldByOtherNode, false, true, false, []string{`"node-a@zone-a"`}},
		{"a second writer of a single-writer volume", holding(with(firstAttach(loop, MNSW), func(f *AttachFacts) {}),
			Attachment{Node: nodeid.MustParse("node-a@zone-a"), Mode: MNSW, Fingerprint: "block/"}, Attachment{Node: nodeid.MustParse("node-c@zone-a"), Mode: MNSW, ReadOnly: true, Fingerprint: "block/"}),
			FP, ReasonWriterLimit, false, true, false, []string{`"node-a@zone-a"`, "read-only"}},
		{"a reader joins the writer of a single-writer volume", holding(with(firstAttach(loop, MNSW), func(f *AttachFacts) { f.ReadOnly = true }),
			Attachment{Node: nodeid.MustParse("node-a@zone-a"), Mode: MNSW, Fingerprint: "block/"}),
			OK, "", false, true, true, nil},
		{"a writer joins readers that allow none", holding(with(firstAttach(loop, MNMW), func(f *AttachFacts) { f.VolumeModes = []Mode{MNRO, MNMW} }),
			Attachment{Node: nodeid.MustParse("node-a@zone-a"), Mode: MNRO, ReadOnly: true, Fingerprint: "block/"}),
			FP, ReasonWriterLimit, false, true, false, []string{`"node-a@zone-a"`, "MULTI_NODE_READER_ONLY"}},
		{"a reader-only mode asked read/write is read-only", firstAttach(loop, MNRO),
			OK, "", false, true, true, nil},
		{"a single-node reader asked read/write is read-only", firstAttach(nfs, SNRO),
			OK, "", false, true, true, nil},
		{"read-only asked of a writer mode", with(firstAttach(overISCSI, MNMW), func(f *AttachFacts) { f.ReadOnly = true }),
			OK, "", false, true, true, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := slices.Clone(tt.facts.Attachments)
			d := DecideAttach(tt.facts)
			if d.Code != tt.code || d.Reason != tt.reason {
				t.Fatalf("= %v %q (%q), want %v %q", d.Code, d.Reason, d.Message, tt.code, tt.reason)
			}
			if d.Idempotent != tt.idem {
				t.Errorf("Idempotent = %t, want %t", d.Idempotent, tt.idem)
			}
			if d.FollowNode != tt.follow {
				t.Errorf("FollowNode = %t, want %t", d.FollowNode, tt.follow)
			}
			if (d.Message == "") != d.Allowed() {
				t.Errorf("message %q with code %v", d.Message, d.Code)
			}
			for _, s := range tt.mention {
				if !strings.Contains(d.Message, s) {
					t.Errorf("message %q does not name %s", d.Message, s)
				}
			}
			if !slices.Equal(tt.facts.Attachments, before) {
				t.Errorf("the facts' attachments changed: %+v, were %+v", tt.facts.Attachments, before)
			}
			want := Attachment{Node: tt.facts.Node, Mode: tt.facts.Mode, ReadOnly: tt.ro,
				Fingerprint: string(tt.facts.AccessType) + "/" + tt.facts.FsType}
			if d.Allowed() && d.Attachment != want {
				t.Errorf("attachment to record = %+v, want %+v", d.Attachment, want)
			}
		})
	}
}

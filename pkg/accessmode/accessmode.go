// Package accessmode holds the rules that decide who may hold a volume.
//
// Everything here is a pure function of its arguments: the controller asks
// DecideAttach before it records that a node holds a volume, the node plugin
// asks CheckPublish before it mounts a volume for one more workload, and both
// ask Serves before they accept a capability a backend cannot honour. Keeping
// the rules in one place means the spec's tables can be read off one file and
// tested without devices, servers or locks.
package accessmode

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// Mode is a CSI access mode.
type Mode = csi.VolumeCapability_AccessMode_Mode

// The seven CSI access modes, named for readability at call sites.
const (
	SingleNodeWriter       = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	SingleNodeReaderOnly   = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
	MultiNodeReaderOnly    = csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	MultiNodeSingleWriter  = csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER
	MultiNodeMultiWriter   = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
	SingleNodeSingleWriter = csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
	SingleNodeMultiWriter  = csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER
)

// All lists every mode the driver knows, in spec order.
var All = []Mode{
	SingleNodeWriter, SingleNodeReaderOnly, MultiNodeReaderOnly, MultiNodeSingleWriter,
	MultiNodeMultiWriter, SingleNodeSingleWriter, SingleNodeMultiWriter,
}

// unlimited marks a dimension of a mode that has no upper bound.
const unlimited = int(^uint(0) >> 1)

// limits is what a mode allows, as three counts. Every rule below is phrased
// in terms of these, so a mode's meaning is stated exactly once.
type limits struct {
	nodes            int // nodes that may hold the volume at once
	writerNodes      int // of those, nodes that may hold it read/write
	workloadsPerNode int // target paths on one node
}

func limitsOf(m Mode) (limits, bool) {
	switch m {
	case SingleNodeWriter, SingleNodeSingleWriter:
		// The spec's second table gives SINGLE_NODE_WRITER the same
		// within-node rule as SINGLE_NODE_SINGLE_WRITER: one target path.
		return limits{nodes: 1, writerNodes: 1, workloadsPerNode: 1}, true
	case SingleNodeMultiWriter:
		return limits{nodes: 1, writerNodes: 1, workloadsPerNode: unlimited}, true
	case SingleNodeReaderOnly:
		return limits{nodes: 1, writerNodes: 0, workloadsPerNode: 1}, true
	case MultiNodeReaderOnly:
		return limits{nodes: unlimited, writerNodes: 0, workloadsPerNode: unlimited}, true
	case MultiNodeSingleWriter:
		return limits{nodes: unlimited, writerNodes: 1, workloadsPerNode: unlimited}, true
	case MultiNodeMultiWriter:
		return limits{nodes: unlimited, writerNodes: unlimited, workloadsPerNode: unlimited}, true
	}
	return limits{}, false
}

// Valid reports whether m is one of the seven defined modes.
func Valid(m Mode) bool {
	_, ok := limitsOf(m)
	return ok
}

// IsReadOnly reports whether the mode forbids every write.
func IsReadOnly(m Mode) bool {
	l, ok := limitsOf(m)
	return ok && l.writerNodes == 0
}

// AllReadOnly reports whether every one of a volume's modes is read-only
// (ROX, SINGLE_NODE_READER_ONLY): no node may ever write the volume. A
// volume that names no mode is not taken as read-only.
func AllReadOnly(modes []Mode) bool {
	if len(modes) == 0 {
		return false
	}
	for _, m := range modes {
		if !IsReadOnly(m) {
			return false
		}
	}
	return true
}

// IsMultiNode reports whether the mode lets more than one node hold the volume.
func IsMultiNode(m Mode) bool {
	l, ok := limitsOf(m)
	return ok && l.nodes > 1
}

// SingleWorkload reports whether the mode allows only one target path per node.
func SingleWorkload(m Mode) bool {
	l, ok := limitsOf(m)
	return ok && l.workloadsPerNode == 1
}

// Within reports whether every use the narrow mode allows is also allowed by
// the wide mode. A volume created for wide may be published as narrow: this is
// how an existing ReadWriteOnce volume is later used as ReadWriteOncePod.
func Within(narrow, wide Mode) bool {
	n, ok1 := limitsOf(narrow)
	w, ok2 := limitsOf(wide)
	return ok1 && ok2 && n.nodes <= w.nodes && n.writerNodes <= w.writerNodes &&
		n.workloadsPerNode <= w.workloadsPerNode
}

// WithinAny reports whether m is within at least one of the given modes.
func WithinAny(m Mode, modes []Mode) bool {
	for _, w := range modes {
		if Within(m, w) {
			return true
		}
	}
	return false
}

// Name is the spec's name of a mode, for messages.
func Name(m Mode) string { return m.String() }

// Names lists modes for messages: "SINGLE_NODE_WRITER, MULTI_NODE_READER_ONLY".
func Names(modes []Mode) string {
	names := make([]string, len(modes))
	for i, m := range modes {
		names[i] = Name(m)
	}
	return strings.Join(names, ", ")
}

// Parse accepts a spec name (SINGLE_NODE_WRITER), its number, or the
// lower-case dashed form Nomad uses (single-node-writer).
func Parse(s string) (Mode, error) {
	norm := strings.ToUpper(strings.ReplaceAll(strings.TrimSpace(s), "-", "_"))
	if v, ok := csi.VolumeCapability_AccessMode_Mode_value[norm]; ok && Valid(Mode(v)) {
		return Mode(v), nil
	}
	if n, err := strconv.ParseInt(norm, 10, 32); err == nil && Valid(Mode(n)) {
		return Mode(n), nil
	}
	names := make([]string, 0, len(All))
	for _, m := range All {
		names = append(names, m.String())
	}
	return 0, fmt.Errorf("unknown access mode %q; accepted: %s", s, strings.Join(names, ", "))
}

// EffectiveReadOnly is whether a mount must be read-only: when the mode
// allows no writer, when the CO asked for read-only, or when the controller
// attached this node read-only (MULTI_NODE_SINGLE_WRITER readers).
func EffectiveReadOnly(m Mode, requestedReadOnly, attachedReadOnly bool) bool {
	return IsReadOnly(m) || requestedReadOnly || attachedReadOnly
}

// Reasons a publish is refused, for machines (metrics labels): CamelCase,
// one per rule, never more than the list in Reasons.
const (
	// ReasonInvalidMode: the request names no defined CSI access mode.
	ReasonInvalidMode = "InvalidMode"
	// ReasonPublishedWithOtherArguments: the same node (attach) or target
	// path (publish) already holds the volume with other arguments.
	ReasonPublishedWithOtherArguments = "PublishedWithOtherArguments"
	// ReasonHeldByOtherNode: a mode on either side allows one node at a time
	// and another node holds the volume.
	ReasonHeldByOtherNode = "HeldByOtherNode"
	// ReasonWriterLimit: one more writer node than the holders' modes allow.
	ReasonWriterLimit = "WriterLimit"
	// ReasonHeldByOtherWorkload: a mode on either side allows one workload
	// (target path) per node and another one holds the volume.
	ReasonHeldByOtherWorkload = "HeldByOtherWorkload"
	// ReasonOtherAccessMode: the volume is published on this node with
	// another access mode.
	ReasonOtherAccessMode = "OtherAccessMode"
	// ReasonBeyondNodeMode: a stage or publish asks for more than the mode
	// the volume was attached to this node (or staged on it) with.
	ReasonBeyondNodeMode = "BeyondNodeMode"

	// Refusals at attach (DecideAttach) beyond what the holders' modes
	// allow, but about who may hold a volume all the same.

	// ReasonOtherZone: the node is outside the volume's zone.
	ReasonOtherZone = "OtherZone"
	// ReasonAttachLimit: the node already holds its limit of volumes.
	ReasonAttachLimit = "AttachLimit"
	// ReasonModeNotAllowed: the mode allows more than the modes the volume
	// was created for (see Within).
	ReasonModeNotAllowed = "ModeNotAllowed"
	// ReasonFenced: the node is behind a network fence, or reports no
	// address while fences are in force, so it cannot be told apart from
	// a fenced one.
	ReasonFenced = "Fenced"
)

// Reasons lists every refusal reason, the bounded set metrics may carry.
var Reasons = []string{
	ReasonInvalidMode, ReasonPublishedWithOtherArguments, ReasonHeldByOtherNode, ReasonWriterLimit,
	ReasonHeldByOtherWorkload, ReasonOtherAccessMode, ReasonBeyondNodeMode, ReasonOtherZone, ReasonAttachLimit, ReasonModeNotAllowed,
	ReasonFenced,
}

// Decision is the outcome of a rule: OK, or a gRPC code with a message a
// person can act on and a Reason (one of Reasons) a machine can count.
// Idempotent is set when the request repeats one that is already in force,
// so the caller must change nothing.
type Decision struct {
	Code       codes.Code
	Reason     string
	Message    string
	Idempotent bool
}

// Allowed reports whether the rule let the request through.
func (d Decision) Allowed() bool { return d.Code == codes.OK }

func allow() Decision  { return Decision{Code: codes.OK} }
func repeat() Decision { return Decision{Code: codes.OK, Idempotent: true} }
func refuse(c codes.Code, reason, format string, a ...any) Decision {
	return Decision{Code: c, Reason: reason, Message: fmt.Sprintf(format, a...)}
}

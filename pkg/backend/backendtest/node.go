package backendtest

// The node's contract: a stage only of what the controller attached to
// the node, within the attachment's access; a stage the node can check and
// undo, twice if need be.

import (
	"context"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// nodeContract is a node under test with the controller whose volumes it
// stages.
type nodeContract struct {
	contract
	n backend.Node
}

// RunNodeContract runs the node's contract against the node, and the
// controller it takes its volumes from, that newNode makes once for the
// suite. props.AccessType is what the volumes are staged as; Mutable and
// Zoned are not used.
func RunNodeContract(t *testing.T, props Properties, newNode func(t *testing.T) (backend.Controller, backend.Node)) {
	c, n := newNode(t)
	k := &nodeContract{contract: contract{c: c, props: props, size: props.VolumeSize}, n: n}
	if k.size == 0 {
		k.size = max(16<<20, c.MinimumSize())
	}
	if n.Backend() != c.Backend() {
		t.Fatalf("the node is of backend %s, its controller of %s", n.Backend(), c.Backend())
	}
	runAll(t, []subtest{
		{"StageAbsentVolume", k.stageAbsent},
		{"StageOnlyWhereAttached", k.stageOnlyWhereAttached},
		{"StageWithinTheAttachment", k.stageWithinTheAttachment},
		{"StageCheckUnstage", k.stageCheckUnstage},
		{"StageUnderANewAddress", k.stageUnderANewAddress},
		{"Expand", k.expand},
	})
}

// attached creates a volume attached to NodeIDs[0] as att says.
func (k *nodeContract) attached(t *testing.T, name string, att accessmode.Attachment) volumeid.ID {
	t.Helper()
	spec := k.spec(t, k.zones()[0], name)
	k.create(t, spec)
	att.Node = NodeIDs[0]
	must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), spec.ID, []accessmode.Attachment{att}))
	t.Cleanup(func() {
		// Detached before the deletion the creation registered, as a CO
		// does; cleanups run last registered first.
		if _, err := k.c.SetAttachments(context.Background(), spec.ID, nil); err != nil {
			t.Errorf("cleanup: detaching %s: %v", name, err)
		}
	})
	return spec.ID
}

func (k *nodeContract) request(t *testing.T, id volumeid.ID, node nodeid.Node, readOnly bool) backend.StageRequest {
	return backend.StageRequest{
		VolumeID: id, Node: node, StagingPath: filepath.Join(t.TempDir(), "staging"),
		AccessType: k.props.AccessType, ReadOnly: readOnly, CapacityBytes: k.size,
	}
}

// stage stages req and undoes it when the test ends, if the test has not.
func (k *nodeContract) stage(t *testing.T, req backend.StageRequest) *backend.Staged {
	t.Helper()
	staged, err := k.n.Stage(ctx(t), req)
	if err != nil {
		t.Fatalf("Stage %s as %s: %v", req.VolumeID, req.Node, err)
	}
	t.Cleanup(func() {
		if err := k.n.Unstage(context.Background(), staged); err != nil {
			t.Errorf("cleanup: Unstage: %v", err)
		}
	})
	return staged
}

func writer() accessmode.Attachment {
	return accessmode.Attachment{Mode: accessmode.MultiNodeMultiWriter}
}

func (k *nodeContract) stageAbsent(t *testing.T) {
	_, err := k.n.Stage(ctx(t), k.request(t, k.id(t, k.zones()[0], volumeid.Volume, "absent"), NodeIDs[0], false))
	wantCode(t, "Stage of an absent volume", err, codes.NotFound)
}

func (k *nodeContract) stageOnlyWhereAttached(t *testing.T) {
	id := k.attached(t, "elsewhere", writer())
	_, err := k.n.Stage(ctx(t), k.request(t, id, NodeIDs[1], false))
	wantCode(t, "Stage on a node the volume is not attached to", err, codes.FailedPrecondition)
}

func (k *nodeContract) stageWithinTheAttachment(t *testing.T) {
	id := k.attached(t, "read-only", accessmode.Attachment{Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true})
	_, err := k.n.Stage(ctx(t), k.request(t, id, NodeIDs[0], false))
	wantCode(t, "a read/write Stage of a read-only attachment", err, codes.FailedPrecondition)
	staged := k.stage(t, k.request(t, id, NodeIDs[0], true))
	if !staged.ReadOnly {
		t.Fatalf("a read-only stage is recorded read/write: %+v", staged)
	}
}

func (k *nodeContract) check(t *testing.T, staged *backend.Staged, want backend.StageState) {
	t.Helper()
	got := must[backend.StageCheck](t, "Check")(k.n.Check(ctx(t), staged))
	if got.State != want {
		t.Fatalf("Check = %+v, want state %d", got, want)
	}
}

func (k *nodeContract) stageCheckUnstage(t *testing.T) {
	id := k.attached(t, "staged", writer())
	req := k.request(t, id, NodeIDs[0], false)
	staged := k.stage(t, req)
	if staged.VolumeID != id.String() || staged.AccessType != req.AccessType || staged.StagingPath != req.StagingPath || staged.ReadOnly {
		t.Fatalf("Stage of %s at %s recorded %+v", id, req.StagingPath, staged)
	}
	if req.AccessType == accessmode.Block && staged.Device == "" {
		t.Fatalf("a stage of access type block reports no device: %+v", staged)
	}
	k.check(t, staged, backend.StageIntact)
	if h := k.n.Health(ctx(t), staged); h.Abnormal {
		t.Fatalf("a new stage is unwell: %+v", h)
	}
	for range 2 {
		if err := k.n.Unstage(ctx(t), staged); err != nil {
			t.Fatalf("Unstage: %v", err)
		}
		k.check(t, staged, backend.StageGone)
	}
}

// stageUnderANewAddress: attachments are matched by node key; a node that
// restarted under another address is the node the volume is attached to.
func (k *nodeContract) stageUnderANewAddress(t *testing.T) {
	id := k.attached(t, "moved", writer())
	k.stage(t, k.request(t, id, nodeid.Node{Name: NodeIDs[0].Name, Zone: NodeIDs[0].Zone, Address: "10.99.250.99"}, false))
}

// expand: after the controller grew the volume, the node sees the new
// size, or says it cannot know it exactly (0).
func (k *nodeContract) expand(t *testing.T) {
	id := k.attached(t, "grown", writer())
	staged := k.stage(t, k.request(t, id, NodeIDs[0], false))
	must[*backend.Volume](t, "ExpandVolume")(k.c.ExpandVolume(ctx(t), id, 2*k.size))
	if got := must[int64](t, "Expand")(k.n.Expand(ctx(t), staged)); got != 0 && got != 2*k.size {
		t.Fatalf("Expand after growing the volume to %d answered %d", 2*k.size, got)
	}
}

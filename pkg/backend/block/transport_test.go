// This file holds the tests of the choice of a transport: it needs no
// device, so every case a node can meet is listed, the refusals with them.

package block

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Which transport a call takes: the volume context for a stage, the stage
// record after it, and the zone's pool where neither names one. A name
// this node cannot serve is an error, never a guess.
func TestTheTransportOfACall(t *testing.T) {
	id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "v"))
	if err != nil {
		t.Fatal(err)
	}
	// The nodes: with zone-a's pool or without it, over iSCSI or not, and
	// one with a second network transport besides iSCSI.
	node := func(sharesPool bool, network ...string) *Node {
		pools := map[string]*pool{}
		if sharesPool {
			pools["zone-a"] = &pool{}
		}
		n := newNode(pools, nil)
		for _, name := range network {
			n.network[name] = &iscsiTransport{}
		}
		return n
	}
	named := func(name string) map[string]string { return map[string]string{iscsi.ContextTransport: name} }
	const loopT, iscsiT = "loop", iscsi.TransportName
	for _, tc := range []struct {
		name    string
		node    *Node
		stage   bool // a stage's volume context, not a stage record
		named   map[string]string
		want    string // the transport chosen: loopT or a network transport's name
		code    codes.Code
		message string
	}{
		{"a stage without a transport, pool here", node(true), true, nil, loopT, codes.OK, ""},
		{"a stage without a transport, no pool here", node(false, iscsiT), true, nil, loopT, codes.OK, ""},
		{"a stage over iSCSI", node(false, iscsiT), true, named(iscsiT), iscsiT, codes.OK, ""},
		{"a stage over iSCSI where the zone's pool is too", node(true, iscsiT), true, named(iscsiT), iscsiT, codes.OK, ""},
		{"a stage over iSCSI on a node without an initiator", node(true), true, named(iscsiT), "", codes.FailedPrecondition, "--iscsi-initiator-name-file"},
		{"a stage over a transport nobody knows", node(true, iscsiT), true, named("nbd"), "", codes.InvalidArgument, "the only network transport"},

		{"a record without a transport, pool here", node(true), false, nil, loopT, codes.OK, ""},
		{"a record without a transport, pool here, iSCSI too", node(true, iscsiT), false, nil, loopT, codes.OK, ""},
		{"a record without a transport, no pool, iSCSI", node(false, iscsiT), false, nil, iscsiT, codes.OK, ""},
		{"a record without a transport, no pool, no network", node(false), false, nil, loopT, codes.OK, ""},
		{"a record without a transport, no pool, two networks", node(false, iscsiT, "nvme-tcp"), false, nil, "", codes.FailedPrecondition, "cannot be told"},
		{"a record over iSCSI", node(true, iscsiT), false, named(iscsiT), iscsiT, codes.OK, ""},
		{"a record over iSCSI on a node without an initiator now", node(true), false, named(iscsiT), "", codes.FailedPrecondition, "--iscsi-initiator-name-file"},
		{"a record over a transport this node does not know", node(true, iscsiT), false, named("nvme-tcp"), "", codes.FailedPrecondition, "does not know"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			choose := tc.node.recordedTransport
			if tc.stage {
				choose = tc.node.stageTransport
			}
			got, err := choose(id, tc.named)
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.message) {
				t.Fatalf("error %v, want %s saying %q", err, tc.code, tc.message)
			}
			want := tc.node.network[tc.want]
			if tc.want == loopT {
				want = tc.node.loop
			}
			if got != want {
				t.Fatalf("transport %#v, want %s", got, tc.want)
			}
		})
	}
}

// The calls that come with a device and no record ask every transport that
// may have made it: the network transports, and the zone's pool if this
// node has it (or the loop transport alone, which says the pool is not
// here).
func TestTheTransportsThatMayHaveMadeADevice(t *testing.T) {
	id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "v"))
	if err != nil {
		t.Fatal(err)
	}
	withPool := newNode(map[string]*pool{"zone-a": {}}, []string{"zone-a"})
	network := &iscsiTransport{}
	both := newNode(map[string]*pool{"zone-a": {}}, []string{"zone-a"})
	both.network[iscsi.TransportName] = network
	networkOnly := newNode(map[string]*pool{}, nil)
	networkOnly.network[iscsi.TransportName] = network
	neither := newNode(map[string]*pool{}, nil)
	for _, tc := range []struct {
		name string
		node *Node
		want []transport
	}{
		{"the zone's pool", withPool, []transport{withPool.loop}},
		{"the zone's pool and iSCSI", both, []transport{network, both.loop}},
		{"iSCSI alone", networkOnly, []transport{network}},
		{"neither", neither, []transport{neither.loop}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.node.reaching(id); !slices.Equal(got, tc.want) {
				t.Fatalf("transports %#v, want %#v", got, tc.want)
			}
		})
	}
	if _, err := neither.ownsDevice(id, "loop0"); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a device of a volume this node has no way to: %v, want FAILED_PRECONDITION", err)
	}
}

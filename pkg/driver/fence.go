package driver

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/csi-addons/spec/lib/go/fence"
	"github.com/csi-addons/spec/lib/go/identity"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/faultpoint"
	"github.com/modeguard/modeguard/pkg/netfence"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// Network fences (csi-addons NetworkFence). A fence cuts every node whose
// address lies in a block off from the storage: each attachment of such a
// node is marked fenced (accessmode.Attachment.Fenced), which takes it off
// its volume's export client list or target access list (and so ends its
// sessions there), and its further attaches are refused. The attachment
// itself stays, as the CO's record of what the node holds: a fence does
// not free a single-writer volume for another node, the CO's unpublish of
// the fenced node (its force-detach) does. Lifting the fence serves the
// node what it still holds.
//
// The fence list is written before anything is changed, and a change of
// the list waits for the attaches that checked the old list (fenceGate),
// so no attach can slip between a new fence and the pass that applies it.

// recoverFences rebuilds a fence list that was lost: its file is missing
// (a controller started on another machine, or the file deleted) while
// attachments are marked fenced. Each such node's address becomes a fence
// of that address alone, with the node caught, so that no fenced node is
// served or attached again until an operator lifts it; the first
// FenceClusterNetwork or UnfenceClusterNetwork then sets the list right.
// It runs before the controller takes calls.
func (d *Driver) recoverFences(ctx context.Context, ctrls map[accessmode.Backend]backend.Controller) error {
	if d.fences == nil || !d.fences.Missing() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var nodes []nodeid.Node
	var blocks []netip.Prefix
	for _, b := range slices.Sorted(maps.Keys(ctrls)) {
		vols, err := ctrls[b].ListVolumes(ctx)
		if err != nil {
			return fmt.Errorf("the network fence list %s is missing, and the %s volumes cannot be read to see whether fences are in force: %w", d.fences.Where(), b, err)
		}
		for _, v := range vols {
			for _, a := range v.Attachments {
				if !a.Fenced {
					continue
				}
				n := a.Node
				if n.Address == "" {
					return fmt.Errorf("the network fence list %s is missing, and node %s is fenced from volume %s under an id without an address, so its fence cannot be rebuilt: put the list back, or unpublish the volume from that node",
						d.fences.Where(), n.Name, v.ID)
				}
				nodes = append(nodes, n)
				blocks = append(blocks, netfence.Single(netip.MustParseAddr(n.Address)))
			}
		}
	}
	if len(nodes) == 0 {
		return nil
	}
	if err := d.fences.Add(ctx, blocks, time.Now()); err != nil {
		return err
	}
	for _, n := range nodes {
		if _, err := d.fences.Catch(ctx, n); err != nil {
			return err
		}
	}
	klog.InfoS("The network fence list was missing while nodes were fenced: rebuilt from the fenced attachments, one address per node; lift what should not be fenced",
		"where", d.fences.Where(), "cidrs", prefixList(blocks))
	return nil
}

// followFencesAtStart brings every attachment's fenced mark in line with
// the fence list before the controller takes calls. The list is written
// before a fence or a lift is applied, so a controller killed in between,
// or a pass that failed for some volume, leaves marks the list no longer
// has: a node served that a fence covers, or a node cut off with no fence
// listed. What cannot follow now is logged, and follows at the next fence
// call, or at the next publish or unpublish of its volume, whose marks
// are taken from the list.
func (d *Driver) followFencesAtStart() {
	if d.fences == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	undecided, err := d.applyFences(ctx)
	if err != nil {
		klog.ErrorS(err, "At start, not every volume follows the network fence list; the next fence call, or a publish or unpublish of the volume, tries again")
	}
	if len(undecided) > 0 {
		klog.InfoS("Network fences are in force and nodes that hold volumes report no address, so whether a fence covers them cannot be told: start their node plugins with --node-address",
			"nodes", undecided)
	}
}

// fencedBy returns the fenced blocks that hold node (none without a fence
// list), recording the node in those that hold its address.
func (d *Driver) fencedBy(ctx context.Context, node nodeid.Node) ([]netip.Prefix, error) {
	if d.fences == nil {
		return nil, nil
	}
	by, err := d.fences.Catch(ctx, node)
	if err != nil {
		return nil, statusOf(err, codes.Internal)
	}
	return by, nil
}

// statusOf is err with its gRPC code when it has one (a storage target's
// answer), else with code.
func statusOf(err error, code codes.Code) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(code, err.Error())
}

// fenceBlocks is every fenced block, none without a fence list.
func (d *Driver) fenceBlocks() []string {
	if d.fences == nil {
		return nil
	}
	return netfence.Blocks(d.fences.Fences())
}

// withFences returns attachments with each one's fenced flag as the fence
// list has it now, and the nodes among them that report no address while
// fences are in force.
func (d *Driver) withFences(ctx context.Context, attachments []accessmode.Attachment) ([]accessmode.Attachment, []string, error) {
	out := slices.Clone(attachments)
	anyFence := d.fences != nil && len(d.fences.Fences()) > 0
	var undecided []string
	for i, a := range out {
		by, err := d.fencedBy(ctx, a.Node)
		if err != nil {
			return nil, nil, err
		}
		out[i].Fenced = len(by) > 0
		if !out[i].Fenced && a.Node.Address == "" && anyFence {
			undecided = append(undecided, a.Node.Name)
		}
	}
	return out, undecided, nil
}

// applyFences brings every attachment's fenced flag, and so the storage's
// access lists, in line with the fence list. A volume busy with another
// call is waited for (within ctx); the others go on when one fails. It
// returns the nodes it could not decide for.
func (d *Driver) applyFences(ctx context.Context) ([]string, error) {
	all, err := d.allVolumes(ctx)
	if err != nil {
		d.fencesBehind.Store(true)
		return nil, err
	}
	var failed []string
	code := codes.OK
	undecided := map[string]bool{}
	for _, v := range all {
		if len(v.Attachments) == 0 {
			continue
		}
		nodes, err := d.refence(ctx, v.ID)
		for _, n := range nodes {
			undecided[n] = true
		}
		if err != nil {
			if code == codes.OK {
				code = status.Code(err)
			}
			failed = append(failed, fmt.Sprintf("volume %s: %s", v.ID, status.Convert(err).Message()))
		}
	}
	if len(failed) > 0 {
		d.fencesBehind.Store(true)
		return nil, status.Errorf(code, "the fence list is recorded, but %d volume(s) do not follow it yet: %s", len(failed), strings.Join(failed, "; "))
	}
	return slices.Sorted(maps.Keys(undecided)), nil
}

// refence applies the fence list to one volume under its lock.
func (d *Driver) refence(ctx context.Context, raw string) ([]string, error) {
	id, ctrl, err := d.controllerOfVolume(raw)
	if err != nil {
		return nil, err
	}
	release, err := d.waitForVolume(ctx, raw)
	if err != nil {
		return nil, err
	}
	defer release()
	v, err := ctrl.Volume(ctx, id)
	if status.Code(err) == codes.NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	want, undecided, err := d.withFences(ctx, v.Attachments)
	if err != nil {
		return nil, err
	}
	if slices.Equal(want, v.Attachments) {
		return undecided, nil
	}
	got, err := ctrl.SetAttachments(ctx, id, want)
	if err != nil {
		return undecided, err
	}
	if !sameFences(got.Attachments, want) {
		// A storage target of an older version would drop the flag and
		// go on serving the node: say so rather than report a fence.
		return undecided, status.Errorf(codes.Internal,
			"the storage of volume %s recorded its attachments without the fence (is its storage target older than this controller?)", raw)
	}
	klog.InfoS("Volume follows the network fences", "volumeID", raw, "fencedNodes", fencedNodes(want))
	return undecided, nil
}

// waitForVolume takes the volume's operation lock, waiting while another
// call holds it: a fence must reach every volume, and each call ends.
func (d *Driver) waitForVolume(ctx context.Context, raw string) (func(), error) {
	for {
		release, err := d.locks.acquire(raw)
		if err == nil {
			return release, nil
		}
		select {
		case <-ctx.Done():
			return nil, status.Errorf(codes.Aborted, "waiting for another call on volume %s: %v; retry later", raw, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func sameFences(got, want []accessmode.Attachment) bool {
	return slices.Equal(fencedNodes(got), fencedNodes(want)) && len(got) == len(want)
}

func fencedNodes(atts []accessmode.Attachment) []string {
	var out []string
	for _, a := range atts {
		if a.Fenced {
			out = append(out, a.Node.Name)
		}
	}
	return out
}

func prefixList(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}

// fpFenceListWritten is the step between a change of the fence list and
// the pass that applies it, which a test can kill the controller at
// (package faultpoint): the start that follows must apply the list.
var fpFenceListWritten = faultpoint.New("driver.fence.list-written")

// fenceServer serves csi-addons' FenceController on the controller.
type fenceServer struct {
	fence.UnimplementedFenceControllerServer
	d *Driver
}

// blocks checks a fence request: the controller keeps a fence list, the
// parameters are none (see checkParameters) and the blocks parse. Secrets
// are ignored: the storage is the driver's own, reached with its flags.
func (s *fenceServer) blocks(params map[string]string, cidrs []*fence.CIDR) ([]netip.Prefix, error) {
	if err := s.keepsFences(); err != nil {
		return nil, err
	}
	if err := checkParameters(params); err != nil {
		return nil, err
	}
	raw := make([]string, len(cidrs))
	for i, c := range cidrs {
		raw[i] = c.GetCidr()
	}
	blocks, err := netfence.ParseCIDRs(raw)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return blocks, nil
}

func (s *fenceServer) keepsFences() error {
	if s.d.fences == nil {
		return status.Error(codes.FailedPrecondition,
			"this controller keeps no network fences: start it with --fence-file")
	}
	return nil
}

// checkParameters refuses parameters: a network fence here takes none (a
// NetworkFenceClass's parameters reach the driver as they are).
func checkParameters(params map[string]string) error {
	if len(params) == 0 {
		return nil
	}
	keys := slices.Sorted(maps.Keys(params))
	return status.Errorf(codes.InvalidArgument,
		"parameters %s are not known; a network fence here takes no parameters, only CIDR blocks", strings.Join(keys, ", "))
}

func (s *fenceServer) FenceClusterNetwork(ctx context.Context, req *fence.FenceClusterNetworkRequest) (*fence.FenceClusterNetworkResponse, error) {
	blocks, err := s.blocks(req.GetParameters(), req.GetCidrs())
	if err != nil {
		return nil, err
	}
	s.d.fenceGate.Lock()
	stored := s.d.fences.Add(ctx, blocks, time.Now())
	s.d.fenceGate.Unlock()
	if stored != nil && !errors.Is(stored, netfence.ErrPartlyStored) {
		return nil, statusOf(stored, codes.Internal)
	}
	if stored != nil {
		s.d.fencesBehind.Store(true)
	}
	klog.InfoS("Network fence recorded", "cidrs", prefixList(blocks), "err", stored)
	fpFenceListWritten.Hit()
	// A fence stored in some places is in force: it is applied as far as
	// it can be, and the call fails for the CO to repeat it.
	undecided, err := s.d.applyFences(ctx)
	if err != nil {
		return nil, err
	}
	if stored != nil {
		return nil, status.Errorf(codes.Unavailable, "the fence on %s is in force, but %v; call again", prefixList(blocks), stored)
	}
	if len(undecided) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"the fence on %s is in force, but nodes %s hold volumes and report no address, so whether the fence covers them cannot be told: start their node plugins with --node-address",
			prefixList(blocks), strings.Join(undecided, ", "))
	}
	return &fence.FenceClusterNetworkResponse{}, nil
}

func (s *fenceServer) UnfenceClusterNetwork(ctx context.Context, req *fence.UnfenceClusterNetworkRequest) (*fence.UnfenceClusterNetworkResponse, error) {
	blocks, err := s.blocks(req.GetParameters(), req.GetCidrs())
	if err != nil {
		return nil, err
	}
	s.d.fenceGate.Lock()
	stored := s.d.fences.Remove(ctx, blocks)
	s.d.fenceGate.Unlock()
	if stored != nil && !errors.Is(stored, netfence.ErrPartlyStored) {
		return nil, statusOf(stored, codes.Internal)
	}
	if stored != nil {
		s.d.fencesBehind.Store(true)
	}
	klog.InfoS("Network fence lifted", "cidrs", prefixList(blocks), "err", stored)
	fpFenceListWritten.Hit()
	if _, err := s.d.applyFences(ctx); err != nil {
		return nil, err
	}
	if stored != nil {
		return nil, status.Errorf(codes.Unavailable, "the fence on %s is lifted, but %v; call again", prefixList(blocks), stored)
	}
	return &fence.UnfenceClusterNetworkResponse{}, nil
}

func (s *fenceServer) ListClusterFence(ctx context.Context, req *fence.ListClusterFenceRequest) (*fence.ListClusterFenceResponse, error) {
	if err := s.keepsFences(); err != nil {
		return nil, err
	}
	if err := checkParameters(req.GetParameters()); err != nil {
		return nil, err
	}
	var out []*fence.CIDR
	for _, f := range s.d.fences.Fences() {
		out = append(out, &fence.CIDR{Cidr: f.CIDR.String()})
	}
	return &fence.ListClusterFenceResponse{Cidrs: out}, nil
}

// GetFenceClients lists the storage's clients as a fence would name them:
// every node that holds a volume, by its key, with each address its
// attachments were made under as a one-address block. A node that reports
// no address cannot be fenced by address and is left out.
func (s *fenceServer) GetFenceClients(ctx context.Context, req *fence.GetFenceClientsRequest) (*fence.GetFenceClientsResponse, error) {
	if err := checkParameters(req.GetParameters()); err != nil {
		return nil, err
	}
	all, err := s.d.allVolumes(ctx)
	if err != nil {
		return nil, err
	}
	addresses := map[string][]string{}
	for _, v := range all {
		for _, a := range v.Attachments {
			n := a.Node
			if n.Address == "" {
				continue
			}
			block := netfence.Single(netip.MustParseAddr(n.Address)).String()
			if !slices.Contains(addresses[n.Name], block) {
				addresses[n.Name] = append(addresses[n.Name], block)
			}
		}
	}
	resp := &fence.GetFenceClientsResponse{}
	for _, name := range slices.Sorted(maps.Keys(addresses)) {
		c := &fence.ClientDetails{Id: name}
		blocks := addresses[name]
		slices.Sort(blocks)
		for _, b := range blocks {
			c.Addresses = append(c.Addresses, &fence.CIDR{Cidr: b})
		}
		resp.Clients = append(resp.Clients, c)
	}
	return resp, nil
}

// addonsIdentityServer is csi-addons' Identity service, which its sidecar
// asks what the controller offers.
type addonsIdentityServer struct {
	identity.UnimplementedIdentityServer
	d *Driver
}

func (s *addonsIdentityServer) GetIdentity(context.Context, *identity.GetIdentityRequest) (*identity.GetIdentityResponse, error) {
	return &identity.GetIdentityResponse{Name: s.d.cfg.DriverName, VendorVersion: s.d.cfg.Version}, nil
}

func (s *addonsIdentityServer) GetCapabilities(context.Context, *identity.GetCapabilitiesRequest) (*identity.GetCapabilitiesResponse, error) {
	caps := []*identity.Capability{{Type: &identity.Capability_Service_{Service: &identity.Capability_Service{
		Type: identity.Capability_Service_CONTROLLER_SERVICE,
	}}}}
	caps = append(caps, &identity.Capability{Type: &identity.Capability_NetworkFence_{NetworkFence: &identity.Capability_NetworkFence{
		Type: identity.Capability_NetworkFence_GET_CLIENTS_TO_FENCE,
	}}})
	if s.d.fenceStore() != nil {
		caps = append(caps, &identity.Capability{Type: &identity.Capability_NetworkFence_{NetworkFence: &identity.Capability_NetworkFence{
			Type: identity.Capability_NetworkFence_NETWORK_FENCE,
		}}})
	}
	return &identity.GetCapabilitiesResponse{Capabilities: caps}, nil
}

func (s *addonsIdentityServer) Probe(context.Context, *identity.ProbeRequest) (*identity.ProbeResponse, error) {
	return &identity.ProbeResponse{Ready: wrapperspb.Bool(s.d.Ready())}, nil
}

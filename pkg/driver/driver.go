// Package driver serves the CSI Identity, Controller and Node services.
//
// Each RPC reads the same way: check the arguments (InvalidArgument), take
// the volume's operation lock (Aborted while another call on it is in
// flight), look the volume up (NotFound), apply the access-mode rules from
// package accessmode, then ask the backend to do the work. The servers know
// nothing of loop devices or NFS exports; backends know nothing of the rules.
package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/netfence"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/nodestate"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// DefaultDriverName is the CSI driver name unless --driver-name says otherwise.
const DefaultDriverName = "modeguard.csi.dev"

// Topology keys. NodeGetInfo reports the zone, which placement follows.
// The node key is only read: node plugins of earlier versions reported it
// too, so a CO may still name a node in a requisite (candidateZones).
const (
	TopologyZoneKey = "topology.modeguard.csi.dev/zone"
	TopologyNodeKey = "topology.modeguard.csi.dev/node"
)

// Role is a service this process serves besides Identity.
type Role string

const (
	RoleController Role = "controller"
	RoleNode       Role = "node"
)

// Config is everything a driver process is told at start.
type Config struct {
	DriverName string
	Version    string
	Roles      []Role

	// Node role.
	NodeName    string
	Zone        string
	NodeAddress string
	// ISCSIInitiator is the IQN this node's iSCSI initiator logs in under
	// (read from open-iscsi's file, never typed): it goes into the node id,
	// where the controller finds the name to put on a target's access
	// list. Empty when the node does not reach volumes over iSCSI.
	ISCSIInitiator    string
	StateDir          string
	MaxVolumesPerNode int64
	Nodes             map[accessmode.Backend]backend.Node
	// MountTable is where the node reads what is mounted; the zero value
	// reads the kernel's.
	MountTable mounts.Table
	// Mounter makes the bind mounts a publish gives a workload; nil is
	// the kernel's. A Mounter of its own goes with a MountTable that reads
	// what it mounts.
	Mounter mounts.Mounter
	// BootIDFile is where the kernel's boot id is read
	// (nodestate.BootIDFile when empty).
	BootIDFile string

	// Controller role.
	Controllers map[accessmode.Backend]backend.Controller
	// ControllersLater says the controller role's backends come later, by
	// SetControllers, once this process has the controller lock on their
	// directories; until then Probe answers not ready and every
	// Controller call UNAVAILABLE.
	ControllersLater bool
	// FenceFile is where the controller keeps its network fences
	// (csi-addons NetworkFence), opened with its backends; empty: it
	// keeps none, and refuses the NetworkFence calls.
	FenceFile string
	// FenceStore, when set, keeps the network fences instead of
	// FenceFile: on the storage targets, where every controller finds
	// them.
	FenceStore netfence.Store
	// Elected says the controller acts only during the terms an election
	// gives it (StartTerm, EndTerm), on backends set by SetControllers
	// (with ControllersLater). Between terms it is standby: it answers
	// Identity and the capability calls, and refuses every other
	// Controller call UNAVAILABLE.
	Elected bool

	// Metrics, when set, counts calls and refusals and reads this
	// driver's volumes, pools and lock files at scrape time; nil is off.
	Metrics *metrics.Metrics
}

// Driver implements the three CSI services.
type Driver struct {
	cfg   Config
	locks *opLocks
	nodes *nodeLocks
	// node is this node as NodeGetInfo reports it: its name (its key
	// when too long for a label value), zone, address, limit and
	// initiator name. The zero Node without the node role.
	node  nodeid.Node
	state *nodestate.Store

	// controllersReady is set once cfg.Controllers is final; the store
	// publishes the map to every call that loads true.
	controllersReady atomic.Bool
	// waitingFor is what a Controller call refused meanwhile is told.
	waitingFor atomic.Pointer[string]

	// fences is the controller's network fences (nil: none kept), set
	// with cfg.Controllers. fenceGate is held for reading by an attach
	// from its fence check until its attachment is recorded, and for
	// writing by a change of the list (see fence.go).
	fences    *netfence.List
	fenceGate sync.RWMutex

	// term is an elected controller's running term (nil: standby), and
	// standbyReady whether Probe answers ready without one (term.go).
	termMu       sync.Mutex
	term         *term
	standbyReady bool
	// termGen counts the terms ended, so that a term that was starting
	// when the controller stepped down does not begin.
	termGen uint64
	// peers finds the acting controller for a standby (forward.go).
	peers atomic.Pointer[Peers]
	// fencesBehind says the fence list is not known to be stored
	// everywhere it is kept, or not every volume follows it yet: an
	// elected controller tries again while it acts (term.go).
	fencesBehind atomic.Bool
}

// New checks the configuration and prepares a driver.
func New(cfg Config) (*Driver, error) {
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if len(cfg.Roles) == 0 {
		return nil, fmt.Errorf("no role given: serve controller, node, or both")
	}
	d := &Driver{cfg: cfg, locks: newOpLocks(), nodes: newNodeLocks()}
	if cfg.Elected && !cfg.ControllersLater {
		return nil, fmt.Errorf("an elected controller gets its backends later (ControllersLater)")
	}
	if d.HasRole(RoleController) && len(cfg.Controllers) == 0 && !cfg.ControllersLater {
		return nil, fmt.Errorf("the controller role needs at least one backend (e.g. --block-pool ZONE=DIR)")
	}
	if d.HasRole(RoleNode) {
		if !nodeid.ValidName(cfg.NodeName) {
			return nil, fmt.Errorf("the node role needs --node-id: %q is not a node name (a Kubernetes node name, a DNS subdomain of at most %d characters, or a label value)",
				cfg.NodeName, nodeid.MaxNameLength)
		}
		if cfg.MaxVolumesPerNode < 0 {
			return nil, fmt.Errorf("--max-volumes-per-node is %d; it must be 0 (no limit) or more", cfg.MaxVolumesPerNode)
		}
		n := nodeid.Node{Name: nodeid.Key(cfg.NodeName), Zone: cfg.Zone, Address: cfg.NodeAddress,
			MaxVolumes: cfg.MaxVolumesPerNode, Initiator: cfg.ISCSIInitiator}
		if err := n.Validate(); err != nil {
			return nil, fmt.Errorf("the node role needs --node-id and --zone: %w", err)
		}
		d.node = n
		if cfg.StateDir == "" {
			return nil, fmt.Errorf("the node role needs --state-dir")
		}
		if len(cfg.Nodes) == 0 {
			return nil, fmt.Errorf("the node role needs at least one backend (e.g. --block-pool ZONE=DIR)")
		}
		bootIDFile := cfg.BootIDFile
		if bootIDFile == "" {
			bootIDFile = nodestate.BootIDFile
		}
		boot, err := nodestate.CurrentBootID(bootIDFile)
		if err != nil {
			return nil, err
		}
		store, err := nodestate.Open(cfg.StateDir, boot)
		if err != nil {
			return nil, err
		}
		d.state = store
	}
	if cfg.ControllersLater {
		d.cfg.Controllers = nil
		d.WaitingFor("the controller's backends are being set up")
	} else if d.HasRole(RoleController) {
		if err := d.openFences(context.Background(), cfg.Controllers); err != nil {
			return nil, err
		}
		d.followFencesAtStart()
		d.controllersReady.Store(true)
		d.cfg.Metrics.SetControllerActive(true)
	} else {
		d.controllersReady.Store(true)
	}
	d.setMetricSources()
	return d, nil
}

func (d *Driver) setMetricSources() {
	if d.cfg.Metrics == nil {
		return
	}
	src := metrics.Sources{}
	// The volumes, pools and fences are the acting controller's to report:
	// a standby's backends refuse every call (it holds no lease), and
	// asking them at each scrape would fail the scrape and load the
	// targets for nothing.
	acting := true
	if d.cfg.Elected {
		d.termMu.Lock()
		acting = d.term != nil
		d.termMu.Unlock()
	}
	if d.HasRole(RoleController) && d.controllersReady.Load() && acting {
		src.Controllers = d.cfg.Controllers
		if l := d.fences; l != nil {
			src.FencedBlocks = func() int { return len(l.Fences()) }
		}
	}
	if d.state != nil {
		src.Node, src.Zone, src.Holders = d.cfg.NodeName, d.cfg.Zone, d.state
	}
	d.cfg.Metrics.SetSources(src)
}

// WaitingFor sets what Controller calls are told while the controller's
// backends are not there yet (see Config.ControllersLater).
func (d *Driver) WaitingFor(why string) { d.waitingFor.Store(&why) }

// SetControllers hands the controller role its backends once they are set
// up; from then on Probe answers ready and Controller calls are served.
// It may be called once, and only with Config.ControllersLater.
func (d *Driver) SetControllers(c map[accessmode.Backend]backend.Controller) error {
	if !d.cfg.ControllersLater || d.controllersReady.Load() {
		return fmt.Errorf("the controller's backends are set already")
	}
	if len(c) == 0 {
		return fmt.Errorf("the controller role needs at least one backend (e.g. --block-pool ZONE=DIR)")
	}
	if d.cfg.Elected {
		// The fence list is read and followed as each term starts.
		d.cfg.Controllers = c
		d.controllersReady.Store(true)
		d.setMetricSources()
		return nil
	}
	if err := d.openFences(context.Background(), c); err != nil {
		return err
	}
	d.cfg.Controllers = c
	d.followFencesAtStart()
	d.controllersReady.Store(true)
	d.cfg.Metrics.SetControllerActive(true)
	d.setMetricSources()
	return nil
}

// openFences reads the network fences the controller keeps, if any, and
// rebuilds a lost list from the attachments its backends mark fenced.
func (d *Driver) openFences(ctx context.Context, ctrls map[accessmode.Backend]backend.Controller) error {
	store := d.fenceStore()
	if store == nil {
		return nil
	}
	l, err := netfence.OpenStore(ctx, store)
	if errors.Is(err, netfence.ErrPartlyStored) {
		klog.InfoS("The network fence list is not known to be everywhere it is kept; trying again while acting", "err", err)
		d.fencesBehind.Store(true)
	} else if err != nil {
		return err
	}
	d.fences = l
	if err := d.recoverFences(ctx, ctrls); err != nil {
		return err
	}
	if fences := l.Fences(); len(fences) > 0 {
		klog.InfoS("Network fences in force", "cidrs", netfence.Blocks(fences), "where", l.Where())
	}
	return nil
}

// fenceStore is where the controller keeps its network fences (nil: it
// keeps none).
func (d *Driver) fenceStore() netfence.Store {
	switch {
	case d.cfg.FenceStore != nil:
		return d.cfg.FenceStore
	case d.cfg.FenceFile != "":
		return netfence.FileStore(d.cfg.FenceFile)
	}
	return nil
}

// Ready reports whether every role this process serves can take calls.
// An elected controller is ready during a term, and as a standby once it
// knows another controller acts; one arbitrated by lock files once it
// holds them, or as a standby that forwards while another holds them.
func (d *Driver) Ready() bool {
	switch {
	case !d.HasRole(RoleController):
		return true
	case d.cfg.Elected:
		d.termMu.Lock()
		defer d.termMu.Unlock()
		return d.term != nil || d.standbyReady
	case d.controllersReady.Load():
		return true
	default:
		d.termMu.Lock()
		defer d.termMu.Unlock()
		return d.standbyReady
	}
}

// refuse counts and logs a stage or publish the access-mode rules refused
// and returns its error for the CO.
func (d *Driver) refuse(stage string, id volumeid.ID, mode accessmode.Mode, decision accessmode.Decision, kv ...any) error {
	d.noteRefusal(stage, id, mode, decision, kv...)
	return status.Errorf(decision.Code, "volume %s: %s", id, decision.Message)
}

// refuseAttach is refuse for accessmode.DecideAttach, whose messages are
// whole: not every one of them is about the volume.
func (d *Driver) refuseAttach(id volumeid.ID, mode accessmode.Mode, decision accessmode.Decision, kv ...any) error {
	d.noteRefusal(metrics.StageAttach, id, mode, decision, kv...)
	return status.Error(decision.Code, decision.Message)
}

// noteRefusal logs a refusal, and counts it when it has a reason: one
// without is a request the volume or its transport cannot take whoever
// holds it, no contest over who may hold the volume, which is what the
// metric counts.
func (d *Driver) noteRefusal(stage string, id volumeid.ID, mode accessmode.Mode, decision accessmode.Decision, kv ...any) {
	if decision.Reason != "" {
		d.refused(stage, mode, decision.Reason)
	}
	klog.InfoS("Refused by the access-mode rules", append([]any{"volumeID", id, "stage", stage, "mode", accessmode.Name(mode),
		"code", decision.Code, "reason", decision.Message}, kv...)...)
}

// refused counts a publish the access-mode rules refused (when metrics are on).
func (d *Driver) refused(stage string, mode accessmode.Mode, reason string) {
	d.cfg.Metrics.PublishRefused(stage, mode, reason)
}

// HasRole reports whether this process serves r.
func (d *Driver) HasRole(r Role) bool { return slices.Contains(d.cfg.Roles, r) }

// NodeID is the id this node plugin reports (empty without the node role).
func (d *Driver) NodeID() string {
	if !d.HasRole(RoleNode) {
		return ""
	}
	return d.node.String()
}

// Reconcile brings the node state in line with the kernel when the node
// plugin starts: records of an earlier boot are forgotten (their mounts and
// devices are gone, and the device names may be other volumes' now), and
// holders whose mounts the mount table shows gone are dropped, so a volume
// whose workload went away while the plugin was down is not locked
// forever. A stage the kernel no longer holds is reported and left for the
// next NodeStageVolume to redo (publishes of it are refused meanwhile).
// Anything that cannot be checked is kept as it is: holding a volume on a
// guess is safe, letting it go is not.
func (d *Driver) Reconcile(ctx context.Context) error {
	if d.state == nil {
		return nil
	}
	err := d.state.Reconcile(d.isMounted, func(volumeID string, h accessmode.Holder) {
		d.releaseHolderDevice(ctx, volumeID, h)
	})
	if err != nil {
		return err
	}
	records, err := d.state.All()
	if err != nil {
		return err
	}
	for _, rec := range records {
		if id, err := volumeid.Parse(rec.VolumeID); err == nil {
			d.reportStage(ctx, id, rec)
		}
	}
	return nil
}

// reportStage logs a recorded stage that the kernel no longer holds as
// recorded.
func (d *Driver) reportStage(ctx context.Context, id volumeid.ID, rec *nodestate.Record) {
	if rec.Staged == nil {
		return
	}
	nb, ok := d.cfg.Nodes[id.Backend]
	if !ok {
		return
	}
	check, err := nb.Check(ctx, rec.Staged)
	switch {
	case err != nil:
		klog.ErrorS(err, "Cannot check a recorded stage against the kernel", "volumeID", id, "stagingPath", rec.Staged.StagingPath)
	case check.State == backend.StageGone:
		klog.InfoS("A recorded stage is gone from the kernel; it is staged again at the next NodeStageVolume",
			"volumeID", id, "stagingPath", rec.Staged.StagingPath, "detail", check.Detail)
	case check.State == backend.StageBroken:
		klog.InfoS("A recorded stage does not match the kernel; publishes are refused until it is unstaged",
			"volumeID", id, "stagingPath", rec.Staged.StagingPath, "detail", check.Detail)
	}
}

// releaseHolderDevice detaches the device a holder had of its own (see
// accessmode.Holder.Device); failures are logged, the device may be gone.
func (d *Driver) releaseHolderDevice(ctx context.Context, volumeID string, h accessmode.Holder) {
	if h.Device == "" {
		return
	}
	id, nb, err := d.nodeVolume(volumeID)
	if err != nil {
		return
	}
	rd := nb.ReadOnlyDevices()
	if rd == nil {
		return
	}
	if err := rd.ReleaseDevice(ctx, id, h.Device); err != nil {
		klog.ErrorS(err, "Releasing the device of a dropped holder", "volumeID", volumeID, "device", h.Device)
	}
}

// releaseDropped releases the devices of the holders before had and after
// no longer has.
func (d *Driver) releaseDropped(ctx context.Context, before, after *nodestate.Record) {
	for _, h := range before.Holders {
		if _, kept := after.Holder(h.TargetPath); !kept && h.Device != "" {
			d.releaseHolderDevice(ctx, before.VolumeID, h)
		}
	}
}

// mountAt returns what the mount table shows at p, nil for nothing.
func (d *Driver) mountAt(p string) (*mounts.Mount, error) { return d.cfg.MountTable.At(p) }

// mounter is the Mounter the node makes its bind mounts with.
func (d *Driver) mounter() mounts.Mounter {
	if d.cfg.Mounter == nil {
		return mounts.Kernel{}
	}
	return d.cfg.Mounter
}

// isMounted reports whether p is a mount point (bind mounts included),
// from the mount table; an error means it could not be told.
func (d *Driver) isMounted(p string) (bool, error) { return d.cfg.MountTable.IsMounted(p) }

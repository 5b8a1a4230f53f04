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
	"fmt"
	"slices"

	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/holders"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// DefaultDriverName is the CSI driver name unless --driver-name says otherwise.
const DefaultDriverName = "modeguard.csi.dev"

// Topology keys reported by NodeGetInfo and used for placement.
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
	NodeName          string
	Zone              string
	NodeAddress       string
	StateDir          string
	MaxVolumesPerNode int64
	Nodes             map[accessmode.Backend]backend.Node
	Mounter           mount.Interface

	// Controller role.
	Controllers map[accessmode.Backend]backend.Controller

	// Metrics, when set, counts calls and refusals and reads this
	// driver's volumes, pools and lock files at scrape time; nil is off.
	Metrics *metrics.Metrics
}

// Driver implements the three CSI services.
type Driver struct {
	cfg     Config
	locks   *opLocks
	nodeID  string
	holders *holders.Store
	mounter mount.Interface
}

// New checks the configuration and prepares a driver.
func New(cfg Config) (*Driver, error) {
	if cfg.DriverName == "" {
		cfg.DriverName = DefaultDriverName
	}
	if len(cfg.Roles) == 0 {
		return nil, fmt.Errorf("no role given: serve controller, node, or both")
	}
	d := &Driver{cfg: cfg, locks: newOpLocks(), mounter: cfg.Mounter}
	if d.mounter == nil {
		d.mounter = mount.New("")
	}
	if d.HasRole(RoleController) && len(cfg.Controllers) == 0 {
		return nil, fmt.Errorf("the controller role needs at least one backend (e.g. --block-pool ZONE=DIR)")
	}
	if d.HasRole(RoleNode) {
		n := nodeid.Node{Name: cfg.NodeName, Zone: cfg.Zone, Address: cfg.NodeAddress}
		if err := n.Validate(); err != nil {
			return nil, fmt.Errorf("the node role needs --node-id and --zone: %w", err)
		}
		d.nodeID = n.String()
		if cfg.StateDir == "" {
			return nil, fmt.Errorf("the node role needs --state-dir")
		}
		if len(cfg.Nodes) == 0 {
			return nil, fmt.Errorf("the node role needs at least one backend (e.g. --block-pool ZONE=DIR)")
		}
		store, err := holders.Open(cfg.StateDir)
		if err != nil {
			return nil, err
		}
		d.holders = store
	}
	if cfg.Metrics != nil {
		src := metrics.Sources{}
		if d.HasRole(RoleController) {
			src.Controllers = cfg.Controllers
		}
		if d.holders != nil {
			src.NodeID, src.Holders = d.nodeID, d.holders
		}
		cfg.Metrics.SetSources(src)
	}
	return d, nil
}

// refused counts a publish the access-mode rules refused (when metrics are on).
func (d *Driver) refused(stage string, mode accessmode.Mode, reason string) {
	d.cfg.Metrics.PublishRefused(stage, mode, reason)
}

// HasRole reports whether this process serves r.
func (d *Driver) HasRole(r Role) bool { return slices.Contains(d.cfg.Roles, r) }

// NodeID is the id this node plugin reports (empty without the node role).
func (d *Driver) NodeID() string { return d.nodeID }

// Reconcile brings the node's lock files in line with what is mounted, so a
// plugin restarted after its workloads went away does not keep them locked.
func (d *Driver) Reconcile() error {
	if d.holders == nil {
		return nil
	}
	return d.holders.Reconcile(d.isMounted, func(volumeID string, h accessmode.Holder) {
		d.releaseHolderDevice(context.Background(), volumeID, h)
	})
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
	rd, ok := nb.(readOnlyDevices)
	if !ok {
		return
	}
	if err := rd.ReleaseDevice(ctx, id, h.Device); err != nil {
		klog.ErrorS(err, "Releasing the device of a dropped holder", "volumeID", volumeID, "device", h.Device)
	}
}

// releaseDropped releases the devices of the holders before had and after
// no longer has.
func (d *Driver) releaseDropped(ctx context.Context, before, after *holders.Record) {
	for _, h := range before.Holders {
		if _, kept := after.Holder(h.TargetPath); !kept && h.Device != "" {
			d.releaseHolderDevice(ctx, before.VolumeID, h)
		}
	}
}

// readOnlyDevices is what a node backend offers when it can give one
// workload a read-only view of a volume staged read/write (block: a second,
// read-only loop device of the same image).
type readOnlyDevices interface {
	FreeDevice(ctx context.Context) (string, error)
	ReadOnlyDevice(ctx context.Context, staged *backend.Staged, device string) error
	ReleaseDevice(ctx context.Context, id volumeid.ID, device string) error
}

// isMounted reports whether p is a mount point (bind mounts included).
func (d *Driver) isMounted(p string) bool {
	ok, err := d.mounter.IsMountPoint(p)
	return err == nil && ok
}

package block

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

const (
	volumesDir   = "volumes"
	snapshotsDir = "snapshots"
	metaSuffix   = ".json"
	imageSuffix  = ".img"
	// tempMarker appears in every temporary name this package and fsutil
	// create, and in no final name (those end in .json or .img).
	tempMarker = ".tmp-"
	// replayMarker names the temporary directory a copied filesystem is
	// mounted at while its journal is replayed.
	replayMarker = ".replay"
)

// pool is one zone's directory.
type pool struct {
	zone string
	dir  string // absolute, symlinks resolved
}

// parsePools checks the --block-pool arguments. Pool directories are
// resolved to their real paths because the kernel reports loop devices'
// backing files that way, and Unstage compares against it.
func parsePools(pools map[string]string) (map[string]*pool, []string, error) {
	if len(pools) == 0 {
		return nil, nil, fmt.Errorf("no block pools configured; give at least one --block-pool ZONE=DIR")
	}
	out := make(map[string]*pool, len(pools))
	zoneOfDir := make(map[string]string, len(pools))
	zones := make([]string, 0, len(pools))
	for zone, dir := range pools {
		if !volumeid.ValidZone(zone) {
			return nil, nil, fmt.Errorf("block pool zone %q is not a valid zone name (a Kubernetes label value)", zone)
		}
		if dir == "" {
			return nil, nil, fmt.Errorf("block pool for zone %q has an empty directory", zone)
		}
		abs, err := filepath.Abs(dir)
		if err != nil {
			return nil, nil, fmt.Errorf("block pool for zone %q: %w", zone, err)
		}
		real, err := filepath.EvalSymlinks(abs)
		if err != nil {
			return nil, nil, fmt.Errorf("block pool for zone %q: %w", zone, err)
		}
		fi, err := os.Stat(real)
		if err != nil {
			return nil, nil, fmt.Errorf("block pool for zone %q: %w", zone, err)
		}
		if !fi.IsDir() {
			return nil, nil, fmt.Errorf("block pool for zone %q: %s is not a directory", zone, dir)
		}
		// One directory for two zones would make each zone's controller
		// treat the other's files as foreign.
		if other, dup := zoneOfDir[real]; dup {
			return nil, nil, fmt.Errorf("block pools for zones %q and %q share the directory %s; give each zone its own", other, zone, real)
		}
		zoneOfDir[real] = zone
		out[zone] = &pool{zone: zone, dir: real}
		zones = append(zones, zone)
	}
	sort.Strings(zones)
	return out, zones, nil
}

func subdirFor(kind volumeid.Kind) string {
	if kind == volumeid.Snapshot {
		return snapshotsDir
	}
	return volumesDir
}

func (p *pool) kindDir(kind volumeid.Kind) string {
	return filepath.Join(p.dir, subdirFor(kind))
}

func (p *pool) path(id volumeid.ID, suffix string) (string, error) {
	if id.Zone != p.zone {
		return "", fmt.Errorf("id %s belongs to zone %q, not to pool %q", id, id.Zone, p.zone)
	}
	return fsutil.JoinWithin(p.kindDir(id.Kind), id.FileName()+suffix)
}

func (p *pool) metaPath(id volumeid.ID) (string, error)  { return p.path(id, metaSuffix) }
func (p *pool) imagePath(id volumeid.ID) (string, error) { return p.path(id, imageSuffix) }

// idForFile recovers the id whose files may be called name in this pool's
// kind directory, or reports that name is not such a file.
func (p *pool) idForFile(kind volumeid.Kind, name, suffix string) (volumeid.ID, bool) {
	base, ok := strings.CutSuffix(name, suffix)
	if !ok {
		return volumeid.ID{}, false
	}
	prefix := string(accessmode.BackendBlock) + "_" + p.zone + "_" + string(kind) + "-"
	key, ok := strings.CutPrefix(base, prefix)
	if !ok {
		return volumeid.ID{}, false
	}
	id, err := volumeid.New(accessmode.BackendBlock, p.zone, kind, key)
	if err != nil || id.FileName() != base {
		return volumeid.ID{}, false
	}
	return id, true
}

// poolFor finds the pool that holds id, refusing ids of other backends and
// of the wrong kind.
func poolFor(pools map[string]*pool, zones []string, id volumeid.ID, kind volumeid.Kind) (*pool, error) {
	if id.Backend != accessmode.BackendBlock {
		return nil, status.Errorf(codes.InvalidArgument, "id %s is not a block backend id", id)
	}
	if id.Kind != kind {
		return nil, status.Errorf(codes.InvalidArgument, "id %s names a %s, not a %s", id, id.Kind, kind)
	}
	p, ok := pools[id.Zone]
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument, "zone %q has no block pool here (configured zones: %s)", id.Zone, strings.Join(zones, ", "))
	}
	return p, nil
}

// PoolMarkerFile is the file a controller puts in every pool it uses, saying
// which zone's pool the directory is. A node finds it in its own pool
// directory only when that directory is the one the controller uses: a
// per-node directory (a hostPath on separate machines) lacks it, and the
// node can then say so instead of reporting a volume that does not exist.
const PoolMarkerFile = ".modeguard-pool.json"

// poolMarker is what PoolMarkerFile holds.
type poolMarker struct {
	Zone string `json:"zone"`
	// Note says what the file is, to whoever finds it.
	Note string `json:"note"`
}

// mark writes the pool's marker unless it is there (a controller's part).
func (p *pool) mark() error {
	path := filepath.Join(p.dir, PoolMarkerFile)
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	return fsutil.WriteJSONAtomic(path, poolMarker{Zone: p.zone,
		Note: "the block pool of this zone, as a modeguard controller uses it; every node of the zone must see this same directory"})
}

// checkShared says what is wrong when this directory is not the pool a
// controller uses for the zone: it has no marker (no controller ever used
// it, so the node's directory is not the shared one), or another zone's.
// nil when it looks like the zone's shared pool.
func (p *pool) checkShared() error {
	var m poolMarker
	err := fsutil.ReadJSON(filepath.Join(p.dir, PoolMarkerFile), &m)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("this node's block pool of zone %s, %s, is not the pool the controller uses: no controller has ever used that directory (it has no %s). "+
			"Every node of a zone must see the very directory the controller uses for the zone (a filesystem they share), "+
			"or, on separate machines, reach the volumes from the zone's storage target over iSCSI (the chart's iscsi.enabled)",
			p.zone, p.dir, PoolMarkerFile)
	case err != nil:
		return fmt.Errorf("reading the marker of the block pool of zone %s: %w", p.zone, err)
	case m.Zone != p.zone:
		return fmt.Errorf("this node's block pool of zone %s, %s, is the pool of zone %q: give each zone's pool to its own --block-pool", p.zone, p.dir, m.Zone)
	}
	return nil
}

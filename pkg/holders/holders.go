// Package holders keeps, on each node, the lock files that say who holds a
// volume there: which staging path the node plugin set up, and which
// workloads (target paths) the volume is published to.
//
// The files live under the plugin's --state-dir, one per volume, and are
// replaced atomically, so the within-node access-mode rules keep holding
// after the plugin is killed and restarted: a fresh process reads the same
// holders back. A holder is written before its mount is made and removed
// after its mount is gone, so a crash in between can only leave a holder
// without a mount (dropped by Reconcile), never a mount without a holder.
package holders

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Record is one volume's lock file.
type Record struct {
	VolumeID string `json:"volumeID"`
	// NodeID is the node plugin that wrote the record, so that a reader
	// of several nodes' state (modeguard inspect) can tell them apart.
	NodeID  string              `json:"nodeID,omitempty"`
	Staged  *backend.Staged     `json:"staged,omitempty"`
	Holders []accessmode.Holder `json:"holders,omitempty"`
	// StagePending is the staging path of a stage begun and not recorded
	// yet: set before the backend attaches or mounts anything, cleared
	// with the Staged record. Found set, it says a stage was interrupted
	// (the plugin killed) and may have left a device or mount behind.
	StagePending string `json:"stagePending,omitempty"`
}

// Empty reports whether the record holds nothing, so its file can go.
func (r *Record) Empty() bool {
	return r.Staged == nil && len(r.Holders) == 0 && r.StagePending == ""
}

// Holder returns the holder at targetPath, if any.
func (r *Record) Holder(targetPath string) (accessmode.Holder, bool) {
	for _, h := range r.Holders {
		if h.TargetPath == targetPath {
			return h, true
		}
	}
	return accessmode.Holder{}, false
}

// WithHolder returns a copy of the record with h added (or replacing the
// holder at the same target path).
func (r *Record) WithHolder(h accessmode.Holder) *Record {
	out := r.WithoutHolder(h.TargetPath)
	out.Holders = append(out.Holders, h)
	sort.Slice(out.Holders, func(i, j int) bool { return out.Holders[i].TargetPath < out.Holders[j].TargetPath })
	return out
}

// WithoutHolder returns a copy of the record without the holder at targetPath.
func (r *Record) WithoutHolder(targetPath string) *Record {
	out := &Record{VolumeID: r.VolumeID, NodeID: r.NodeID, Staged: r.Staged, StagePending: r.StagePending}
	for _, h := range r.Holders {
		if h.TargetPath != targetPath {
			out.Holders = append(out.Holders, h)
		}
	}
	return out
}

// Store reads and writes the lock files of one node plugin.
type Store struct {
	dir string
	// mu only keeps the directory listing and file replacement of one
	// process consistent; per-volume serialization is the caller's job.
	mu sync.Mutex
}

const fileSuffix = ".json"

// Open prepares <stateDir>/holders (mode 0700) and returns its store.
func Open(stateDir string) (*Store, error) {
	dir := filepath.Join(stateDir, "holders")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating lock file directory: %w", err)
	}
	return &Store{dir: dir}, nil
}

// Dir is where the lock files are.
func (s *Store) Dir() string { return s.dir }

func (s *Store) path(id volumeid.ID) (string, error) {
	return fsutil.JoinWithin(s.dir, id.FileName()+fileSuffix)
}

// Load returns the volume's record; a volume with no lock file gets an empty one.
func (s *Store) Load(id volumeid.ID) (*Record, error) {
	p, err := s.path(id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := &Record{}
	if err := fsutil.ReadJSON(p, rec); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return &Record{VolumeID: id.String()}, nil
		}
		return nil, fmt.Errorf("reading lock file: %w", err)
	}
	if rec.VolumeID != id.String() {
		return nil, fmt.Errorf("lock file %s belongs to volume %q, not %q", p, rec.VolumeID, id)
	}
	return rec, nil
}

// Save replaces the volume's lock file with rec, atomically; an empty
// record removes the file.
func (s *Store) Save(id volumeid.ID, rec *Record) error {
	p, err := s.path(id)
	if err != nil {
		return err
	}
	rec.VolumeID = id.String()
	s.mu.Lock()
	defer s.mu.Unlock()
	if rec.Empty() {
		return fsutil.RemoveDurably(p)
	}
	return fsutil.WriteJSONAtomic(p, rec)
}

// All returns every record on this node, sorted by volume id.
func (s *Store) All() ([]*Record, error) {
	s.mu.Lock()
	entries, err := os.ReadDir(s.dir)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	var out []*Record
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, fileSuffix) || strings.HasPrefix(name, ".") {
			continue
		}
		rec := &Record{}
		if err := fsutil.ReadJSON(filepath.Join(s.dir, name), rec); err != nil {
			return nil, err
		}
		// Like Load, refuse a file that claims another volume's id: acting
		// on it would rewrite (or remove) that volume's real lock file.
		if id, err := volumeid.Parse(rec.VolumeID); err != nil || id.FileName()+fileSuffix != name {
			klog.ErrorS(err, "Ignoring lock file that does not belong to the volume it names", "file", name, "volumeID", rec.VolumeID)
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].VolumeID < out[j].VolumeID })
	return out, nil
}

// RemoveLeftovers deletes temporary files a crash left in the directory.
func (s *Store) RemoveLeftovers() {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") && strings.Contains(e.Name(), ".tmp-") {
			_ = os.Remove(filepath.Join(s.dir, e.Name()))
		}
	}
}

// DropUnmounted removes from rec every holder whose target path is no longer
// mounted (its workload vanished while nobody was watching), logging each.
// It returns the pruned record and whether anything was dropped.
func DropUnmounted(rec *Record, isMounted func(path string) bool) (*Record, bool) {
	out := &Record{VolumeID: rec.VolumeID, NodeID: rec.NodeID, Staged: rec.Staged, StagePending: rec.StagePending}
	dropped := false
	for _, h := range rec.Holders {
		if isMounted(h.TargetPath) {
			out.Holders = append(out.Holders, h)
			continue
		}
		dropped = true
		klog.InfoS("Dropping lock holder whose target path is no longer mounted",
			"volumeID", rec.VolumeID, "targetPath", h.TargetPath, "workload", h.Workload.String(),
			"mode", accessmode.Name(h.Mode), "since", h.Since)
	}
	return out, dropped
}

// Reconcile drops, in every lock file, the holders whose target paths are no
// longer mounted. Run at start-up, so that a volume whose workload went away
// while the plugin was down is not locked forever. release, when set, is
// called for each dropped holder that has a device of its own, before the
// record forgets it.
func (s *Store) Reconcile(isMounted func(path string) bool, release func(volumeID string, h accessmode.Holder)) error {
	s.RemoveLeftovers()
	records, err := s.All()
	if err != nil {
		return err
	}
	for _, rec := range records {
		pruned, dropped := DropUnmounted(rec, isMounted)
		if !dropped {
			continue
		}
		if release != nil {
			for _, h := range rec.Holders {
				if _, kept := pruned.Holder(h.TargetPath); !kept && h.Device != "" {
					release(rec.VolumeID, h)
				}
			}
		}
		id, err := volumeid.Parse(rec.VolumeID)
		if err != nil {
			klog.ErrorS(err, "Ignoring lock file with an unparsable volume id")
			continue
		}
		if err := s.Save(id, pruned); err != nil {
			return err
		}
	}
	return nil
}

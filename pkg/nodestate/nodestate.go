// Package nodestate keeps, on each node, what the node plugin did for each
// volume: the stage it made (staging path, device, the mode it was staged
// with) and the workloads that hold it (target paths), together with the
// boot of the kernel those mounts and devices belong to.
//
// The files live under the plugin's --state-dir, one per volume, and are
// replaced atomically, so the within-node access-mode rules keep holding
// after the plugin is killed and restarted: a fresh process reads the same
// holders back. A holder is written before its mount is made and removed
// after its mount is gone, so a crash in between can only leave a holder
// without a mount (dropped once the mount table shows it gone), never a
// mount without a holder.
//
// A record is a claim about the kernel, never proof: the node plugin checks
// what a record names against the mount table and the loop devices before
// it answers from it. A record written in an earlier boot names mounts and
// devices that no longer exist (device names are handed out again after a
// reboot, possibly to other volumes), so its stage and holders are
// forgotten, not checked.
package nodestate

import (
	"bytes"
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

// BootIDFile is where the kernel tells the id of the current boot; it
// changes at every boot and is the same for every container on the host.
const BootIDFile = "/proc/sys/kernel/random/boot_id"

// CurrentBootID reads the id of the running kernel's boot from file
// (BootIDFile unless a test names another).
func CurrentBootID(file string) (string, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("reading the boot id: %w", err)
	}
	id := string(bytes.TrimSpace(data))
	if id == "" || len(id) > 64 || strings.ContainsAny(id, "\x00/\n") {
		return "", fmt.Errorf("boot id %q read from %s is not one", id, file)
	}
	return id, nil
}

// Record is one volume's lock file.
type Record struct {
	VolumeID string `json:"volumeID"`
	// NodeID is the node plugin that wrote the record, so that a reader
	// of several nodes' state (modeguard inspect) can tell them apart.
	NodeID string `json:"nodeID,omitempty"`
	// BootID is the boot of the kernel whose mounts and devices the record
	// names (see CurrentBootID); empty in records written before it was
	// kept, which are then trusted no further than the kernel confirms.
	BootID  string              `json:"bootID,omitempty"`
	Staged  *backend.Staged     `json:"staged,omitempty"`
	Holders []accessmode.Holder `json:"holders,omitempty"`
	// StagePending is the staging path of a stage begun and not recorded
	// yet: set before the backend attaches or mounts anything, cleared
	// with the Staged record. Found set, it says a stage was interrupted
	// (the plugin killed) and may have left a device or mount behind.
	StagePending string `json:"stagePending,omitempty"`
}

// FromEarlierBoot reports whether the record was written in another boot
// than boot: its stage and holders name mounts and devices that are gone.
func (r *Record) FromEarlierBoot(boot string) bool {
	return r.BootID != "" && r.BootID != boot
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
	out := &Record{VolumeID: r.VolumeID, NodeID: r.NodeID, BootID: r.BootID, Staged: r.Staged, StagePending: r.StagePending}
	for _, h := range r.Holders {
		if h.TargetPath != targetPath {
			out.Holders = append(out.Holders, h)
		}
	}
	return out
}

// Store reads and writes the lock files of one node plugin.
type Store struct {
	dir    string
	bootID string
	// mu only keeps the directory listing and file replacement of one
	// process consistent; per-volume serialization is the caller's job.
	mu sync.Mutex
}

const fileSuffix = ".json"

// DirName is the directory under --state-dir that holds the records;
// legacyDirName is where plugins that kept only lock files put them.
const (
	DirName       = "volumes"
	legacyDirName = "holders"
)

// Open prepares <stateDir>/volumes (mode 0700) and returns its store for
// the boot bootID: every record saved is stamped with it. A directory of
// an earlier version (<stateDir>/holders) is taken over by renaming it.
func Open(stateDir, bootID string) (*Store, error) {
	if bootID == "" {
		return nil, errors.New("node state: a boot id is required")
	}
	dir := filepath.Join(stateDir, DirName)
	legacy := filepath.Join(stateDir, legacyDirName)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if _, err := os.Stat(legacy); err == nil {
			if err := os.Rename(legacy, dir); err != nil {
				return nil, fmt.Errorf("taking over the lock files of %s: %w", legacy, err)
			}
			klog.InfoS("Took over the lock files of an earlier version", "from", legacy, "to", dir)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating the node state directory: %w", err)
	}
	return &Store{dir: dir, bootID: bootID}, nil
}

// BootID is the boot this store stamps its records with.
func (s *Store) BootID() string { return s.bootID }

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
	if rec.FromEarlierBoot(s.bootID) {
		return ForgetEarlierBoot(rec), nil
	}
	return rec, nil
}

// ForgetEarlierBoot returns an empty record for rec's volume, logging what
// rec claimed: the kernel that held those mounts and devices is gone, and
// the device names may belong to other volumes now, so nothing of it is
// checked, released or unmounted.
func ForgetEarlierBoot(rec *Record) *Record {
	if rec.Staged != nil {
		klog.InfoS("Forgetting a stage made in an earlier boot; the volume is staged again when asked",
			"volumeID", rec.VolumeID, "stagingPath", rec.Staged.StagingPath, "device", rec.Staged.Device, "bootID", rec.BootID)
	}
	if rec.StagePending != "" {
		klog.InfoS("Forgetting a stage interrupted in an earlier boot", "volumeID", rec.VolumeID, "stagingPath", rec.StagePending)
	}
	for _, h := range rec.Holders {
		klog.InfoS("Forgetting a lock holder from an earlier boot", "volumeID", rec.VolumeID,
			"targetPath", h.TargetPath, "workload", h.Workload.String(), "mode", accessmode.Name(h.Mode))
	}
	return &Record{VolumeID: rec.VolumeID, NodeID: rec.NodeID}
}

// Save replaces the volume's lock file with rec, atomically; an empty
// record removes the file.
func (s *Store) Save(id volumeid.ID, rec *Record) error {
	p, err := s.path(id)
	if err != nil {
		return err
	}
	rec.VolumeID = id.String()
	rec.BootID = s.bootID
	s.mu.Lock()
	defer s.mu.Unlock()
	if rec.Empty() {
		return fsutil.RemoveDurably(p)
	}
	return fsutil.WriteJSONAtomic(p, rec)
}

// All returns every record on this node as written, sorted by volume id
// (records of an earlier boot included: see Record.FromEarlierBoot).
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

// DropUnmounted removes from rec every holder whose target path the mount
// table shows unmounted (its workload went away while nobody was watching),
// logging each. It drops nothing on an error: a holder whose mount cannot
// be checked still holds the volume, or the rules would admit a second
// workload on a guess. It returns the pruned record and whether anything
// was dropped.
func DropUnmounted(rec *Record, isMounted func(path string) (bool, error)) (*Record, bool, error) {
	out := &Record{VolumeID: rec.VolumeID, NodeID: rec.NodeID, BootID: rec.BootID, Staged: rec.Staged, StagePending: rec.StagePending}
	dropped := false
	for _, h := range rec.Holders {
		mounted, err := isMounted(h.TargetPath)
		if err != nil {
			return rec, false, fmt.Errorf("checking whether %s still holds volume %s: %w", h.TargetPath, rec.VolumeID, err)
		}
		if mounted {
			out.Holders = append(out.Holders, h)
			continue
		}
		dropped = true
		klog.InfoS("Dropping lock holder whose target path is no longer mounted",
			"volumeID", rec.VolumeID, "targetPath", h.TargetPath, "workload", h.Workload.String(),
			"mode", accessmode.Name(h.Mode), "since", h.Since)
	}
	return out, dropped, nil
}

// Reconcile brings every record in line with the kernel when the node
// plugin starts: records of an earlier boot are forgotten (ForgetEarlierBoot:
// nothing of them is released), and holders whose target paths the mount
// table shows unmounted are dropped, so a volume whose workload went away
// while the plugin was down is not locked forever. release, when set, is
// called for each dropped holder that has a device of its own, before the
// record forgets it. A record whose mounts cannot be checked is kept as it
// is: holding a volume on a guess is safe, letting it go is not.
func (s *Store) Reconcile(isMounted func(path string) (bool, error), release func(volumeID string, h accessmode.Holder)) error {
	s.RemoveLeftovers()
	records, err := s.All()
	if err != nil {
		return err
	}
	for _, rec := range records {
		id, err := volumeid.Parse(rec.VolumeID)
		if err != nil {
			klog.ErrorS(err, "Ignoring lock file with an unparsable volume id")
			continue
		}
		if rec.FromEarlierBoot(s.bootID) {
			if err := s.Save(id, ForgetEarlierBoot(rec)); err != nil {
				return err
			}
			continue
		}
		pruned, dropped, err := DropUnmounted(rec, isMounted)
		if err != nil {
			klog.ErrorS(err, "Keeping the volume's holders: their mounts cannot be checked", "volumeID", rec.VolumeID)
			continue
		}
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
		if err := s.Save(id, pruned); err != nil {
			return err
		}
	}
	return nil
}

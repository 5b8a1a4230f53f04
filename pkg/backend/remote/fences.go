package remote

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/netfence"
)

// The controller's network fence list lives on every storage target, so
// that whichever controller acts next reads it: the controller stores each
// change, one version on, on every target before it acts on it, and
// acknowledges it only once every target has it. At the start of a term it
// reads every target's list and takes the highest version (a change
// stored on some targets before a crash wins), writing it to the targets
// that are behind. The calls are leased: a controller whose term ended
// cannot change the list.

// fenceRecordFile is the list's record in the target's state directory.
const fenceRecordFile = ".modeguard-fences.json"

// fenceRecord is the target's side: the list of the highest version
// stored, on its disk (in memory for a target without a state directory).
type fenceRecord struct {
	path string

	mu     sync.Mutex
	stored netfence.Stored
}

// newFenceRecord reads the record in stateDir; one that cannot be read is
// an error: a target that does not know which nodes are fenced does not
// start, rather than let a controller take an older list for the newest.
func newFenceRecord(stateDir string) (*fenceRecord, error) {
	r := &fenceRecord{}
	if stateDir == "" {
		return r, nil
	}
	r.path = filepath.Join(stateDir, fenceRecordFile)
	s, err := netfence.FileStore(r.path).Load(context.Background())
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("the storage target's network fence record cannot be read, so it is not known which nodes are fenced: %w; "+
			"remove the file only once the fences are known to be on the other targets", err)
	}
	r.stored = s
	return r, nil
}

func (r *fenceRecord) load() netfence.Stored {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stored
}

// store keeps s if it is a later version than the one held (or the same
// one again); an earlier version is refused, so that a controller behind
// cannot take the list back.
func (r *fenceRecord) store(s netfence.Stored) error {
	if err := s.Check("the request"); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stored.Found && s.Version < r.stored.Version {
		return status.Errorf(codes.Aborted, "this storage target holds the network fence list at version %d, later than %d: read it again", r.stored.Version, s.Version)
	}
	if r.path != "" {
		if err := (netfence.FileStore(r.path)).Save(context.Background(), s); err != nil {
			return status.Error(codes.Unavailable, err.Error())
		}
	}
	s.Found = true
	r.stored = s
	return nil
}

// wireFences is the list on the wire; Found does not travel in Stored.
type wireFences struct {
	netfence.Stored
	Found bool `json:"found"`
}

// Fences reads the target's list.
func (c *Client) Fences(ctx context.Context) (netfence.Stored, error) {
	w, err := call[wireFences](ctx, c, "Fences", empty{})
	if err != nil {
		return netfence.Stored{}, err
	}
	w.Stored.Found = w.Found
	return w.Stored, nil
}

// StoreFences stores s on the target.
func (c *Client) StoreFences(ctx context.Context, s netfence.Stored) error {
	_, err := call[empty](ctx, c, "StoreFences", s)
	return err
}

// FenceStore keeps the network fence list on every one of clients' targets.
func FenceStore(clients []*Client) netfence.Store { return targetFences(clients) }

type targetFences []*Client

func (t targetFences) Where() string {
	names := make([]string, len(t))
	for i, c := range t {
		names[i] = c.name
	}
	return "the storage targets " + strings.Join(names, ", ")
}

// Load reads every target's list and takes the highest version, which it
// writes to the targets behind. Targets that do not answer are left out:
// every acknowledged change is on every target, so any one gives the
// newest of those; none answering is an error. When some target could not
// be read or brought up to date, the list comes with an error wrapping
// netfence.ErrPartlyStored, for the caller to try again later.
func (t targetFences) Load(ctx context.Context) (netfence.Stored, error) {
	lists := make([]netfence.Stored, len(t))
	errs := make([]error, len(t))
	var wg sync.WaitGroup
	for i, c := range t {
		wg.Go(func() { lists[i], errs[i] = c.Fences(ctx) })
	}
	wg.Wait()
	best := -1
	for i := range t {
		if errs[i] != nil {
			klog.InfoS("Could not read a storage target's network fence list; reading the others", "target", t[i].name, "err", errs[i])
			continue
		}
		if best < 0 || (lists[i].Found && (!lists[best].Found || lists[i].Version > lists[best].Version)) {
			best = i
		}
	}
	if best < 0 {
		return netfence.Stored{}, status.Errorf(codes.Unavailable, "no storage target answers for the network fence list: %v", errors.Join(errs...))
	}
	newest := lists[best]
	var behind []string
	for i, c := range t {
		switch {
		case errs[i] != nil:
			behind = append(behind, fmt.Sprintf("%s: %v", c.name, status.Convert(errs[i]).Message()))
		case newest.Found && (!lists[i].Found || lists[i].Version < newest.Version):
			if err := c.StoreFences(ctx, newest); err != nil {
				behind = append(behind, fmt.Sprintf("%s: %v", c.name, status.Convert(err).Message()))
			}
		}
	}
	if len(behind) > 0 {
		return newest, fmt.Errorf("%w: version %d is not known to be on %s", netfence.ErrPartlyStored, newest.Version, strings.Join(behind, "; "))
	}
	return newest, nil
}

// Save stores s on every target at once: all of them is success, some of
// them netfence.ErrPartlyStored, none an error.
func (t targetFences) Save(ctx context.Context, s netfence.Stored) error {
	errs := make([]error, len(t))
	var wg sync.WaitGroup
	for i, c := range t {
		wg.Go(func() { errs[i] = c.StoreFences(ctx, s) })
	}
	wg.Wait()
	var failed []string
	for i, err := range errs {
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", t[i].name, status.Convert(err).Message()))
		}
	}
	switch {
	case len(failed) == 0:
		return nil
	case len(failed) < len(t):
		return fmt.Errorf("%w: not on %s", netfence.ErrPartlyStored, strings.Join(failed, "; "))
	}
	return status.Errorf(codes.Unavailable, "no storage target stored the network fence list: %s", strings.Join(failed, "; "))
}

package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/controllerlock"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
)

// The codes the CSI spec lets each call answer with (besides OK). Internal
// and Unknown are absent on purpose: every refusal the driver makes has a
// cause it can name, and ABORTED is its answer to a call racing another on
// the same volume.
var allowedCodes = map[string][]codes.Code{
	// Snapshots are taken with the model frozen (snapshotRestore): the
	// answer is OK, or FAILED_PRECONDITION for a volume in use on a pool
	// without reflinks, checked there.
	"CreateSnapshot": {codes.FailedPrecondition},
	"ControllerPublishVolume": {codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.FailedPrecondition, codes.ResourceExhausted, codes.Aborted},
	"ControllerUnpublishVolume": {codes.InvalidArgument, codes.NotFound, codes.Aborted},
	"NodeStageVolume":           {codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition, codes.Aborted},
	"NodeUnstageVolume":         {codes.InvalidArgument, codes.NotFound, codes.FailedPrecondition, codes.Aborted},
	"NodePublishVolume":         {codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition, codes.Aborted},
	"NodeUnpublishVolume":       {codes.InvalidArgument, codes.NotFound, codes.Aborted},
}

type stressNode struct {
	name, zone string
	proc       *crashProc
	id         string // CSI node id, from NodeGetInfo
	nc         csi.NodeClient
}

// stressTarget is what the test believes is published at a target path.
type stressTarget struct {
	pod   int
	reqRO bool // the readonly flag of the NodePublishVolume that succeeded
	ro    bool // what the workload must get: reqRO, a read-only attachment or a read-only mode
}

type stressAttach struct {
	ro     bool
	pubCtx map[string]string
}

// stressVol is one volume and the test's model of it. ctrlMu is held for
// every controller call on the volume and nodeMu[n] for every call that
// changes its state on node n (a ControllerPublish/Unpublish to n takes
// both, as a CO never attaches or detaches a node while it stages there),
// so the model of what succeeded can be compared with the real state at
// any instant all of them are held.
type stressVol struct {
	name  string
	mode  csi.VolumeCapability_AccessMode_Mode
	block bool
	// fsType is the filesystem the volume names at creation ("" for raw
	// block).
	fsType string
	zone   string
	pool   string
	size   int64

	id     string
	volCtx map[string]string
	image  string
	meta   string

	ctrlMu sync.Mutex
	nodeMu []sync.Mutex

	// formatted: the volume has its filesystem (made at creation where
	// formattedAtCreate says so, else by the first read/write stage).
	formatted atomic.Bool

	attach   []*stressAttach
	staged   []bool
	stagedRO []bool
	targets  []map[string]stressTarget
}

func (v *stressVol) capability() *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: v.mode}}
	if v.block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: v.fsType}}
	}
	return c
}

// formattedAtCreate says whether CreateVolume gives the volume its
// filesystem: where no node may ever write it (a read-only mode), and
// where it names ext4, which the controller copies from a template. Every
// stress volume is made empty, never a restore or a clone, which bring
// their source's filesystem. A volume naming xfs or no filesystem has none
// until its first read/write stage.
func (v *stressVol) formattedAtCreate() bool {
	return readOnlyMode(v.mode) || v.fsType == "ext4"
}

func (v *stressVol) lockAll() func() {
	v.ctrlMu.Lock()
	for i := range v.nodeMu {
		v.nodeMu[i].Lock()
	}
	return func() {
		for i := len(v.nodeMu) - 1; i >= 0; i-- {
			v.nodeMu[i].Unlock()
		}
		v.ctrlMu.Unlock()
	}
}

type csiMode = csi.VolumeCapability_AccessMode_Mode

func singleNode(m csiMode) bool {
	switch m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return true
	}
	return false
}

func singleTarget(m csiMode) bool {
	switch m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER:
		return true
	}
	return false
}

func readOnlyMode(m csiMode) bool {
	return m == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY || m == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

// writerNodes is how many nodes the mode lets write at once.
func writerNodes(m csiMode) int {
	switch {
	case readOnlyMode(m):
		return 0
	case m == csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return 1 << 30
	default:
		return 1
	}
}

const stressPods = 4

func stressPodContext(volCtx map[string]string, pod int) map[string]string {
	out := map[string]string{
		"csi.storage.k8s.io/pod.name":      fmt.Sprintf("pod-%d", pod),
		"csi.storage.k8s.io/pod.namespace": "stress",
		"csi.storage.k8s.io/pod.uid":       fmt.Sprintf("00000000-0000-0000-0000-00000000000%d", pod),
	}
	for k, val := range volCtx {
		out[k] = val
	}
	return out
}

// stress is the shared state of TestStressInvariants.
type stress struct {
	t       *testing.T
	work    string
	kubelet string
	ctrl    *crashProc
	cc      csi.ControllerClient
	nodes   []*stressNode
	vols    []*stressVol
	slots   []string // target path names per node and volume

	mu         sync.Mutex
	calls      map[string]map[codes.Code]int
	checks     map[string]int
	violations map[string][]string // a few distinct examples of each kind
	nviol      map[string]int
}

func (s *stress) stagingPath(n int, v *stressVol) string {
	return filepath.Join(s.kubelet, s.nodes[n].name, "staging", v.name)
}

func (s *stress) targetPath(n int, v *stressVol, slot string) string {
	return filepath.Join(s.kubelet, s.nodes[n].name, "pods", slot, v.name)
}

// violate records a broken invariant or a wrong answer. Kinds are counted
// and a few examples of each kept, so a systematic failure reads as one
// line with a count rather than thousands of errors.
func (s *stress) violate(kind, format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nviol[kind]++
	if e := fmt.Sprintf(format, args...); len(s.violations[kind]) < 5 && !slices.Contains(s.violations[kind], e) {
		s.violations[kind] = append(s.violations[kind], e)
	}
}

func (s *stress) passed(kind string, n int) {
	s.mu.Lock()
	s.checks[kind] += n
	s.mu.Unlock()
}

// call runs one CSI call and checks that its code is one the spec allows.
func (s *stress) call(name string, f func(ctx context.Context) error) (codes.Code, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := f(ctx)
	code := status.Code(err)
	s.mu.Lock()
	if s.calls[name] == nil {
		s.calls[name] = map[codes.Code]int{}
	}
	s.calls[name][code]++
	s.mu.Unlock()
	if code != codes.OK && !slices.Contains(allowedCodes[name], code) {
		s.violate("code not allowed: "+name+" "+code.String(), "%s: %v", name, err)
	}
	return code, err
}

// answer is the outcome of a call as the model takes it.
type answer struct {
	code codes.Code
	err  error
}

// callMaybeTwice runs the call once, or twice at the same moment as a CO
// retrying after a timeout would. The two answers must agree, except that
// one of them may be ABORTED because the other held the volume; the answer
// that counts is the one that was not. A call made alone (not racing)
// has nothing to race with, the test's locks see to that, so ABORTED then
// means the driver left a volume's operation lock taken.
func (s *stress) callMaybeTwice(twice, racing bool, name, what string, f func(ctx context.Context) error) answer {
	if !twice {
		c, err := s.call(name, f)
		if c == codes.Aborted && !racing {
			s.violate("ABORTED with nothing else in flight", "%s %s: %v", name, what, err)
		}
		return answer{c, err}
	}
	var a, b answer
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); a.code, a.err = s.call(name, f) }()
	go func() { defer wg.Done(); b.code, b.err = s.call(name, f) }()
	wg.Wait()
	switch {
	case a.code == b.code && a.code == codes.Aborted:
		s.violate("both of two identical calls ABORTED", "%s %s", name, what)
		return a
	case a.code == b.code:
		return a
	case a.code == codes.Aborted:
		return b
	case b.code == codes.Aborted:
		return a
	}
	s.violate("two identical calls answered differently", "%s %s: %v and %v", name, what, a.err, b.err)
	if b.code == codes.OK {
		return b // the state changed; the model must follow
	}
	return a
}

func (s *stress) expect(name, what string, got answer, want codes.Code) {
	if got.code != want && got.code != codes.Aborted { // ABORTED is judged by callMaybeTwice
		s.violate("unexpected answer: "+name, "%s %s: got %v, want %v", name, what, got.err, want)
	}
}

// controllerPublish attaches v to one node, or to two at once.
func (s *stress) controllerPublish(rng *rand.Rand, v *stressVol) bool {
	ns := []int{rng.IntN(len(s.nodes))}
	if rng.IntN(3) == 0 {
		if o := rng.IntN(len(s.nodes)); o != ns[0] {
			ns = append(ns, o)
			sort.Ints(ns)
		}
	}
	v.ctrlMu.Lock()
	defer v.ctrlMu.Unlock()
	for _, n := range ns {
		v.nodeMu[n].Lock()
		defer v.nodeMu[n].Unlock()
	}
	type outcome struct {
		code   codes.Code
		ro     bool
		pubCtx map[string]string
	}
	out := make([]outcome, len(ns))
	var wg sync.WaitGroup
	for i, n := range ns {
		ro := rng.IntN(2) == 0
		twice := len(ns) == 1 && rng.IntN(5) == 0
		effRO := ro || readOnlyMode(v.mode)
		want := codes.OK
		if len(ns) == 1 {
			want = s.expectAttach(v, n, effRO)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mu sync.Mutex
			what := fmt.Sprintf("%s to %s readonly=%t", v.name, s.nodes[n].name, ro)
			got := s.callMaybeTwice(twice, len(ns) > 1, "ControllerPublishVolume", what, func(ctx context.Context) error {
				r, err := s.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.id, NodeId: s.nodes[n].id,
					VolumeCapability: v.capability(), Readonly: ro, VolumeContext: v.volCtx})
				if err == nil {
					mu.Lock()
					out[i].pubCtx = r.GetPublishContext()
					mu.Unlock()
				}
				return err
			})
			if len(ns) == 1 {
				s.expect("ControllerPublishVolume", what, got, want)
			}
			out[i].code, out[i].ro = got.code, effRO
		}()
	}
	wg.Wait()
	changed := false
	for i, n := range ns {
		if out[i].code != codes.OK {
			continue
		}
		if got := out[i].pubCtx[driver.PublishContextReadOnly]; got != strconv.FormatBool(out[i].ro) {
			s.violate("publish context readonly", "%s to %s: publish context says readonly=%q, want %t", v.name, s.nodes[n].name, got, out[i].ro)
		}
		v.attach[n] = &stressAttach{ro: out[i].ro, pubCtx: out[i].pubCtx}
		changed = true
	}
	return changed
}

// expectAttach is the answer the access-mode table gives to one more node.
func (s *stress) expectAttach(v *stressVol, n int, effRO bool) codes.Code {
	if s.nodes[n].zone != v.zone {
		return codes.FailedPrecondition
	}
	if a := v.attach[n]; a != nil {
		if a.ro == effRO {
			return codes.OK
		}
		return codes.AlreadyExists
	}
	others, writers := 0, 0
	for o, a := range v.attach {
		if a != nil && o != n {
			others++
			if !a.ro {
				writers++
			}
		}
	}
	if others == 0 {
		return codes.OK
	}
	if singleNode(v.mode) {
		return codes.FailedPrecondition
	}
	if !effRO {
		writers++
	}
	if writers > writerNodes(v.mode) {
		return codes.FailedPrecondition
	}
	return codes.OK
}

func (s *stress) controllerUnpublish(rng *rand.Rand, v *stressVol) bool {
	n := rng.IntN(len(s.nodes))
	v.ctrlMu.Lock()
	defer v.ctrlMu.Unlock()
	v.nodeMu[n].Lock()
	defer v.nodeMu[n].Unlock()
	if v.staged[n] {
		return false // a CO detaches only what no node has staged
	}
	what := fmt.Sprintf("%s from %s", v.name, s.nodes[n].name)
	got := s.callMaybeTwice(rng.IntN(5) == 0, false, "ControllerUnpublishVolume", what, func(ctx context.Context) error {
		_, err := s.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: s.nodes[n].id})
		return err
	})
	s.expect("ControllerUnpublishVolume", what, got, codes.OK)
	if got.code == codes.OK {
		v.attach[n] = nil
	}
	return got.code == codes.OK
}

func (s *stress) nodeStage(rng *rand.Rand, v *stressVol) bool {
	n := rng.IntN(len(s.nodes))
	v.nodeMu[n].Lock()
	defer v.nodeMu[n].Unlock()
	pubCtx := map[string]string{driver.PublishContextReadOnly: "false"}
	want := codes.FailedPrecondition
	if a := v.attach[n]; a != nil {
		pubCtx, want = a.pubCtx, codes.OK
		// A read-only node cannot put the first filesystem on a volume.
		if !v.block && !v.staged[n] && a.ro && !v.formatted.Load() {
			want = codes.FailedPrecondition
		}
	}
	what := fmt.Sprintf("%s on %s", v.name, s.nodes[n].name)
	got := s.callMaybeTwice(rng.IntN(5) == 0, false, "NodeStageVolume", what, func(ctx context.Context) error {
		_, err := s.nodes[n].nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: s.stagingPath(n, v),
			VolumeCapability: v.capability(), PublishContext: pubCtx, VolumeContext: v.volCtx})
		return err
	})
	s.expect("NodeStageVolume", what, got, want)
	if got.code == codes.OK {
		v.staged[n] = true
		v.stagedRO[n] = pubCtx[driver.PublishContextReadOnly] == "true" || readOnlyMode(v.mode)
		if !v.stagedRO[n] {
			v.formatted.Store(true)
		}
	}
	return got.code == codes.OK
}

func (s *stress) nodeUnstage(rng *rand.Rand, v *stressVol) bool {
	n := rng.IntN(len(s.nodes))
	v.nodeMu[n].Lock()
	defer v.nodeMu[n].Unlock()
	want := codes.OK
	if len(v.targets[n]) > 0 {
		want = codes.FailedPrecondition
	}
	what := fmt.Sprintf("%s on %s", v.name, s.nodes[n].name)
	got := s.callMaybeTwice(rng.IntN(5) == 0, false, "NodeUnstageVolume", what, func(ctx context.Context) error {
		_, err := s.nodes[n].nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: s.stagingPath(n, v)})
		return err
	})
	s.expect("NodeUnstageVolume", what, got, want)
	if got.code == codes.OK {
		v.staged[n], v.stagedRO[n] = false, false
	}
	return got.code == codes.OK
}

// nodePublish publishes v at one target path of a node, or at two at once
// (two pods starting together).
func (s *stress) nodePublish(rng *rand.Rand, v *stressVol) bool {
	n := rng.IntN(len(s.nodes))
	slots := []string{s.slots[rng.IntN(len(s.slots))]}
	if rng.IntN(3) == 0 {
		if o := s.slots[rng.IntN(len(s.slots))]; o != slots[0] {
			slots = append(slots, o)
		}
	}
	v.nodeMu[n].Lock()
	defer v.nodeMu[n].Unlock()
	pubCtx := map[string]string{driver.PublishContextReadOnly: "false"}
	attRO := false
	if a := v.attach[n]; a != nil {
		pubCtx, attRO = a.pubCtx, a.ro
	}
	type outcome struct {
		code  codes.Code
		pod   int
		reqRO bool
	}
	out := make([]outcome, len(slots))
	var wg sync.WaitGroup
	for i, slot := range slots {
		pod, ro := rng.IntN(stressPods), rng.IntN(2) == 0
		twice := len(slots) == 1 && rng.IntN(5) == 0
		target := s.targetPath(n, v, slot)
		want := codes.OK
		switch held, ok := v.targets[n][target]; {
		case !v.staged[n]:
			want = codes.FailedPrecondition
		case ok && held.pod == pod && held.reqRO == ro:
		case ok:
			want = codes.AlreadyExists
		case len(v.targets[n]) > 0 && singleTarget(v.mode):
			want = codes.FailedPrecondition
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			what := fmt.Sprintf("%s on %s at %s for pod-%d readonly=%t", v.name, s.nodes[n].name, slot, pod, ro)
			got := s.callMaybeTwice(twice, len(slots) > 1, "NodePublishVolume", what, func(ctx context.Context) error {
				_, err := s.nodes[n].nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id,
					StagingTargetPath: s.stagingPath(n, v), TargetPath: target, VolumeCapability: v.capability(),
					Readonly: ro, PublishContext: pubCtx, VolumeContext: stressPodContext(v.volCtx, pod)})
				return err
			})
			if len(slots) == 1 {
				s.expect("NodePublishVolume", what, got, want)
			}
			out[i] = outcome{code: got.code, pod: pod, reqRO: ro}
		}()
	}
	wg.Wait()
	changed := false
	for i, slot := range slots {
		if out[i].code == codes.OK {
			v.targets[n][s.targetPath(n, v, slot)] = stressTarget{pod: out[i].pod, reqRO: out[i].reqRO,
				ro: out[i].reqRO || attRO || readOnlyMode(v.mode)}
			changed = true
		}
	}
	return changed
}

func (s *stress) nodeUnpublish(rng *rand.Rand, v *stressVol) bool {
	n := rng.IntN(len(s.nodes))
	target := s.targetPath(n, v, s.slots[rng.IntN(len(s.slots))])
	v.nodeMu[n].Lock()
	defer v.nodeMu[n].Unlock()
	what := fmt.Sprintf("%s on %s at %s", v.name, s.nodes[n].name, target)
	got := s.callMaybeTwice(rng.IntN(5) == 0, false, "NodeUnpublishVolume", what, func(ctx context.Context) error {
		_, err := s.nodes[n].nc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: target})
		return err
	})
	s.expect("NodeUnpublishVolume", what, got, codes.OK)
	if got.code == codes.OK {
		delete(v.targets[n], target)
	}
	return got.code == codes.OK
}

// stressMount is one mount of a volume found in /proc/self/mountinfo.
type stressMount struct {
	node    int
	staging bool
	path    string
	ro      bool   // the mount's own options say ro
	loop    string // loopN behind it
}

func readSys(p string) string {
	b, _ := os.ReadFile(p)
	return strings.TrimSpace(string(b))
}

func loopBacking(loop string) string {
	return strings.TrimSuffix(readSys("/sys/block/"+loop+"/loop/backing_file"), " (deleted)")
}

func loopReadOnly(loop string) bool { return readSys("/sys/block/"+loop+"/ro") == "1" }

// loopsOf lists the loop devices backed by image.
func loopsOf(image string) []string {
	matches, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, m := range matches {
		if strings.TrimSuffix(readSys(m), " (deleted)") == image {
			out = append(out, filepath.Base(filepath.Dir(filepath.Dir(m))))
		}
	}
	return out
}

// mountsOf finds v's staging and target mounts on every node and the loop
// device behind each: for a filesystem, the device the mount is of; for a
// raw block target, the device node bind-mounted there (mountinfo shows
// it as devtmpfs, with the node's name as the mount's root).
func (s *stress) mountsOf(infos []*mountinfo.Info, v *stressVol) []stressMount {
	var out []stressMount
	for _, mi := range infos {
		rel, err := filepath.Rel(s.kubelet, mi.Mountpoint)
		if err != nil {
			continue
		}
		parts := strings.Split(rel, "/")
		if parts[len(parts)-1] != v.name {
			continue
		}
		m := stressMount{node: -1, path: mi.Mountpoint, staging: len(parts) == 3 && parts[1] == "staging"}
		for i, n := range s.nodes {
			if parts[0] == n.name {
				m.node = i
			}
		}
		m.ro = slices.Contains(strings.Split(mi.Options, ","), "ro")
		if mi.FSType == "devtmpfs" {
			m.loop = filepath.Base(mi.Root)
		} else if link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", mi.Major, mi.Minor)); err == nil {
			m.loop = filepath.Base(link)
		}
		out = append(out, m)
	}
	return out
}

// check compares v's real state (its metadata in the pool, the mount
// table, the loop devices) with the model and with the invariants of its
// access mode. It holds all of v's locks, so nothing about v changes
// while it looks.
func (s *stress) check(v *stressVol) {
	defer v.lockAll()()
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(s.kubelet))
	if err != nil {
		s.violate("reading mountinfo", "%v", err)
		return
	}
	mounts := s.mountsOf(infos, v)
	var meta backend.Volume
	if b, err := os.ReadFile(v.meta); err != nil {
		s.violate("reading volume metadata", "%s: %v", v.name, err)
		return
	} else if err := json.Unmarshal(b, &meta); err != nil {
		s.violate("reading volume metadata", "%s: %v", v.name, err)
		return
	}

	// The controller's record of attachments is what the model says.
	recorded := map[string]bool{}
	rwAttached := 0
	for _, a := range meta.Attachments {
		recorded[a.Node.String()] = a.ReadOnly
		if !a.ReadOnly {
			rwAttached++
		}
	}
	nAttached := 0
	for n, a := range v.attach {
		ro, ok := recorded[s.nodes[n].id]
		switch {
		case a == nil && ok:
			s.violate("attachment the model lacks", "%s: recorded as attached to %s", v.name, s.nodes[n].name)
		case a != nil && !ok:
			s.violate("attachment missing", "%s: ControllerPublish to %s succeeded, the record lacks it", v.name, s.nodes[n].name)
		case a != nil && ro != a.ro:
			s.violate("attachment readonly", "%s on %s: recorded readonly=%t, want %t", v.name, s.nodes[n].name, ro, a.ro)
		}
		if a != nil {
			nAttached++
		}
	}
	if len(recorded) > nAttached {
		s.violate("attachment the model lacks", "%s: %d attachments recorded, %d expected", v.name, len(recorded), nAttached)
	}
	s.passed("attachments recorded as published", 1)

	// Every mount is of this volume's image, where the model has it, and
	// read-only wherever the model says read-only.
	stagedAt := map[int]bool{}
	targetsAt := map[string]bool{}
	nodesHolding := map[int]bool{}
	rwNodes := map[int]bool{}
	for _, m := range mounts {
		if m.node < 0 {
			s.violate("mount on an unknown node", "%s at %s", v.name, m.path)
			continue
		}
		nodesHolding[m.node] = true
		if b := loopBacking(m.loop); m.loop == "" || b != v.image {
			s.violate("mount of another image", "%s at %s: %s is backed by %q", v.name, m.path, m.loop, b)
			continue
		}
		loopRO := loopReadOnly(m.loop)
		if !loopRO {
			rwNodes[m.node] = true
		}
		if m.staging {
			stagedAt[m.node] = true
			if v.block {
				s.violate("raw block volume mounted at its staging path", "%s at %s", v.name, m.path)
			} else if !v.staged[m.node] {
				s.violate("staging mount the model lacks", "%s at %s", v.name, m.path)
			} else if v.stagedRO[m.node] && (!m.ro || !loopRO) {
				s.violate("writable stage of a read-only attachment", "%s at %s: mount ro=%t, %s ro=%t", v.name, m.path, m.ro, m.loop, loopRO)
			}
			continue
		}
		targetsAt[m.path] = true
		want, ok := v.targets[m.node][m.path]
		if !ok {
			s.violate("target mount the model lacks", "%s at %s", v.name, m.path)
			continue
		}
		if !want.ro {
			continue
		}
		// A read-only bind mount stops writes through a filesystem, but
		// not through a device node: the kernel checks a mount's
		// read-only flag for the files on it, never for a block or
		// character device opened there. (Nor does open(O_WRONLY) of a
		// read-only loop device fail: writes to it do.) So for raw block
		// the read-only bit of the loop device itself is what keeps a
		// workload from writing, and is what is checked.
		if !m.ro {
			s.violate("writable mount for a read-only publish", "%s at %s (%s)", v.name, m.path, m.loop)
		}
		if v.block && !loopRO {
			s.violate("writable device for a read-only raw block publish",
				"%s at %s: the bind mount is ro, which the kernel ignores for a device node, and %s is read/write (/sys/block/%s/ro = 0); attachment readonly=%t, publish readonly=%t",
				v.name, m.path, m.loop, m.loop, v.attach[m.node] != nil && v.attach[m.node].ro, want.reqRO)
		}
		s.passed("read-only publish is read-only", 1)
	}
	pods := map[int]bool{}
	nTargets := 0
	nStaged := 0
	for n := range s.nodes {
		if v.staged[n] {
			nStaged++
			if !v.block && !stagedAt[n] {
				s.violate("staging mount missing", "%s on %s: NodeStageVolume succeeded, nothing mounted", v.name, s.nodes[n].name)
			}
		}
		for p, tgt := range v.targets[n] {
			nTargets++
			pods[tgt.pod] = true
			if !targetsAt[p] {
				s.violate("target mount missing", "%s at %s: NodePublishVolume succeeded, nothing mounted", v.name, p)
			}
		}
	}
	s.passed("mounts are where the model has them", 1)
	loops := loopsOf(v.image)
	if len(loops) < nStaged {
		s.violate("loop device missing", "%s: staged on %d nodes, %d loop devices", v.name, nStaged, len(loops))
	}

	if singleNode(v.mode) {
		if len(meta.Attachments) > 1 || len(nodesHolding) > 1 || nStaged > 1 {
			s.violate("two nodes hold a single-node volume", "%s (%s): attached to %d nodes, mounted on %d, staged on %d",
				v.name, v.mode, len(meta.Attachments), len(nodesHolding), nStaged)
		}
		s.passed("single-node volume on one node", 1)
	}
	if singleTarget(v.mode) {
		if len(targetsAt) > 1 || nTargets > 1 {
			s.violate("two target paths hold a single-target volume", "%s (%s): %d target mounts, %d published", v.name, v.mode, len(targetsAt), nTargets)
		}
		s.passed("single-target volume at one target", 1)
	}
	if v.mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		if len(pods) > 1 {
			s.violate("two workloads hold an RWOP volume", "%s: held by pods %v", v.name, pods)
		}
		s.passed("RWOP volume held by one workload", 1)
	}
	if w := writerNodes(v.mode); w < len(s.nodes) {
		if rwAttached > w || len(rwNodes) > w {
			s.violate("more writer nodes than the mode allows", "%s (%s): %d read/write attachments, read/write devices on %d nodes",
				v.name, v.mode, rwAttached, len(rwNodes))
		}
		s.passed("writer nodes within the mode", 1)
	}
	if readOnlyMode(v.mode) {
		for _, m := range mounts {
			if !m.ro {
				s.violate("writable mount of a read-only volume", "%s at %s", v.name, m.path)
			}
		}
		for _, l := range loops {
			if !loopReadOnly(l) {
				s.violate("read/write loop device of a read-only volume", "%s: %s", v.name, l)
			}
		}
		s.passed("read-only volume read-only everywhere", 1)
	}
}

func stressDuration(t *testing.T) time.Duration {
	if v := os.Getenv("MODEGUARD_STRESS_SECONDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("MODEGUARD_STRESS_SECONDS=%q: want a positive number of seconds", v)
		}
		return time.Duration(n) * time.Second
	}
	return 60 * time.Second
}

// TestStressInvariants drives one controller and three node plugins with
// many concurrent callers making random attach, stage and publish calls
// (and their undoing) on volumes of every access mode, and checks all the
// while, from the mount table, the loop devices and the pool's records,
// that the access modes hold: one node for SINGLE_NODE_*, one workload for
// RWOP, nothing writable for a read-only publish. Now and then a workload
// writes and fsyncs, the volume is snapshotted and restored, and no
// restore may miss that acknowledged write. Every answer must be a
// code the spec allows for the call, and the one the test's model of what
// succeeded predicts. At the end everything is undone and nothing is left.
func TestStressInvariants(t *testing.T) {
	// Its own processes, directories and networks: it runs beside the
	// other tests, most of which mostly wait (grace periods, leases).
	t.Parallel()
	testenv.RequireRoot(t)
	dur := stressDuration(t)
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	// zone-a's pool has reflinks (snapshots of volumes in use are clones),
	// zone-b's has not (they are refused while a node may write).
	pools := map[string]string{"zone-a": filepath.Join(testenv.ReflinkXFS(t, 4<<30), "pool-a"), "zone-b": filepath.Join(work, "pool-b")}
	s := &stress{t: t, work: work, kubelet: filepath.Join(work, "kubelet"), slots: []string{"t0", "t1", "t2"},
		calls: map[string]map[codes.Code]int{}, checks: map[string]int{}, violations: map[string][]string{}, nviol: map[string]int{}}
	for _, d := range []string{pools["zone-a"], pools["zone-b"], s.kubelet} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	s.ctrl = &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", "--block-pool=zone-a=" + pools["zone-a"], "--block-pool-filesystem=direct", "--block-pool=zone-b=" + pools["zone-b"]}}
	for _, n := range []struct{ name, zone string }{{"node-a1", "zone-a"}, {"node-a2", "zone-a"}, {"node-b1", "zone-b"}} {
		s.nodes = append(s.nodes, &stressNode{name: n.name, zone: n.zone, proc: &crashProc{t: t, name: n.name, bin: bin,
			socket: filepath.Join(work, n.name+".sock"), log: filepath.Join(work, n.name+".log"),
			args: []string{"--roles", "node", "--node-id", n.name, "--zone", n.zone, "--block-pool=" + n.zone + "=" + pools[n.zone], "--block-pool-filesystem=direct",
				"--state-dir", filepath.Join(work, "state-"+n.name)}}})
	}
	procs := []*crashProc{s.ctrl}
	for _, n := range s.nodes {
		procs = append(procs, n.proc)
	}
	t.Cleanup(func() {
		for _, p := range procs {
			p.stop()
		}
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			for _, p := range procs {
				t.Logf("%s log (end):\n%s", p.name, logTail(p.log, 40))
			}
		}
	})
	for _, p := range procs {
		p.start()
	}
	s.cc = csi.NewControllerClient(s.ctrl.conn)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, n := range s.nodes {
		n.nc = csi.NewNodeClient(n.proc.conn)
		info, err := n.nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		n.id = info.GetNodeId()
	}

	for _, spec := range []struct {
		name   string
		mode   csiMode
		block  bool
		fsType string
		zone   string
	}{
		{"snw-mount", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false, "ext4", "zone-a"},
		{"rwop-mount", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, false, "ext4", "zone-a"},
		{"snmw-mount", csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, false, "ext4", "zone-a"},
		{"rox-mount", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, false, "ext4", "zone-a"},
		{"rwx-block", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, true, "", "zone-a"},
		{"mnsw-block", csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER, true, "", "zone-a"},
		{"rwop-block", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, true, "", "zone-a"},
		{"snmw-mount-b", csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, false, "ext4", "zone-b"},
	} {
		v := &stressVol{name: spec.name, mode: spec.mode, block: spec.block, fsType: spec.fsType, zone: spec.zone, pool: pools[spec.zone], size: 32 << 20,
			nodeMu: make([]sync.Mutex, len(s.nodes)), attach: make([]*stressAttach, len(s.nodes)),
			staged: make([]bool, len(s.nodes)), stagedRO: make([]bool, len(s.nodes)), targets: make([]map[string]stressTarget, len(s.nodes))}
		if v.block {
			v.size = 16 << 20
		}
		for n := range v.targets {
			v.targets[n] = map[string]stressTarget{}
		}
		v.formatted.Store(v.formattedAtCreate())
		r, err := s.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "stress-" + v.name, CapacityRange: &csi.CapacityRange{RequiredBytes: v.size},
			VolumeCapabilities:        []*csi.VolumeCapability{v.capability()},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{driver.TopologyZoneKey: v.zone}}}}})
		if err != nil {
			t.Fatalf("creating %s: %v", v.name, err)
		}
		v.id, v.volCtx = r.GetVolume().GetVolumeId(), r.GetVolume().GetVolumeContext()
		id, err := volumeid.Parse(v.id)
		if err != nil {
			t.Fatal(err)
		}
		v.image = filepath.Join(v.pool, "volumes", id.FileName()+".img")
		v.meta = filepath.Join(v.pool, "volumes", id.FileName()+".json")
		s.vols = append(s.vols, v)
	}

	// The load: callers on random volumes, nodes and target paths, and a
	// checker going round the volumes.
	deadline := time.Now().Add(dur)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var ops atomic.Int64
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(w)))
			for time.Now().Before(deadline) {
				v := s.vols[rng.IntN(len(s.vols))]
				var changed bool
				switch p := rng.IntN(100); {
				case p < 15:
					changed = s.controllerPublish(rng, v)
				case p < 25:
					changed = s.controllerUnpublish(rng, v)
				case p < 45:
					changed = s.nodeStage(rng, v)
				case p < 60:
					changed = s.nodeUnstage(rng, v)
				case p < 83:
					changed = s.nodePublish(rng, v)
				case p < 86:
					changed = s.snapshotRestore(v, v.zone == "zone-a")
				default:
					changed = s.nodeUnpublish(rng, v)
				}
				ops.Add(1)
				if changed {
					s.check(v)
				}
			}
		}()
	}
	checkerDone := make(chan struct{})
	go func() {
		defer close(checkerDone)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			s.check(s.vols[i%len(s.vols)])
		}
	}()
	wg.Wait()
	close(stop)
	<-checkerDone
	for _, v := range s.vols {
		s.check(v)
	}
	t.Logf("%d operations in %v on %d volumes, 3 nodes, 16 callers", ops.Load(), dur, len(s.vols))
	s.report()

	// Unwind as a CO would, and every step must succeed.
	for _, v := range s.vols {
		for n := range s.nodes {
			for _, slot := range s.slots {
				target := s.targetPath(n, v, slot)
				mustCSI(t, "NodeUnpublishVolume "+target, func(ctx context.Context) error {
					_, err := s.nodes[n].nc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: target})
					return err
				})
			}
			mustCSI(t, "NodeUnstageVolume "+v.name+" on "+s.nodes[n].name, func(ctx context.Context) error {
				_, err := s.nodes[n].nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: s.stagingPath(n, v)})
				return err
			})
			mustCSI(t, "ControllerUnpublishVolume "+v.name+" from "+s.nodes[n].name, func(ctx context.Context) error {
				_, err := s.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: s.nodes[n].id})
				return err
			})
		}
		mustCSI(t, "DeleteVolume "+v.name, func(ctx context.Context) error {
			_, err := s.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id})
			return err
		})
	}
	for _, p := range procs {
		p.stop()
	}
	dirs := []string{pools["zone-a"], pools["zone-b"]}
	for _, n := range s.nodes {
		dirs = append(dirs, filepath.Join(work, "state-"+n.name))
	}
	assertNothingLeft(t, work, dirs)
}

// report logs what was done and fails the test for every kind of broken
// invariant or wrong answer seen.
func (s *stress) report() {
	s.mu.Lock()
	defer s.mu.Unlock()
	var names []string
	for n := range s.calls {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		total := 0
		var byCode []string
		for c, k := range s.calls[n] {
			total += k
			byCode = append(byCode, fmt.Sprintf("%v %d", c, k))
		}
		sort.Strings(byCode)
		fmt.Fprintf(&b, "\n  %-26s %6d: %s", n, total, strings.Join(byCode, ", "))
	}
	s.t.Logf("calls by code:%s", b.String())
	b.Reset()
	var kinds []string
	for k := range s.checks {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(&b, "\n  %-40s %6d", k, s.checks[k])
	}
	s.t.Logf("invariant checks made:%s", b.String())
	kinds = kinds[:0]
	for k := range s.violations {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		s.t.Errorf("%s: %d times, e.g.:\n    %s", k, s.nviol[k], strings.Join(s.violations[k], "\n    "))
	}
}

func mustCSI(t *testing.T, what string, f func(ctx context.Context) error) {
	t.Helper()
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := f(ctx)
		cancel()
		if err == nil {
			return
		}
		if status.Code(err) == codes.Aborted && attempt < 20 {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		t.Errorf("%s: %v", what, err)
		return
	}
}

// filesUnder lists the regular files (and anything else not a directory)
// below dir, relative to it, but those the driver keeps there for good.
func filesUnder(dir string) []string {
	var files []string
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(dir, p)
		// The controller lock stays with the pool, as its directories do:
		// removing a lock file that another process may have open would
		// let two processes hold "the" lock on two different files. So
		// do the pool's marker, which says whose pool it is, and the
		// filesystem templates new volumes are copied from, the
		// controller's cache.
		kept := rel == controllerlock.FileName || rel == block.PoolMarkerFile || block.IsTemplateFile(rel)
		if !kept {
			files = append(files, rel)
		}
		return nil
	})
	return files
}

// settledLoops waits out the moment the kernel takes to unbind a loop
// device whose detach was requested while its last user was going away.
func settledLoops(work string, want int) []string {
	loops := localcluster.LoopsUnder(work)
	for end := time.Now().Add(3 * time.Second); len(loops) > want && time.Now().Before(end); loops = localcluster.LoopsUnder(work) {
		time.Sleep(100 * time.Millisecond)
	}
	return loops
}

func assertNothingLeft(t *testing.T, work string, dirs []string) {
	t.Helper()
	if loops := settledLoops(work, 0); len(loops) > 0 {
		t.Errorf("loop devices left: %v", loops)
	}
	if mounts := localcluster.MountsUnder(work); len(mounts) > 0 {
		t.Errorf("mounts left: %v", mounts)
	}
	for _, d := range dirs {
		if files := filesUnder(d); len(files) > 0 {
			t.Errorf("files left in %s: %v", strings.TrimPrefix(d, work+"/"), files)
		}
	}
}

func logTail(path string, lines int) string {
	all := strings.Split(strings.TrimRight(testenv.ReadFile(path), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// goroutines reads go_goroutines from a process's metrics. Keep-alives
// are off so that the scrape leaves no connection (and no goroutine
// serving it) behind in the process measured.
func goroutines(addr string) (int, error) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_goroutines "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return int(f), err
		}
	}
	return 0, errors.Join(sc.Err(), errors.New("no go_goroutines in the metrics"))
}

func openFDs(pid int) int {
	entries, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(entries)
}

type leakSample struct {
	fds, goroutines map[string]int
	loops, mounts   []string
	files           map[string][]string
}

// TestThousandLifecyclesLeakNothing runs a raw block volume through its
// whole life (create, attach, stage, publish and back, delete) a thousand
// times through one controller and one node plugin, and then finds the
// processes and the machine as they were: the same open files, about the
// same goroutines, no loop device, mount or file left over.
func TestThousandLifecyclesLeakNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("a thousand lifecycles: skipped in -short mode")
	}
	testenv.RequireRoot(t)
	lifecycles := 1000
	if v := os.Getenv("MODEGUARD_LIFECYCLES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("MODEGUARD_LIFECYCLES=%q: want a positive number", v)
		}
		lifecycles = n
	}
	bin := testenv.BuildBinary(t)
	work := t.TempDir()
	pool, state, kubelet := filepath.Join(work, "pool"), filepath.Join(work, "node-state"), filepath.Join(work, "kubelet")
	for _, d := range []string{pool, state, kubelet} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	poolArg := "--block-pool=zone-a=" + pool
	metrics := map[string]string{
		"controller": fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)),
		"node":       fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)),
	}
	ctrl := &crashProc{t: t, name: "controller", bin: bin, socket: filepath.Join(work, "c.sock"), log: filepath.Join(work, "controller.log"),
		args: []string{"--roles", "controller", poolArg, "--block-pool-filesystem=direct", "--metrics-address=" + metrics["controller"]}}
	node := &crashProc{t: t, name: "node", bin: bin, socket: filepath.Join(work, "n.sock"), log: filepath.Join(work, "node.log"),
		args: []string{"--roles", "node", "--node-id", "life-node", "--zone", "zone-a", poolArg, "--block-pool-filesystem=direct", "--state-dir", state,
			"--metrics-address=" + metrics["node"]}}
	ctrl.start()
	node.start()
	t.Cleanup(func() {
		ctrl.stop()
		node.stop()
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			t.Logf("controller log (end):\n%s\nnode log (end):\n%s", logTail(ctrl.log, 40), logTail(node.log, 40))
		}
	})
	cc, nc := csi.NewControllerClient(ctrl.conn), csi.NewNodeClient(node.conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	info, err := nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	blockCap := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	}
	staging := filepath.Join(kubelet, "staging")
	target := filepath.Join(kubelet, "pods", "pod", "dev")
	lifecycle := func(i int) {
		step := func(what string, err error) {
			if err != nil {
				t.Fatalf("lifecycle %d: %s: %v", i, what, err)
			}
		}
		vol, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("life-%d", i),
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}, VolumeCapabilities: []*csi.VolumeCapability{blockCap}})
		step("CreateVolume", err)
		id := vol.GetVolume().GetVolumeId()
		pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId(), VolumeCapability: blockCap})
		step("ControllerPublishVolume", err)
		_, err = nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: blockCap,
			PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolume().GetVolumeContext()})
		step("NodeStageVolume", err)
		_, err = nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
			VolumeCapability: blockCap, PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolume().GetVolumeContext()})
		step("NodePublishVolume", err)
		_, err = nc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		step("NodeUnpublishVolume", err)
		_, err = nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		step("NodeUnstageVolume", err)
		_, err = cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: info.GetNodeId()})
		step("ControllerUnpublishVolume", err)
		_, err = cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		step("DeleteVolume", err)
	}
	procs := map[string]*crashProc{"controller": ctrl, "node": node}
	sample := func(base *leakSample) *leakSample {
		s := &leakSample{fds: map[string]int{}, goroutines: map[string]int{}, files: map[string][]string{}}
		want := 0
		if base != nil {
			want = len(base.loops)
		}
		s.loops = settledLoops(work, want)
		s.mounts = localcluster.MountsUnder(work)
		for _, d := range []string{pool, state, kubelet} {
			s.files[filepath.Base(d)] = filesUnder(d)
		}
		for name, p := range procs {
			// A connection or file being closed as the last call
			// returns may still be open for a moment.
			s.fds[name] = openFDs(p.cmd.Process.Pid)
			for end := time.Now().Add(2 * time.Second); base != nil && s.fds[name] > base.fds[name] && time.Now().Before(end); {
				time.Sleep(50 * time.Millisecond)
				s.fds[name] = openFDs(p.cmd.Process.Pid)
			}
			g, err := goroutines(metrics[name])
			if err != nil {
				t.Fatalf("%s metrics: %v", name, err)
			}
			s.goroutines[name] = g
		}
		return s
	}

	for i := range 20 {
		lifecycle(i)
	}
	base := sample(nil)
	start := time.Now()
	for i := 20; i < 20+lifecycles; i++ {
		lifecycle(i)
	}
	elapsed := time.Since(start)
	after := sample(base)
	t.Logf("%d lifecycles in %v (%v each)", lifecycles, elapsed.Round(time.Millisecond), (elapsed / time.Duration(lifecycles)).Round(10*time.Microsecond))
	for _, name := range []string{"controller", "node"} {
		t.Logf("%s: open fds %d -> %d, goroutines %d -> %d", name, base.fds[name], after.fds[name], base.goroutines[name], after.goroutines[name])
		if after.fds[name] != base.fds[name] {
			t.Errorf("%s: %d open file descriptors after %d lifecycles, %d before", name, after.fds[name], lifecycles, base.fds[name])
		}
		// A few goroutines come and go with no leak: gRPC's transport
		// and the HTTP server start some per connection or timer, and
		// the runtime's own may be parked or not at the instant of a
		// scrape. A leak of one per lifecycle would show as hundreds.
		if after.goroutines[name] > base.goroutines[name]+5 {
			t.Errorf("%s: %d goroutines after %d lifecycles, %d before", name, after.goroutines[name], lifecycles, base.goroutines[name])
		}
	}
	t.Logf("machine: loop devices %d -> %d, mounts %d -> %d, files in pool %d -> %d, in node state %d -> %d, in kubelet %d -> %d",
		len(base.loops), len(after.loops), len(base.mounts), len(after.mounts), len(base.files["pool"]), len(after.files["pool"]),
		len(base.files["node-state"]), len(after.files["node-state"]), len(base.files["kubelet"]), len(after.files["kubelet"]))
	if !slices.Equal(base.loops, after.loops) {
		t.Errorf("loop devices: %v before, %v after", base.loops, after.loops)
	}
	if !slices.Equal(base.mounts, after.mounts) {
		t.Errorf("mounts: %v before, %v after", base.mounts, after.mounts)
	}
	for d, files := range after.files {
		if !slices.Equal(base.files[d], files) {
			t.Errorf("files in %s: %v before, %v after", d, base.files[d], files)
		}
	}
}

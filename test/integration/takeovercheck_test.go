package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/nfs/imagestore"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// The exactly-once check of the take-over tests: what the targets store,
// read from their pools once every process has stopped, against the
// ledger of the stream. Never against what the controllers answered about
// the state: a controller that lost track would agree with itself.

// targetState is what the storage targets hold.
type targetState struct {
	volumes   []*backend.Volume
	snapshots []*backend.Snapshot
	// fences is each target's stored fence list, by zone.
	fences map[string]storedFenceList
	// halfDone are files no finished step leaves behind: temporary files,
	// an image without its record, a record without its image.
	halfDone []string
}

type storedFenceList struct {
	version uint64
	cidrs   []string
}

func newTargetState() *targetState { return &targetState{fences: map[string]storedFenceList{}} }

// readBlockPools adds to st what the block pools (zone: directory) of
// stopped targets hold. The files are looked at before the pools are
// opened: opening a pool removes what a crash left behind.
func (st *targetState) readBlockPools(ctx context.Context, pools map[string]string) error {
	for _, zone := range slices.Sorted(maps.Keys(pools)) {
		dir := pools[zone]
		half, err := halfDoneIn(dir)
		if err != nil {
			return err
		}
		st.halfDone = append(st.halfDone, half...)
		if st.fences[zone], err = readFenceList(dir); err != nil {
			return err
		}
	}
	ctrl, err := block.NewController(pools)
	if err != nil {
		return err
	}
	volumes, err := ctrl.ListVolumes(ctx)
	if err != nil {
		return err
	}
	snapshots, err := ctrl.ListSnapshots(ctx)
	if err != nil {
		return err
	}
	st.volumes, st.snapshots = append(st.volumes, volumes...), append(st.snapshots, snapshots...)
	return nil
}

// readFenceList reads the fence list a target keeps in its state
// directory; none is version 0, nothing fenced.
func readFenceList(stateDir string) (storedFenceList, error) {
	var rec struct {
		Version uint64 `json:"version"`
		Fences  []struct {
			CIDR string `json:"cidr"`
		} `json:"fences"`
	}
	path := filepath.Join(stateDir, ".modeguard-fences.json")
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return storedFenceList{}, nil
	}
	if err != nil {
		return storedFenceList{}, err
	}
	if err := json.Unmarshal(data, &rec); err != nil {
		return storedFenceList{}, fmt.Errorf("%s: %w", path, err)
	}
	list := storedFenceList{version: rec.Version}
	for _, f := range rec.Fences {
		list.cidrs = append(list.cidrs, f.CIDR)
	}
	return list, nil
}

// readNFSTarget adds to st what an NFS target holds: its records, its
// fence list (under "nfs"), and as half done what its records do not
// account for. The target runs (with the quota storage its records are on
// the pool filesystem it mounts), but no controller acts, so nothing
// changes them. exportRoot is its --nfs-export-root, exportDir where it
// writes the export files ganesha includes.
func (st *targetState) readNFSTarget(exportRoot, exportDir string) error {
	var err error
	if st.fences["nfs"], err = readFenceList(exportRoot); err != nil {
		return err
	}
	// The quota storage keeps everything on the xfs it mounts; the images
	// storage an image per object in the export root, mounted on a
	// directory of the same name as a quota one.
	root, images := filepath.Join(exportRoot, projquota.MountDirName), ""
	if _, err := os.Stat(filepath.Join(exportRoot, imagestore.ImagesDirName)); err == nil {
		root, images = exportRoot, filepath.Join(exportRoot, imagestore.ImagesDirName)
	}
	// What the records account for: a directory per record (quota) or an
	// image (images), and an export file per volume some node is served.
	accounted := map[string]bool{}
	var volumes []*backend.Volume
	records := func(kind string, read func(data []byte, stem string) error) error {
		entries, err := os.ReadDir(filepath.Join(root, "meta", kind))
		if err != nil {
			return err
		}
		for _, e := range entries {
			stem, ok := strings.CutSuffix(e.Name(), ".json")
			if !ok || strings.Contains(e.Name(), ".tmp-") {
				continue // temporary names are found below
			}
			data, err := os.ReadFile(filepath.Join(root, "meta", kind, e.Name()))
			if err != nil {
				return err
			}
			if err := read(data, stem); err != nil {
				return fmt.Errorf("%s record %s: %w", kind, e.Name(), err)
			}
			if images == "" {
				accounted[filepath.Join(kind, stem)] = true
			} else {
				accounted[filepath.Join("images", kind+"__"+stem+".img")] = true
			}
		}
		return nil
	}
	err = records("volumes", func(data []byte, stem string) error {
		var rec struct {
			Volume   backend.Volume `json:"volume"`
			Deleting bool           `json:"deleting"`
		}
		if err := json.Unmarshal(data, &rec); err != nil {
			return err
		}
		if rec.Deleting {
			st.halfDone = append(st.halfDone, fmt.Sprintf("NFS volume %s is marked deleting", rec.Volume.ID))
			return nil
		}
		volumes = append(volumes, &rec.Volume)
		if len(accessmode.Served(rec.Volume.Attachments)) > 0 {
			accounted[filepath.Join("exports", stem+".conf")] = true
		}
		return nil
	})
	if err != nil {
		return err
	}
	err = records("snapshots", func(data []byte, stem string) error {
		var rec struct {
			Snapshot backend.Snapshot `json:"snapshot"`
			Deleting bool             `json:"deleting"`
		}
		if err := json.Unmarshal(data, &rec); err != nil {
			return err
		}
		if rec.Deleting {
			st.halfDone = append(st.halfDone, fmt.Sprintf("NFS snapshot %s is marked deleting", rec.Snapshot.ID))
			return nil
		}
		st.snapshots = append(st.snapshots, &rec.Snapshot)
		return nil
	})
	if err != nil {
		return err
	}
	st.volumes = append(st.volumes, volumes...)
	found := map[string]bool{}
	dirs := []struct{ rel, path string }{{"exports", exportDir}}
	if images == "" {
		dirs = append(dirs, struct{ rel, path string }{"volumes", filepath.Join(root, "volumes")},
			struct{ rel, path string }{"snapshots", filepath.Join(root, "snapshots")})
	} else {
		// A mount point is made with its image and removed after it.
		dirs = append(dirs, struct{ rel, path string }{"images", images})
	}
	for _, dir := range dirs {
		entries, err := os.ReadDir(dir.path)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		for _, e := range entries {
			rel := filepath.Join(dir.rel, e.Name())
			found[rel] = true
			if !accounted[rel] {
				st.halfDone = append(st.halfDone, "NFS "+rel+" belongs to no record of a volume it serves")
			}
		}
	}
	for _, rel := range slices.Sorted(maps.Keys(accounted)) {
		if !found[rel] {
			st.halfDone = append(st.halfDone, "NFS "+rel+" is missing, though a record needs it")
		}
	}
	return filepath.WalkDir(filepath.Join(root, "meta"), func(path string, d fs.DirEntry, err error) error {
		if err == nil && strings.Contains(d.Name(), ".tmp-") {
			st.halfDone = append(st.halfDone, "NFS "+path)
		}
		return err
	})
}

// halfDoneIn lists the files of a pool that only a step stopped half way
// leaves: temporary names, and images and records without their other
// half (the block backend renames the complete image into place before it
// writes the record, and removes the record first).
func halfDoneIn(dir string) ([]string, error) {
	var half []string
	halves := map[string][]string{} // path without suffix: suffixes found
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		name := d.Name()
		switch {
		case strings.Contains(name, ".tmp-") || strings.Contains(name, ".replay"):
			half = append(half, rel)
		case d.IsDir():
		case strings.HasPrefix(rel, "volumes/") || strings.HasPrefix(rel, "snapshots/"):
			ext := filepath.Ext(name)
			if ext == ".img" || ext == ".json" {
				stem := strings.TrimSuffix(rel, ext)
				halves[stem] = append(halves[stem], ext)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, stem := range slices.Sorted(maps.Keys(halves)) {
		if got := halves[stem]; len(got) != 2 {
			half = append(half, fmt.Sprintf("%s has only its %s", filepath.Join(filepath.Base(dir), stem), got[0]))
		}
	}
	return half, nil
}

// possible is what the ledger allows one fact to be: exactly true or
// false after an acknowledged call, either after a call that did not
// answer OK, which may have taken effect before its answer was lost.
type possible struct{ yes, no bool }

func exactly(b bool) possible { return possible{yes: b, no: !b} }

// or is p, or b in case the unacknowledged call took effect.
func (p possible) or(b bool) possible {
	if b {
		p.yes = true
	} else {
		p.no = true
	}
	return p
}

func (p possible) allows(b bool) bool { return (b && p.yes) || (!b && p.no) }

// volumeExpectation is what the ledger says of one volume.
type volumeExpectation struct {
	name, zone string
	id         string // as its create answered; empty when not acknowledged
	exists     possible
	attached   map[string]possible // by node key; a node absent: never attached
}

type snapshotExpectation struct {
	name, id, source string
	exists           possible
}

// expectations are what the ledger says the targets must hold.
type expectations struct {
	volumes   map[string]*volumeExpectation // by name
	snapshots map[string]*snapshotExpectation
	fenced    possible // streamFenceCIDR
	// fenceChanges counts the acknowledged calls known to have changed
	// the list: each stored a new version.
	fenceChanges int
}

// expect replays the ledger, in the order of the calls. Each volume's
// calls are one worker's, one at a time, so their order is the order
// they took effect in; so are the fencer's.
func expect(calls []*ledgerCall) *expectations {
	e := &expectations{volumes: map[string]*volumeExpectation{}, snapshots: map[string]*snapshotExpectation{}, fenced: exactly(false)}
	byID := map[string]*volumeExpectation{}
	// done is what an acknowledged call makes b, and what an
	// unacknowledged one may have made it; a refusal changes nothing.
	done := func(c *ledgerCall, before possible, b bool) possible {
		switch {
		case c.acknowledged():
			return exactly(b)
		case c.refusedAsExpected():
			return before
		default:
			return before.or(b)
		}
	}
	for _, c := range calls {
		switch c.kind {
		case callCreate:
			v := &volumeExpectation{name: c.name, zone: c.zone, attached: map[string]possible{}, exists: done(c, exactly(false), true)}
			if c.acknowledged() {
				v.id = c.volumeID
				byID[v.id] = v
			}
			e.volumes[c.name] = v
		case callPublish, callPublishHeld, callUnpublish:
			v := byID[c.volumeID]
			if v == nil {
				continue // the stream acts only on volumes it knows
			}
			before, ok := v.attached[c.node]
			if !ok {
				before = exactly(false)
			}
			v.attached[c.node] = done(c, before, c.kind != callUnpublish)
		case callDelete:
			v := byID[c.volumeID]
			if v == nil {
				continue
			}
			v.exists = done(c, v.exists, false)
		case callSnapshot:
			s := &snapshotExpectation{name: c.name, source: c.volumeID, exists: done(c, exactly(false), true)}
			if c.acknowledged() {
				s.id = c.snapshotID
			}
			e.snapshots[c.name] = s
		case callFence, callUnfence:
			want := c.kind == callFence
			if c.acknowledged() && e.fenced == exactly(!want) {
				e.fenceChanges++
			}
			e.fenced = done(c, e.fenced, want)
		}
	}
	return e
}

// callProblems are calls of the ledger that ended without the answer the
// stream expects of controllers that take over: every call acknowledged,
// but for publishes to a second node, refused as FAILED_PRECONDITION.
func callProblems(calls []*ledgerCall) []string {
	var out []string
	for _, c := range calls {
		switch {
		case !c.answered:
			last := c.attempts[len(c.attempts)-1]
			out = append(out, fmt.Sprintf("%s had no final answer after %v; its last attempt: %s %s", c, c.end.Sub(c.start).Round(100*time.Millisecond), last.code, last.message))
		case c.kind == callPublishHeld && c.code == codes.OK:
			out = append(out, fmt.Sprintf("%s was granted, though another node holds the single-node volume", c))
		case c.kind == callPublishHeld && c.code != codes.FailedPrecondition:
			out = append(out, fmt.Sprintf("%s answered %s, want FAILED_PRECONDITION: %s", c, c.code, c.message))
		case c.kind != callPublishHeld && c.code != codes.OK:
			out = append(out, fmt.Sprintf("%s answered %s: %s", c, c.code, c.message))
		}
	}
	return out
}

// stateProblems holds what the targets store against the ledger: exact
// where the ledger knows (acknowledged calls and expected refusals),
// either outcome where a call ended without either.
func stateProblems(calls []*ledgerCall, st *targetState) []string {
	var out []string
	complain := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	e := expect(calls)

	volumesByName := map[string][]*backend.Volume{}
	for _, v := range st.volumes {
		volumesByName[v.Name] = append(volumesByName[v.Name], v)
	}
	for _, name := range slices.Sorted(maps.Keys(volumesByName)) {
		vols := volumesByName[name]
		if len(vols) > 1 {
			var ids []string
			for _, v := range vols {
				ids = append(ids, v.ID)
			}
			complain("volume name %q is %d volumes: %v", name, len(vols), ids)
		}
		if e.volumes[name] == nil {
			complain("volume %s has the name %q, which no call asked for", vols[0].ID, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(e.volumes)) {
		want := e.volumes[name]
		vols := volumesByName[name]
		if !want.exists.allows(len(vols) > 0) {
			if len(vols) > 0 {
				complain("volume %q (%s) exists, though its DeleteVolume was acknowledged", name, vols[0].ID)
			} else {
				complain("volume %q is missing, though its CreateVolume was acknowledged (as %s) and no DeleteVolume was", name, want.id)
			}
		}
		if len(vols) == 0 {
			continue
		}
		got := vols[0]
		if want.id != "" && got.ID != want.id {
			complain("volume %q is %s, but its CreateVolume answered %s", name, got.ID, want.id)
		}
		if got.Zone != want.zone {
			complain("volume %q is in zone %q, asked for in %q", name, got.Zone, want.zone)
		}
		if got.CapacityBytes < streamVolumeBytes {
			complain("volume %q holds %d bytes, asked for %d", name, got.CapacityBytes, streamVolumeBytes)
		}
		held := map[string]int{}
		for _, a := range got.Attachments {
			held[a.Node.Name]++
		}
		// Every volume of the stream is single-node.
		if len(held) > 1 {
			complain("single-node volume %q is attached to %d nodes: %v", name, len(held), slices.Sorted(maps.Keys(held)))
		}
		nodes := slices.Sorted(maps.Keys(held))
		for node := range want.attached {
			if held[node] == 0 {
				nodes = append(nodes, node)
			}
		}
		for _, node := range nodes {
			if held[node] > 1 {
				complain("volume %q is attached to %s %d times", name, node, held[node])
			}
			allowed, asked := want.attached[node]
			if !asked {
				allowed = exactly(false)
			}
			if !allowed.allows(held[node] > 0) {
				if held[node] > 0 {
					complain("volume %q is attached to %s, though the last acknowledged call for that node detached it, or none attached it", name, node)
				} else {
					complain("volume %q is not attached to %s, though the last acknowledged call for that node attached it", name, node)
				}
			}
		}
	}

	snapsByName := map[string][]*backend.Snapshot{}
	for _, s := range st.snapshots {
		snapsByName[s.Name] = append(snapsByName[s.Name], s)
	}
	for _, name := range slices.Sorted(maps.Keys(snapsByName)) {
		if n := len(snapsByName[name]); n > 1 {
			complain("snapshot name %q is %d snapshots", name, n)
		}
		if e.snapshots[name] == nil {
			complain("snapshot %s has the name %q, which no call asked for", snapsByName[name][0].ID, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(e.snapshots)) {
		want := e.snapshots[name]
		snaps := snapsByName[name]
		if !want.exists.allows(len(snaps) > 0) {
			complain("snapshot %q is missing, though its CreateSnapshot was acknowledged (as %s)", name, want.id)
		}
		if len(snaps) == 0 {
			continue
		}
		if want.id != "" && snaps[0].ID != want.id {
			complain("snapshot %q is %s, but its CreateSnapshot answered %s", name, snaps[0].ID, want.id)
		}
		if snaps[0].SourceVolumeID != want.source {
			complain("snapshot %q is of %s, asked of %s", name, snaps[0].SourceVolumeID, want.source)
		}
	}

	versions := map[uint64][]string{}
	for _, zone := range slices.Sorted(maps.Keys(st.fences)) {
		list := st.fences[zone]
		versions[list.version] = append(versions[list.version], zone)
		fenced := slices.Contains(list.cidrs, streamFenceCIDR)
		if !e.fenced.allows(fenced) {
			complain("the target of %s holds the fence list %v (version %d), but the last acknowledged call %s %s",
				zone, list.cidrs, list.version, map[bool]string{true: "lifted", false: "fenced"}[fenced], streamFenceCIDR)
		}
		if extra := slices.DeleteFunc(slices.Clone(list.cidrs), func(c string) bool { return c == streamFenceCIDR }); len(extra) > 0 {
			complain("the target of %s fences %v, which no call asked for", zone, extra)
		}
		if list.version < uint64(e.fenceChanges) {
			complain("the target of %s holds the fence list at version %d, below the %d changes acknowledged", zone, list.version, e.fenceChanges)
		}
	}
	if len(versions) > 1 {
		complain("the targets hold the fence list at different versions: %v", versions)
	}
	for _, f := range st.halfDone {
		complain("a target holds what no finished step leaves: %s", f)
	}
	return out
}

// TestTakeoverCheckerFindsWhatIsWrong: the exactly-once checker of the
// take-over tests passes a state that matches its ledger, accepts either
// outcome of a call that ended without an acknowledgement, and fails each
// kind of wrong state a take-over could leave.
func TestTakeoverCheckerFindsWhatIsWrong(t *testing.T) {
	const (
		kept, gone, unsure = "block:zone-a:vol-kept", "block:zone-b:vol-gone", "block:zone-a:vol-unsure"
		snap               = "block:zone-a:snap-one"
	)
	node := func(n int) nodeid.Node { return streamNodeID("zone-a", n) }
	ack := func(c *ledgerCall) *ledgerCall {
		c.answered, c.code = true, codes.OK
		return c
	}
	// The base ledger: kept created, published to node 1, a second node
	// refused, snapshotted; gone created and deleted; the fence set;
	// unsure's publish to node 2 never answered.
	ledger := func() []*ledgerCall {
		calls := []*ledgerCall{
			ack(&ledgerCall{kind: callCreate, name: "kept", zone: "zone-a", volumeID: kept}),
			ack(&ledgerCall{kind: callPublish, volumeID: kept, node: node(1).Name}),
			{kind: callPublishHeld, volumeID: kept, node: node(2).Name, answered: true, code: codes.FailedPrecondition},
			ack(&ledgerCall{kind: callSnapshot, name: "one", volumeID: kept, snapshotID: snap}),
			ack(&ledgerCall{kind: callCreate, name: "gone", zone: "zone-b", volumeID: gone}),
			ack(&ledgerCall{kind: callDelete, volumeID: gone}),
			ack(&ledgerCall{kind: callFence, cidr: streamFenceCIDR}),
			ack(&ledgerCall{kind: callCreate, name: "unsure", zone: "zone-a", volumeID: unsure}),
			{kind: callPublish, volumeID: unsure, node: node(2).Name, attempts: []attempt{{code: codes.Unavailable}}},
		}
		for i, c := range calls {
			c.seq = i + 1
		}
		return calls
	}
	attachedTo := func(n int) []accessmode.Attachment {
		return []accessmode.Attachment{{Node: node(n), Mode: accessmode.SingleNodeWriter}}
	}
	state := func() *targetState {
		return &targetState{
			volumes: []*backend.Volume{
				{ID: kept, Name: "kept", Zone: "zone-a", CapacityBytes: streamVolumeBytes, Attachments: attachedTo(1)},
				{ID: unsure, Name: "unsure", Zone: "zone-a", CapacityBytes: streamVolumeBytes},
			},
			snapshots: []*backend.Snapshot{{ID: snap, Name: "one", SourceVolumeID: kept}},
			fences: map[string]storedFenceList{
				"zone-a": {version: 1, cidrs: []string{streamFenceCIDR}},
				"zone-b": {version: 1, cidrs: []string{streamFenceCIDR}},
			},
		}
	}
	volume := func(st *targetState, name string) *backend.Volume {
		for _, v := range st.volumes {
			if v.Name == name {
				return v
			}
		}
		t.Fatalf("no volume %q in the base state", name)
		return nil
	}
	for _, tc := range []struct {
		name   string
		ledger func([]*ledgerCall) []*ledgerCall
		state  func(*targetState)
		want   string // in a problem; empty: none
	}{
		{name: "matching", want: ""},
		{name: "the unanswered publish took effect", state: func(st *targetState) { volume(st, "unsure").Attachments = attachedTo(2) }, want: ""},
		{name: "an unanswered create did nothing", want: "",
			ledger: func(calls []*ledgerCall) []*ledgerCall {
				return append(calls, &ledgerCall{seq: 100, kind: callCreate, name: "maybe", zone: "zone-b", attempts: []attempt{{code: codes.DeadlineExceeded}}})
			}},
		{name: "an unanswered create took effect", want: "",
			ledger: func(calls []*ledgerCall) []*ledgerCall {
				return append(calls, &ledgerCall{seq: 100, kind: callCreate, name: "maybe", zone: "zone-b", attempts: []attempt{{code: codes.DeadlineExceeded}}})
			},
			state: func(st *targetState) {
				st.volumes = append(st.volumes, &backend.Volume{ID: "block:zone-b:vol-maybe", Name: "maybe", Zone: "zone-b", CapacityBytes: streamVolumeBytes})
			}},
		{name: "an acknowledged create is lost", state: func(st *targetState) { st.volumes = st.volumes[1:] }, want: `volume "kept" is missing`},
		{name: "a create done twice", want: `volume name "kept" is 2 volumes`,
			state: func(st *targetState) {
				st.volumes = append(st.volumes, &backend.Volume{ID: "block:zone-b:vol-kept", Name: "kept", Zone: "zone-b", CapacityBytes: streamVolumeBytes})
			}},
		{name: "another id than answered", state: func(st *targetState) { volume(st, "kept").ID = "block:zone-a:vol-other" }, want: "but its CreateVolume answered"},
		{name: "a deleted volume is back", want: "though its DeleteVolume was acknowledged",
			state: func(st *targetState) {
				st.volumes = append(st.volumes, &backend.Volume{ID: gone, Name: "gone", Zone: "zone-b", CapacityBytes: streamVolumeBytes})
			}},
		{name: "a volume nobody asked for", want: "which no call asked for",
			state: func(st *targetState) {
				st.volumes = append(st.volumes, &backend.Volume{ID: "block:zone-a:vol-stray", Name: "stray", Zone: "zone-a", CapacityBytes: streamVolumeBytes})
			}},
		{name: "an attachment lost", state: func(st *targetState) { volume(st, "kept").Attachments = nil }, want: "is not attached to node-1-zone-a"},
		{name: "the refused publish took effect", want: "attached to 2 nodes",
			state: func(st *targetState) {
				volume(st, "kept").Attachments = append(attachedTo(1), attachedTo(2)...)
			}},
		{name: "an attachment recorded twice", want: "attached to node-1-zone-a 2 times",
			state: func(st *targetState) {
				volume(st, "kept").Attachments = append(attachedTo(1), attachedTo(1)...)
			}},
		{name: "an acknowledged unpublish undone", want: "is attached to node-1-zone-a, though",
			ledger: func(calls []*ledgerCall) []*ledgerCall {
				return append(calls, ack(&ledgerCall{seq: 100, kind: callUnpublish, volumeID: kept, node: node(1).Name}))
			}},
		{name: "a snapshot lost", state: func(st *targetState) { st.snapshots = nil }, want: `snapshot "one" is missing`},
		{name: "a snapshot taken twice", want: `snapshot name "one" is 2 snapshots`,
			state: func(st *targetState) {
				st.snapshots = append(st.snapshots, &backend.Snapshot{ID: "block:zone-b:snap-one", Name: "one", SourceVolumeID: kept})
			}},
		{name: "a target behind on the fence list", want: "different versions",
			state: func(st *targetState) {
				st.fences["zone-b"] = storedFenceList{version: 2, cidrs: []string{streamFenceCIDR}}
			}},
		{name: "an acknowledged fence lost", want: "the last acknowledged call fenced",
			state: func(st *targetState) {
				st.fences = map[string]storedFenceList{"zone-a": {version: 2}, "zone-b": {version: 2}}
			}},
		{name: "half done", state: func(st *targetState) { st.halfDone = []string{"volumes/.x.tmp-1"} }, want: "no finished step leaves"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls, st := ledger(), state()
			if tc.ledger != nil {
				calls = tc.ledger(calls)
			}
			if tc.state != nil {
				tc.state(st)
			}
			problems := stateProblems(calls, st)
			if tc.want == "" {
				if len(problems) > 0 {
					t.Errorf("problems in a state the ledger allows: %q", problems)
				}
				return
			}
			if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, tc.want) }) {
				t.Errorf("problems %q; want one saying %q", problems, tc.want)
			}
		})
	}
	// The ledger's own: the unanswered publish is a stuck call; a
	// granted publish to a second node breaks the rules.
	calls := ledger()
	calls[2].code = codes.OK
	problems := callProblems(calls)
	for _, want := range []string{"had no final answer", "was granted, though another node holds"} {
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, want) }) {
			t.Errorf("call problems %q; want one saying %q", problems, want)
		}
	}
}

// TestTakeoverCheckerFindsHalfDoneFiles: the scans of a block pool and of
// an NFS target find temporary files and objects their records do not
// account for, and pass complete ones.
func TestTakeoverCheckerFindsHalfDoneFiles(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"volumes/a.img", "volumes/a.json", "volumes/b.img", "snapshots/.c.img.tmp-123", "templates/ext4-1-v1.img"} {
		if err := os.MkdirAll(filepath.Join(dir, filepath.Dir(f)), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	half, err := halfDoneIn(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"snapshots/.c.img.tmp-123", filepath.Join(filepath.Base(dir), "volumes/b") + " has only its .img"}
	if !slices.Equal(half, want) {
		t.Errorf("half done: %q, want %q", half, want)
	}

	// An NFS target with the quota storage: a published volume with its
	// directory but no export file, a directory without a record, a
	// record marked deleting.
	root, exports := t.TempDir(), t.TempDir()
	pool := filepath.Join(root, projquota.MountDirName)
	published, _ := json.Marshal(map[string]any{"volume": backend.Volume{ID: "nfs::vol-p", Name: "p",
		Attachments: []accessmode.Attachment{{Node: streamNodeID("zone-a", 1), Mode: accessmode.SingleNodeWriter}}}})
	deleting, _ := json.Marshal(map[string]any{"volume": backend.Volume{ID: "nfs::vol-d", Name: "d"}, "deleting": true})
	for path, data := range map[string][]byte{
		"meta/volumes/nfs__vol-p.json": published, "meta/volumes/nfs__vol-d.json": deleting,
		"volumes/nfs__vol-p/.keep": nil, "volumes/nfs__vol-d/.keep": nil, "volumes/nfs__vol-stray/.keep": nil,
		"meta/snapshots/.x.json.tmp-1": nil,
	} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(pool, path)), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pool, path), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	st := newTargetState()
	if err := st.readNFSTarget(root, exports); err != nil {
		t.Fatal(err)
	}
	if len(st.volumes) != 1 || st.volumes[0].ID != "nfs::vol-p" {
		t.Errorf("NFS volumes read: %v, want nfs::vol-p only", st.volumes)
	}
	for _, want := range []string{"nfs::vol-d is marked deleting", "volumes/nfs__vol-stray belongs to no record", "exports/nfs__vol-p.conf is missing", ".x.json.tmp-1"} {
		if !slices.ContainsFunc(st.halfDone, func(h string) bool { return strings.Contains(h, want) }) {
			t.Errorf("NFS half done: %q; want one saying %q", st.halfDone, want)
		}
	}
	if len(st.halfDone) != 4 {
		t.Errorf("NFS half done: %q; want 4 findings", st.halfDone)
	}
}

// TestTakeoverActedBackKnowsCallsUnderWay: of what a controller back from
// a fault logs it did, only the calls under way at the fault pass.
func TestTakeoverActedBackKnowsCallsUnderWay(t *testing.T) {
	faultAt := time.Now()
	struck := faultAt.Add(time.Second)
	during := []attempt{{start: faultAt.Add(-time.Second), end: faultAt.Add(5 * time.Second)}}
	after := []attempt{{start: struck.Add(time.Second), end: struck.Add(2 * time.Second)}}
	ledger := []*ledgerCall{
		{kind: callCreate, name: "under-way", attempts: during},
		{kind: callCreate, name: "sent-after", attempts: after},
		{kind: callPublish, volumeID: "block:zone-a:vol-1", node: "node-1-zone-a", attempts: during},
		{kind: callFence, cidr: streamFenceCIDR, attempts: after},
	}
	log := strings.Join([]string{
		`I0101 00:00:00.000000       1 create.go:422] "Volume created" volumeID="block:zone-a:vol-2" name="under-way" zone="zone-a"`,
		`I0101 00:00:00.000000       1 create.go:422] "Volume created" volumeID="block:zone-a:vol-3" name="sent-after" zone="zone-a"`,
		`I0101 00:00:00.000000       1 attach.go:108] "Volume published to node" volumeID="block:zone-a:vol-1" node="node-1-zone-a@zone-a"`,
		`I0101 00:00:00.000000       1 fence.go:343] "Network fence recorded" cidrs="10.78.0.0/24" err=null`,
		`I0101 00:00:00.000000       1 election.go:580] "Stepping down as the acting controller" why="..."`,
	}, "\n")
	got := actedBack(log, ledger, faultAt, struck)
	if len(got) != 2 || !strings.Contains(got[0], "sent-after") || !strings.Contains(got[1], "Network fence recorded") {
		t.Errorf("acted back: %q; want the create and the fence sent after the fault", got)
	}
}

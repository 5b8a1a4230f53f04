// Package backendtest is the contract of package backend as tests: what
// every backend.Controller and backend.Node must do alike, whatever holds
// its volumes. The suites run against every real backend (block, the
// zoned join of block controllers, the remote client of one, NFS with a
// real ganesha) and against the in-memory backend, so that the memory
// backend the driver's tests use behaves as the real ones do, and a real
// one that drifts from the others is caught. Where backends differ by
// design (NFS has no zones and serves filesystems only), the backend under
// test declares it in Properties.
package backendtest

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// The properties of the two real backends, as their contract tests and
// the in-memory backend standing in for them declare them.
var (
	BlockProperties = Properties{Zoned: true, AccessType: accessmode.Block, Mutable: map[string]string{backend.AttrReadAheadKiB: "512"}}
	NFSProperties   = Properties{AccessType: accessmode.Mount, Mutable: map[string]string{backend.AttrRootSquash: "false"}}
)

// Properties are what a backend under test declares where backends
// legitimately differ.
type Properties struct {
	// Zoned says the backend places volumes in zones (Zones is not nil);
	// a zoneless one's volumes have the zone "" and it has one pool.
	Zoned bool
	// AccessType is what the suite's volumes are created as: one the
	// backend serves (NFS: mount only). The block backend takes block, so
	// that no filesystem is made.
	AccessType accessmode.AccessType
	// Mutable is a change of mutable parameters the backend takes (its
	// own attribute, see the Attr keys).
	Mutable map[string]string
	// VolumeSize is the size of the suite's volumes; 16 MiB, or the
	// backend's MinimumSize if that is larger, when zero.
	VolumeSize int64
}

// NodeIDs are the nodes the suites attach volumes to: distinct keys, and
// an address each, which the NFS backend puts in the export.
var NodeIDs = []nodeid.Node{nodeid.MustParse("contract-1@zone-a@10.99.250.11"), nodeid.MustParse("contract-2@zone-a@10.99.250.12")}

// contract is one backend under test.
type contract struct {
	c     backend.Controller
	props Properties
	size  int64
}

// RunControllerContract runs the controller's contract against the
// controller newController makes, once for the whole suite: each subtest
// creates what it needs under names of its own and removes it, and
// measures what it compares (capacity, commitments) before and after.
func RunControllerContract(t *testing.T, props Properties, newController func(t *testing.T) backend.Controller) {
	k := &contract{c: newController(t), props: props}
	k.size = props.VolumeSize
	if k.size == 0 {
		k.size = max(16<<20, k.c.MinimumSize())
	}
	runAll(t, []subtest{
		{"ZonesAndPools", k.zonesAndPools},
		{"ZonesKeepToThemselves", k.zonesKeepToThemselves},
		{"CreateThenVolume", k.createThenVolume},
		{"CreateExistingIsAlreadyExists", k.createExisting},
		{"AbsentVolume", k.absentVolume},
		{"DeleteVolume", k.deleteVolume},
		{"ListVolumesSorted", k.listVolumesSorted},
		{"ReturnedVolumesAreCopies", k.returnedVolumesAreCopies},
		{"Attachments", k.attachments},
		{"ExpandVolume", k.expandVolume},
		{"Capacity", k.capacity},
		{"ModifyVolume", k.modifyVolume},
		{"Health", k.health},
		{"SnapshotAndRestore", k.snapshotAndRestore},
		{"RestoreOnlyWhereFillable", k.restoreOnlyWhereFillable},
		{"AbsentSnapshot", k.absentSnapshot},
		{"ListSnapshotsSorted", k.listSnapshotsSorted},
		{"DeleteVolumeKeepsSnapshots", k.deleteVolumeKeepsSnapshots},
	})
}

type subtest struct {
	name string
	run  func(t *testing.T)
}

func runAll(t *testing.T, tests []subtest) {
	for _, tc := range tests {
		t.Run(tc.name, tc.run)
	}
}

// callTimeout bounds each call: generous, a real backend copies and
// formats.
const callTimeout = 2 * time.Minute

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), callTimeout)
	t.Cleanup(cancel)
	return c
}

// zones is where the suite places volumes: every zone, or "" when the
// backend has none.
func (k *contract) zones() []string {
	if z := k.c.Zones(); len(z) > 0 {
		return z
	}
	return []string{""}
}

// id is the id of the suite's object name in zone.
func (k *contract) id(t *testing.T, zone string, kind volumeid.Kind, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(k.c.Backend(), zone, kind, volumeid.KeyFor("contract", kind, t.Name()+"/"+name))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func (k *contract) spec(t *testing.T, zone, name string) backend.VolumeSpec {
	return backend.VolumeSpec{
		ID: k.id(t, zone, volumeid.Volume, name), Name: name, CapacityBytes: k.size,
		AccessType: k.props.AccessType, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter},
		Parameters: map[string]string{"contract": name},
	}
}

// create creates a volume and removes it when the test ends.
func (k *contract) create(t *testing.T, spec backend.VolumeSpec) *backend.Volume {
	t.Helper()
	v, err := k.c.CreateVolume(ctx(t), spec)
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", spec.Name, err)
	}
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		if err := k.c.DeleteVolume(c, spec.ID); err != nil {
			t.Errorf("cleanup: DeleteVolume %s: %v", spec.Name, err)
		}
	})
	return v
}

// snapshot cuts a snapshot, waits until it is ready to use and removes it
// when the test ends.
func (k *contract) snapshot(t *testing.T, source volumeid.ID, name string) *backend.Snapshot {
	t.Helper()
	id := k.id(t, source.Zone, volumeid.Snapshot, name)
	s, err := k.c.CreateSnapshot(ctx(t), id, name, source)
	if err != nil {
		t.Fatalf("CreateSnapshot %s: %v", name, err)
	}
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		if err := k.c.DeleteSnapshot(c, id); err != nil {
			t.Errorf("cleanup: DeleteSnapshot %s: %v", name, err)
		}
	})
	// A byte copy may go on after the call (Cutting): the snapshot
	// exists, and is ready once the copy is done.
	for deadline := time.Now().Add(callTimeout); s.Cutting; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s still not ready to use after %v", name, callTimeout)
		}
		if s, err = k.c.Snapshot(ctx(t), id); err != nil {
			t.Fatalf("Snapshot %s while it was cut: %v", name, err)
		}
	}
	return s
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("%s: got %v (%v), want %v", what, got, err, want)
	}
}

func must[T any](t *testing.T, what string) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return v
	}
}

// sameVolume compares what a backend must keep of a volume: what it was
// created with, and what it was told since.
func sameVolume(t *testing.T, what string, got, want *backend.Volume) {
	t.Helper()
	switch {
	case got.ID != want.ID, got.Name != want.Name, got.CapacityBytes != want.CapacityBytes, got.Zone != want.Zone,
		got.AccessType != want.AccessType, !slices.Equal(got.Modes, want.Modes),
		!maps.Equal(got.Parameters, want.Parameters), !maps.Equal(got.MutableParameters, want.MutableParameters),
		!sameSource(got.Source, want.Source), !slices.Equal(got.Attachments, want.Attachments):
		t.Fatalf("%s:\n got %+v\nwant %+v", what, got, want)
	}
}

func sameSource(a, b *backend.Source) bool {
	empty := backend.Source{}
	if a == nil {
		a = &empty
	}
	if b == nil {
		b = &empty
	}
	return *a == *b
}

func volumeIDs(list []*backend.Volume) []string {
	out := make([]string, len(list))
	for i, v := range list {
		out[i] = v.ID
	}
	return out
}

func snapshotIDs(list []*backend.Snapshot) []string {
	out := make([]string, len(list))
	for i, s := range list {
		out[i] = s.ID
	}
	return out
}

// wantSortedWith checks that ids are sorted and hold every one of want.
func wantSortedWith(t *testing.T, what string, ids []string, want ...string) {
	t.Helper()
	if !slices.IsSorted(ids) {
		t.Fatalf("%s is not sorted by id: %v", what, ids)
	}
	for _, id := range want {
		if !slices.Contains(ids, id) {
			t.Fatalf("%s lacks %s: %v", what, id, ids)
		}
	}
}

func (k *contract) zonesAndPools(t *testing.T) {
	zones := k.c.Zones()
	if k.props.Zoned != (zones != nil) {
		t.Fatalf("Zones = %v; the backend is declared zoned=%t", zones, k.props.Zoned)
	}
	pools := must[[]backend.PoolStats](t, "Pools")(k.c.Pools(ctx(t)))
	got := make([]string, len(pools))
	for i, p := range pools {
		got[i] = p.Zone
		if p.SizeBytes <= 0 || p.FreeBytes < 0 || p.FreeBytes > p.SizeBytes || p.CommittedBytes < 0 {
			t.Errorf("pool %q reports size %d, free %d, committed %d", p.Zone, p.SizeBytes, p.FreeBytes, p.CommittedBytes)
		}
	}
	if !slices.Equal(got, k.zones()) {
		t.Fatalf("Pools are of zones %q, want the order of Zones: %q", got, k.zones())
	}
	for _, zone := range k.zones() {
		if spare := must[int64](t, "Capacity")(k.c.Capacity(ctx(t), zone)); spare < 4*k.size {
			t.Fatalf("Capacity(%q) = %d; the suite needs room for a few volumes of %d bytes", zone, spare, k.size)
		}
	}
	_, err := k.c.Capacity(ctx(t), "no-such-zone")
	wantCode(t, "Capacity of a zone without a pool", err, codes.InvalidArgument)
}

// zonesKeepToThemselves: a zoned backend's volume takes room in its own
// zone's pool only, and its snapshots live there too. A zoneless one has
// one pool, of zone "", for every volume.
func (k *contract) zonesKeepToThemselves(t *testing.T) {
	zones := k.zones()
	if !k.props.Zoned {
		if len(zones) != 1 || zones[0] != "" {
			t.Fatalf("a zoneless backend places volumes in zones %q", zones)
		}
		must[int64](t, "Capacity of zone \"\"")(k.c.Capacity(ctx(t), ""))
		return
	}
	if len(zones) < 2 {
		t.Fatalf("the suite needs a zoned backend of two zones at least; it has %q", zones)
	}
	home, other := zones[0], zones[1]
	// Committed bytes, not capacity: two zones' pools may share one
	// filesystem (as in these tests), whose free space every record in
	// either takes a little of.
	committed := k.committed(t, other)
	spec := k.spec(t, home, "at-home")
	k.create(t, spec)
	if now := k.committed(t, other); now != committed {
		t.Fatalf("a volume in zone %s changed the committed bytes of zone %s from %d to %d", home, other, committed, now)
	}
	away := k.id(t, other, volumeid.Snapshot, "away")
	_, err := k.c.CreateSnapshot(ctx(t), away, "away", spec.ID)
	wantCode(t, "CreateSnapshot in another zone than its source's", err, codes.InvalidArgument)
}

func (k *contract) createThenVolume(t *testing.T) {
	for _, zone := range k.zones() {
		spec := k.spec(t, zone, "v-"+zone)
		spec.MutableParameters = maps.Clone(k.props.Mutable)
		v := k.create(t, spec)
		want := &backend.Volume{ID: spec.ID.String(), Name: spec.Name, CapacityBytes: spec.CapacityBytes, Zone: zone,
			AccessType: spec.AccessType, Modes: spec.Modes, Parameters: spec.Parameters, MutableParameters: spec.MutableParameters}
		sameVolume(t, "CreateVolume's answer", v, want)
		if v.CreatedAt.IsZero() {
			t.Fatal("CreateVolume's answer has no creation time")
		}
		sameVolume(t, "Volume after CreateVolume", must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)), want)
		list := must[[]*backend.Volume](t, "ListVolumes")(k.c.ListVolumes(ctx(t)))
		wantSortedWith(t, "ListVolumes", volumeIDs(list), v.ID)
	}
}

// createExisting: the caller makes sure no volume of the id exists (see
// VolumeSpec), so a second creation is a bug to refuse, whatever its
// parameters, and the volume there stays as it was.
func (k *contract) createExisting(t *testing.T) {
	spec := k.spec(t, k.zones()[0], "twice")
	v := k.create(t, spec)
	again := spec
	again.CapacityBytes = 2 * spec.CapacityBytes
	for what, s := range map[string]backend.VolumeSpec{"the same spec": spec, "a larger size": again} {
		_, err := k.c.CreateVolume(ctx(t), s)
		wantCode(t, "CreateVolume of an existing id with "+what, err, codes.AlreadyExists)
	}
	sameVolume(t, "the volume after the refused creations", must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)), v)
}

func (k *contract) absentVolume(t *testing.T) {
	id := k.id(t, k.zones()[0], volumeid.Volume, "absent")
	_, err := k.c.Volume(ctx(t), id)
	wantCode(t, "Volume", err, codes.NotFound)
	_, err = k.c.SetAttachments(ctx(t), id, []accessmode.Attachment{{Node: NodeIDs[0], Mode: accessmode.SingleNodeWriter}})
	wantCode(t, "SetAttachments", err, codes.NotFound)
	_, err = k.c.ExpandVolume(ctx(t), id, 2*k.size)
	wantCode(t, "ExpandVolume", err, codes.NotFound)
	_, err = k.c.ModifyVolume(ctx(t), id, nil)
	wantCode(t, "ModifyVolume", err, codes.NotFound)
	_, err = k.c.VolumeHealth(ctx(t), id)
	wantCode(t, "VolumeHealth", err, codes.NotFound)
	_, err = k.c.CreateSnapshot(ctx(t), k.id(t, id.Zone, volumeid.Snapshot, "of-absent"), "of-absent", id)
	wantCode(t, "CreateSnapshot of an absent volume", err, codes.NotFound)
	spec := k.spec(t, id.Zone, "from-absent")
	spec.Source = &backend.Source{VolumeID: id.String()}
	_, err = k.c.CreateVolume(ctx(t), spec)
	wantCode(t, "CreateVolume from an absent volume", err, codes.NotFound)
	spec.Source = &backend.Source{SnapshotID: k.id(t, id.Zone, volumeid.Snapshot, "absent").String()}
	_, err = k.c.CreateVolume(ctx(t), spec)
	wantCode(t, "CreateVolume from an absent snapshot", err, codes.NotFound)
	for range 2 {
		if err := k.c.DeleteVolume(ctx(t), id); err != nil {
			t.Fatalf("DeleteVolume of an absent volume: %v", err)
		}
	}
	if on := must[[]*backend.Volume](t, "VolumesOn")(k.c.VolumesOn(ctx(t), "never-attached")); len(on) != 0 {
		t.Fatalf("VolumesOn a node nothing was attached to: %v", volumeIDs(on))
	}
}

func (k *contract) committed(t *testing.T, zone string) int64 {
	t.Helper()
	for _, p := range must[[]backend.PoolStats](t, "Pools")(k.c.Pools(ctx(t))) {
		if p.Zone == zone {
			return p.CommittedBytes
		}
	}
	t.Fatalf("Pools has no pool of zone %q", zone)
	return 0
}

func (k *contract) deleteVolume(t *testing.T) {
	zone := k.zones()[0]
	before := k.committed(t, zone)
	spec := k.spec(t, zone, "deleted")
	k.create(t, spec)
	if err := k.c.DeleteVolume(ctx(t), spec.ID); err != nil {
		t.Fatalf("DeleteVolume: %v", err)
	}
	_, err := k.c.Volume(ctx(t), spec.ID)
	wantCode(t, "Volume after DeleteVolume", err, codes.NotFound)
	if ids := volumeIDs(must[[]*backend.Volume](t, "ListVolumes")(k.c.ListVolumes(ctx(t)))); slices.Contains(ids, spec.ID.String()) {
		t.Fatalf("ListVolumes after DeleteVolume still has it: %v", ids)
	}
	if after := k.committed(t, zone); after != before {
		t.Fatalf("committed bytes were %d before the volume, %d after its deletion", before, after)
	}
	if err := k.c.DeleteVolume(ctx(t), spec.ID); err != nil {
		t.Fatalf("DeleteVolume again: %v", err)
	}
	// The id can be used again.
	k.create(t, spec)
}

// returnedVolumesAreCopies: what a caller does with a volume it was given
// (the driver fills in answers from it) never reaches the record.
func (k *contract) returnedVolumesAreCopies(t *testing.T) {
	spec := k.spec(t, k.zones()[0], "copies")
	k.create(t, spec)
	att := []accessmode.Attachment{{Node: NodeIDs[0], Mode: accessmode.MultiNodeMultiWriter}}
	// Cloned at once: the answer may be the record's own.
	recorded := must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), spec.ID, att)).Clone()
	scribble := func(v *backend.Volume) {
		v.Modes[0] = accessmode.SingleNodeReaderOnly
		v.Parameters["contract"] = "scribbled"
		v.Attachments[0].ReadOnly = true
	}
	scribble(must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)))
	for _, v := range must[[]*backend.Volume](t, "ListVolumes")(k.c.ListVolumes(ctx(t))) {
		if v.ID == recorded.ID {
			scribble(v)
		}
	}
	for _, v := range must[[]*backend.Volume](t, "VolumesOn")(k.c.VolumesOn(ctx(t), NodeIDs[0].Name)) {
		if v.ID == recorded.ID {
			scribble(v)
		}
	}
	sameVolume(t, "the volume after its copies were changed", must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)), recorded)
	must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), spec.ID, nil))
}

func (k *contract) listVolumesSorted(t *testing.T) {
	var want []string
	for _, zone := range k.zones() {
		for _, name := range []string{"c", "a", "d", "b"} {
			want = append(want, k.create(t, k.spec(t, zone, name+"-"+zone)).ID)
		}
	}
	wantSortedWith(t, "ListVolumes", volumeIDs(must[[]*backend.Volume](t, "ListVolumes")(k.c.ListVolumes(ctx(t)))), want...)
}

func (k *contract) attachments(t *testing.T) {
	zone := k.zones()[0]
	one, two := k.create(t, k.spec(t, zone, "one")), k.create(t, k.spec(t, zone, "two"))
	oneID := must[volumeid.ID](t, "Parse")(volumeid.Parse(one.ID))
	twoID := must[volumeid.ID](t, "Parse")(volumeid.Parse(two.ID))
	key := func(i int) string { return NodeIDs[i].Name }
	on := func(node string) []string {
		t.Helper()
		return volumeIDs(must[[]*backend.Volume](t, "VolumesOn")(k.c.VolumesOn(ctx(t), node)))
	}
	both := []accessmode.Attachment{
		{Node: NodeIDs[0], Mode: accessmode.MultiNodeMultiWriter},
		{Node: NodeIDs[1], Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true},
	}
	v := must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), oneID, both))
	if !slices.Equal(v.Attachments, both) {
		t.Fatalf("SetAttachments answered attachments %+v, want %+v", v.Attachments, both)
	}
	must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), twoID, both[:1]))
	got := must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), oneID))
	if !slices.Equal(got.Attachments, both) {
		t.Fatalf("Volume records attachments %+v, want %+v", got.Attachments, both)
	}
	wantOn := slices.Sorted(slices.Values([]string{one.ID, two.ID}))
	if ids := on(key(0)); !slices.Equal(ids, wantOn) {
		t.Fatalf("VolumesOn(%s) = %v, want %v, sorted", key(0), ids, wantOn)
	}
	if ids := on(key(1)); !slices.Equal(ids, []string{one.ID}) {
		t.Fatalf("VolumesOn(%s) = %v, want %v", key(1), ids, []string{one.ID})
	}
	if ids := on(NodeIDs[0].String()); len(ids) != 0 {
		t.Fatalf("VolumesOn takes a node key, not a whole node id; VolumesOn(%s) = %v", NodeIDs[0], ids)
	}

	// Detaching one node leaves the other's; detaching all leaves none.
	must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), oneID, both[1:]))
	if ids := on(key(0)); !slices.Equal(ids, []string{two.ID}) {
		t.Fatalf("VolumesOn(%s) after its detach from %s = %v, want %v", key(0), one.ID, ids, []string{two.ID})
	}
	for _, id := range []volumeid.ID{oneID, twoID} {
		v := must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), id, nil))
		if len(v.Attachments) != 0 {
			t.Fatalf("attachments after detaching every node: %+v", v.Attachments)
		}
	}
	for i := range NodeIDs {
		if ids := on(key(i)); len(ids) != 0 {
			t.Fatalf("VolumesOn(%s) after every detach = %v", key(i), ids)
		}
	}
	if got := must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), oneID)); len(got.Attachments) != 0 {
		t.Fatalf("Volume records attachments after every detach: %+v", got.Attachments)
	}

	// A deleted volume is on no node, though it was deleted attached.
	must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), twoID, both[:1]))
	if err := k.c.DeleteVolume(ctx(t), twoID); err != nil {
		t.Fatalf("DeleteVolume of an attached volume: %v", err)
	}
	if ids := on(key(0)); len(ids) != 0 {
		t.Fatalf("VolumesOn(%s) after the deletion of its volume = %v", key(0), ids)
	}
}

func (k *contract) expandVolume(t *testing.T) {
	zone := k.zones()[0]
	spec := k.spec(t, zone, "grown")
	k.create(t, spec)
	before := k.committed(t, zone)
	v := must[*backend.Volume](t, "ExpandVolume")(k.c.ExpandVolume(ctx(t), spec.ID, 2*k.size))
	if v.CapacityBytes != 2*k.size {
		t.Fatalf("ExpandVolume to %d answered capacity %d", 2*k.size, v.CapacityBytes)
	}
	if got := must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)); got.CapacityBytes != 2*k.size {
		t.Fatalf("Volume after ExpandVolume to %d records %d", 2*k.size, got.CapacityBytes)
	}
	if after := k.committed(t, zone); after != before+k.size {
		t.Fatalf("committed bytes went from %d to %d growing a volume by %d", before, after, k.size)
	}
	// Volumes never shrink: a smaller or equal size is no error, and
	// changes nothing.
	for _, smaller := range []int64{k.size, 2 * k.size} {
		v := must[*backend.Volume](t, "ExpandVolume to a size it has")(k.c.ExpandVolume(ctx(t), spec.ID, smaller))
		if v.CapacityBytes != 2*k.size {
			t.Fatalf("ExpandVolume to %d of a volume of %d answered capacity %d", smaller, 2*k.size, v.CapacityBytes)
		}
	}
	spare := must[int64](t, "Capacity")(k.c.Capacity(ctx(t), zone))
	_, err := k.c.ExpandVolume(ctx(t), spec.ID, 2*k.size+spare+1<<30)
	wantCode(t, "ExpandVolume beyond the pool", err, codes.ResourceExhausted)
	if got := must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)); got.CapacityBytes != 2*k.size {
		t.Fatalf("a refused ExpandVolume changed the capacity to %d", got.CapacityBytes)
	}
}

func (k *contract) capacity(t *testing.T) {
	for _, zone := range k.zones() {
		spare := must[int64](t, "Capacity")(k.c.Capacity(ctx(t), zone))
		committed := k.committed(t, zone)
		spec := k.spec(t, zone, "too-big-"+zone)
		spec.CapacityBytes = spare + 1<<30
		_, err := k.c.CreateVolume(ctx(t), spec)
		wantCode(t, "CreateVolume larger than the pool's capacity", err, codes.ResourceExhausted)
		_, err = k.c.Volume(ctx(t), spec.ID)
		wantCode(t, "Volume after a refused CreateVolume", err, codes.NotFound)
		if after := k.committed(t, zone); after != committed {
			t.Fatalf("a refused CreateVolume changed the committed bytes from %d to %d", committed, after)
		}

		k.create(t, k.spec(t, zone, "fits-"+zone))
		if after := must[int64](t, "Capacity")(k.c.Capacity(ctx(t), zone)); after >= spare {
			t.Fatalf("Capacity(%q) was %d before a volume of %d bytes, %d after", zone, spare, k.size, after)
		}
		if after := k.committed(t, zone); after != committed+k.size {
			t.Fatalf("committed bytes went from %d to %d with a volume of %d", committed, after, k.size)
		}
	}
}

func (k *contract) modifyVolume(t *testing.T) {
	spec := k.spec(t, k.zones()[0], "modified")
	created := k.create(t, spec)
	v := must[*backend.Volume](t, "ModifyVolume with no change")(k.c.ModifyVolume(ctx(t), spec.ID, map[string]string{}))
	sameVolume(t, "the volume after a ModifyVolume with no change", v, created)
	v = must[*backend.Volume](t, "ModifyVolume")(k.c.ModifyVolume(ctx(t), spec.ID, k.props.Mutable))
	want := *created
	want.MutableParameters = maps.Clone(k.props.Mutable)
	sameVolume(t, "ModifyVolume's answer", v, &want)
	sameVolume(t, "Volume after ModifyVolume", must[*backend.Volume](t, "Volume")(k.c.Volume(ctx(t), spec.ID)), &want)
	// Keys not given keep their values.
	v = must[*backend.Volume](t, "ModifyVolume with no change")(k.c.ModifyVolume(ctx(t), spec.ID, nil))
	sameVolume(t, "the volume after a ModifyVolume with no keys", v, &want)

	// A volume some node holds takes the change too (NFS: live, on its
	// export), and keeps its attachments.
	attached := k.spec(t, k.zones()[0], "attached")
	k.create(t, attached)
	att := []accessmode.Attachment{{Node: NodeIDs[0], Mode: accessmode.MultiNodeMultiWriter}}
	before := must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), attached.ID, att))
	v = must[*backend.Volume](t, "ModifyVolume of an attached volume")(k.c.ModifyVolume(ctx(t), attached.ID, k.props.Mutable))
	want = *before
	want.MutableParameters = maps.Clone(k.props.Mutable)
	sameVolume(t, "ModifyVolume's answer for an attached volume", v, &want)
	must[*backend.Volume](t, "SetAttachments")(k.c.SetAttachments(ctx(t), attached.ID, nil))
}

func (k *contract) health(t *testing.T) {
	spec := k.spec(t, k.zones()[0], "healthy")
	k.create(t, spec)
	if h := must[backend.Health](t, "VolumeHealth")(k.c.VolumeHealth(ctx(t), spec.ID)); h.Abnormal {
		t.Fatalf("a new volume is unwell: %+v", h)
	}
}

func (k *contract) snapshotAndRestore(t *testing.T) {
	for _, zone := range k.zones() {
		spec := k.spec(t, zone, "source-"+zone)
		source := k.create(t, spec)
		committed := k.committed(t, zone)
		s := k.snapshot(t, spec.ID, "snap-"+zone)
		if s.SourceVolumeID != source.ID || s.SizeBytes != source.CapacityBytes || s.AccessType != source.AccessType || s.CreatedAt.IsZero() {
			t.Fatalf("snapshot of %s (%d bytes, %s): %+v", source.ID, source.CapacityBytes, source.AccessType, s)
		}
		if after := k.committed(t, zone); after < committed {
			t.Fatalf("committed bytes fell from %d to %d with a snapshot", committed, after)
		}
		snapID := must[volumeid.ID](t, "Parse")(volumeid.Parse(s.ID))
		got := must[*backend.Snapshot](t, "Snapshot")(k.c.Snapshot(ctx(t), snapID))
		if got.ID != s.ID || got.SourceVolumeID != s.SourceVolumeID || got.SizeBytes != s.SizeBytes || got.Cutting {
			t.Fatalf("Snapshot = %+v, want %+v", got, s)
		}

		for what, src := range map[string]backend.Source{"snapshot": {SnapshotID: s.ID}, "volume": {VolumeID: source.ID}} {
			restore := k.spec(t, zone, "from-"+what+"-"+zone)
			restore.CapacityBytes = s.SizeBytes
			restore.Source = &src
			v := k.create(t, restore)
			if v.CapacityBytes != source.CapacityBytes || !sameSource(v.Source, &src) || v.AccessType != source.AccessType {
				t.Fatalf("volume made from a %s of %d bytes: %+v", what, source.CapacityBytes, v)
			}
		}
	}
}

// restoreOnlyWhereFillable: a source fills a new volume in every zone
// ZonesFillableFrom names, its own zone among them, and in no other:
// there CreateVolume fails and leaves nothing, neither a volume nor a copy
// going on.
func (k *contract) restoreOnlyWhereFillable(t *testing.T) {
	if !k.props.Zoned {
		if zones, err := k.c.ZonesFillableFrom(ctx(t), ""); err != nil || zones != nil {
			t.Fatalf("ZonesFillableFrom of a backend without zones = %v, %v; want nil", zones, err)
		}
		return
	}
	for _, from := range k.zones() {
		spec := k.spec(t, from, "fill-source-"+from)
		k.create(t, spec)
		s := k.snapshot(t, spec.ID, "fill-snap-"+from)
		fillable := must[[]string](t, "ZonesFillableFrom")(k.c.ZonesFillableFrom(ctx(t), from))
		if !slices.Contains(fillable, from) {
			t.Fatalf("ZonesFillableFrom(%s) = %v, without the source's own zone", from, fillable)
		}
		for _, to := range k.zones() {
			restore := k.spec(t, to, "filled-from-"+from+"-in-"+to)
			restore.CapacityBytes = s.SizeBytes
			restore.Source = &backend.Source{SnapshotID: s.ID}
			if slices.Contains(fillable, to) {
				k.create(t, restore)
				continue
			}
			if v, err := k.c.CreateVolume(ctx(t), restore); err == nil {
				k.c.DeleteVolume(ctx(t), restore.ID)
				t.Fatalf("a volume in %s filled from a snapshot in %s, which ZonesFillableFrom says cannot be: %+v", to, from, v)
			}
			_, err := k.c.Volume(ctx(t), restore.ID)
			wantCode(t, "Volume of a refused restore", err, codes.NotFound)
			if creating, err := k.c.Creating(ctx(t), restore.ID); err != nil || creating {
				t.Fatalf("Creating of a refused restore = %v, %v; want false", creating, err)
			}
		}
	}
	if zones, err := k.c.ZonesFillableFrom(ctx(t), "zone-nowhere"); err != nil || zones != nil {
		t.Fatalf("ZonesFillableFrom of a zone not served here = %v, %v; want nil", zones, err)
	}
}

func (k *contract) absentSnapshot(t *testing.T) {
	id := k.id(t, k.zones()[0], volumeid.Snapshot, "absent")
	_, err := k.c.Snapshot(ctx(t), id)
	wantCode(t, "Snapshot", err, codes.NotFound)
	for range 2 {
		if err := k.c.DeleteSnapshot(ctx(t), id); err != nil {
			t.Fatalf("DeleteSnapshot of an absent snapshot: %v", err)
		}
	}
}

func (k *contract) listSnapshotsSorted(t *testing.T) {
	zone := k.zones()[0]
	source := k.create(t, k.spec(t, zone, "source"))
	sourceID := must[volumeid.ID](t, "Parse")(volumeid.Parse(source.ID))
	var want []string
	for _, name := range []string{"c", "a", "b"} {
		want = append(want, k.snapshot(t, sourceID, name).ID)
	}
	wantSortedWith(t, "ListSnapshots", snapshotIDs(must[[]*backend.Snapshot](t, "ListSnapshots")(k.c.ListSnapshots(ctx(t)))), want...)

	if err := k.c.DeleteSnapshot(ctx(t), must[volumeid.ID](t, "Parse")(volumeid.Parse(want[0]))); err != nil {
		t.Fatalf("DeleteSnapshot: %v", err)
	}
	ids := snapshotIDs(must[[]*backend.Snapshot](t, "ListSnapshots")(k.c.ListSnapshots(ctx(t))))
	if slices.Contains(ids, want[0]) {
		t.Fatalf("ListSnapshots after DeleteSnapshot still has it: %v", ids)
	}
	wantSortedWith(t, "ListSnapshots", ids, want[1:]...)
}

// deleteVolumeKeepsSnapshots: a snapshot is a copy, not a view of its
// source, with every real backend; deleting the source leaves it whole.
func (k *contract) deleteVolumeKeepsSnapshots(t *testing.T) {
	zone := k.zones()[0]
	spec := k.spec(t, zone, "source")
	k.create(t, spec)
	s := k.snapshot(t, spec.ID, "kept")
	if err := k.c.DeleteVolume(ctx(t), spec.ID); err != nil {
		t.Fatalf("DeleteVolume of a volume with a snapshot: %v", err)
	}
	snapID := must[volumeid.ID](t, "Parse")(volumeid.Parse(s.ID))
	if got := must[*backend.Snapshot](t, "Snapshot after its source's deletion")(k.c.Snapshot(ctx(t), snapID)); got.SourceVolumeID != spec.ID.String() {
		t.Fatalf("the snapshot after its source's deletion: %+v", got)
	}
	restore := k.spec(t, zone, "restored")
	restore.Source = &backend.Source{SnapshotID: s.ID}
	if v := k.create(t, restore); v.CapacityBytes != s.SizeBytes {
		t.Fatalf("a restore of %d bytes from a snapshot whose source is gone has %d", s.SizeBytes, v.CapacityBytes)
	}
}

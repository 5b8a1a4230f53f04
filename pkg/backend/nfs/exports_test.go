package nfs_test

import (
	"context"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// startedController opens an NFS controller over storage and starts it
// against a recording ganesha, which it returns with it.
func startedController(t *testing.T, ctx context.Context, storage nfs.Storage, exportDir string) (*nfs.Controller, *recordingGanesha) {
	t.Helper()
	ctrl, err := nfs.NewController(ctx, nfs.Config{Storage: storage, ExportDir: exportDir, Server: "10.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	g := &recordingGanesha{applied: map[uint16]string{}}
	if err := ctrl.Start(ctx, g); err != nil {
		t.Fatal(err)
	}
	return ctrl, g
}

// createMultiWriter creates a 1 MiB MULTI_NODE_MULTI_WRITER volume named
// name and returns its id.
func createMultiWriter(t *testing.T, ctx context.Context, ctrl *nfs.Controller, name string) volumeid.ID {
	t.Helper()
	return createWithMode(t, ctx, ctrl, name, accessmode.MultiNodeMultiWriter)
}

// recordingGanesha keeps the export file as it was each time ganesha was
// told to apply it: what ganesha would have served.
// ops lists the calls in order ("apply 3", "remove 3"); failRemove, when
// set, is the error RemoveExport answers.
type recordingGanesha struct {
	applied    map[uint16]string
	ops        []string
	failRemove error
}

func (r *recordingGanesha) ApplyExport(_ context.Context, confPath string, id uint16) error {
	data, err := os.ReadFile(confPath)
	if err != nil {
		return err
	}
	r.ops = append(r.ops, "apply "+strconv.Itoa(int(id)))
	r.applied[id] = string(data)
	return nil
}
func (r *recordingGanesha) RemoveExport(_ context.Context, id uint16) error {
	if r.failRemove != nil {
		return r.failRemove
	}
	r.ops = append(r.ops, "remove "+strconv.Itoa(int(id)))
	delete(r.applied, id)
	return nil
}
func (r *recordingGanesha) Exports(context.Context) ([]ganesha.ExportInfo, error) { return nil, nil }

// Export answers from the file last applied: each CLIENT block's address,
// access and squash, as ganesha would report them.
func (r *recordingGanesha) Export(_ context.Context, id uint16) (ganesha.ExportInfo, error) {
	file, ok := r.applied[id]
	if !ok {
		return ganesha.ExportInfo{}, &ganesha.Error{Name: "org.freedesktop.DBus.Error.InvalidArgs", Message: "no such export"}
	}
	info := ganesha.ExportInfo{ID: id}
	for _, block := range strings.Split(file, "CLIENT {")[1:] {
		var ci ganesha.ClientInfo
		for _, raw := range strings.Split(block, "\n") {
			key, val, _ := strings.Cut(strings.TrimSuffix(strings.TrimSpace(raw), ";"), " = ")
			switch key {
			case "Clients":
				ci.Match = val
				ci.Address, _ = netip.ParseAddr(val)
			case "Access_Type":
				ci.Access = val
			case "Squash":
				ci.Squash = ganesha.Squash(val)
			}
		}
		info.Clients = append(info.Clients, ci)
	}
	return info, nil
}

// servedExport is what an export file grants.
type servedExport struct {
	access  string            // the export block's own Access_Type
	squash  []string          // every Squash line, export and clients
	clients map[string]string // Clients value -> its Access_Type
}

// parseExport reads an export file line by line; ganesha.Render writes one
// setting per line, and anything else here fails the test.
func parseExport(t *testing.T, file string) servedExport {
	t.Helper()
	e := servedExport{clients: map[string]string{}}
	client, inClient := "", false
	for _, raw := range strings.Split(file, "\n") {
		line := strings.TrimSuffix(strings.TrimSpace(raw), ";")
		key, val, _ := strings.Cut(line, " = ")
		switch {
		case line == "CLIENT {":
			inClient, client = true, ""
		case line == "}" && inClient:
			if client == "" {
				t.Errorf("a CLIENT block without Clients:\n%s", file)
			}
			inClient = false
		case key == "Clients":
			client = val
			e.clients[client] = ""
		case key == "Access_Type" && inClient:
			e.clients[client] = val
		case key == "Access_Type":
			e.access = val
		case key == "Squash":
			e.squash = append(e.squash, val)
		}
	}
	return e
}

// TestExportsOpenOnlyToPublishedNodes follows one volume's export through
// publishes and unpublishes and checks, in the file ganesha is given each
// time, that the export itself grants nothing, that its clients are exactly
// the published nodes' single addresses with RW or RO as recorded (never a
// wildcard, network or host name), and that root is squashed unless the
// volume's parameters say rootSquash=false in so many words.
func TestExportsOpenOnlyToPublishedNodes(t *testing.T) {
	ctx := context.Background()
	root, exportDir := t.TempDir(), t.TempDir()
	ctrl, g := startedController(t, ctx, dirStorage{root}, exportDir)
	node := func(name, addr string) nodeid.Node {
		return nodeid.Node{Name: name, Zone: "zone-a", Address: addr}
	}
	n1, n2, n3 := node("n1", "10.0.0.11"), node("n2", "fd00::12"), node("n3", "10.0.0.13")
	create := func(name string, params map[string]string) volumeid.ID {
		t.Helper()
		id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ctrl.CreateVolume(ctx, backend.VolumeSpec{
			ID: id, Name: name, CapacityBytes: 1 << 20, AccessType: accessmode.Mount,
			Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}, Parameters: params,
		}); err != nil {
			t.Fatalf("CreateVolume %s: %v", name, err)
		}
		return id
	}
	// served is the volume's export file, checked to be what ganesha was
	// last told to apply for its export id.
	served := func(id volumeid.ID) string {
		t.Helper()
		data, err := os.ReadFile(filepath.Join(exportDir, id.FileName()+".conf"))
		if err != nil {
			t.Fatal(err)
		}
		eid := -1
		for _, l := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "Export_Id = "); ok {
				eid, _ = strconv.Atoi(strings.TrimSuffix(v, ";"))
			}
		}
		if got, ok := g.applied[uint16(eid)]; eid <= 0 || !ok || got != string(data) {
			t.Fatalf("ganesha was not given the export file of %s as it is now:\n%s", id, data)
		}
		return string(data)
	}
	// check compares what ganesha was last given for id with want
	// (address -> RW/RO) and the squash every line must carry.
	check := func(step string, id volumeid.ID, want map[string]string, squash string) {
		t.Helper()
		e := parseExport(t, served(id))
		if e.access != "None" {
			t.Errorf("%s: the export grants Access_Type = %q to clients it does not list; want None", step, e.access)
		}
		for c := range e.clients {
			if a, err := netip.ParseAddr(c); err != nil || a.IsUnspecified() || a.String() != c {
				t.Errorf("%s: client %q is not one plain address (a wildcard, network or name would let in more than the node)", step, c)
			}
		}
		if len(e.clients) != len(want) {
			t.Errorf("%s: clients %v, want exactly %v", step, e.clients, want)
		}
		for addr, access := range want {
			if e.clients[addr] != access {
				t.Errorf("%s: client %s has %q, want %q (clients %v)", step, addr, e.clients[addr], access, e.clients)
			}
		}
		if len(e.squash) != 1+len(want) {
			t.Errorf("%s: %d Squash lines for %d clients", step, len(e.squash), len(want))
		}
		for _, s := range e.squash {
			if s != squash {
				t.Errorf("%s: Squash = %s, want %s", step, s, squash)
			}
		}
		// The controller's own account, which `modeguard inspect` shows,
		// says the same.
		rules, err := ctrl.ClientList(id)
		if err != nil {
			t.Fatal(err)
		}
		if len(rules) != len(want) {
			t.Errorf("%s: ClientList %v, want %v", step, rules, want)
		}
		for _, r := range rules {
			if acc := map[bool]string{true: "RO", false: "RW"}[r.ReadOnly]; want[r.Address.String()] != acc {
				t.Errorf("%s: ClientList has %s %s, want %q", step, r.Address, acc, want[r.Address.String()])
			}
		}
	}
	attach := func(step string, id volumeid.ID, atts ...accessmode.Attachment) {
		t.Helper()
		if _, err := ctrl.SetAttachments(ctx, id, atts); err != nil {
			t.Fatalf("%s: %v", step, err)
		}
	}
	rw := func(n nodeid.Node) accessmode.Attachment {
		return accessmode.Attachment{Node: n, Mode: accessmode.MultiNodeMultiWriter}
	}
	ro := func(n nodeid.Node) accessmode.Attachment {
		return accessmode.Attachment{Node: n, Mode: accessmode.MultiNodeMultiWriter, ReadOnly: true}
	}

	vol := create("follows", nil)
	// unserved: a volume no node holds has no export at all, neither in a
	// file a restarted ganesha would read nor in ganesha.
	unserved := func(step string, id volumeid.ID) {
		t.Helper()
		if _, err := os.Stat(filepath.Join(exportDir, id.FileName()+".conf")); !os.IsNotExist(err) {
			t.Errorf("%s: the export file is there (%v); want none while no node holds the volume", step, err)
		}
		for eid, conf := range g.applied {
			if strings.Contains(conf, id.FileName()) {
				t.Errorf("%s: ganesha still serves export %d of the volume", step, eid)
			}
		}
	}
	unserved("created", vol)
	attach("published to n1", vol, rw(n1))
	check("published to n1", vol, map[string]string{"10.0.0.11": "RW"}, "root_squash")
	attach("published to n1 and n2 (ro)", vol, rw(n1), ro(n2))
	check("published to n1 and n2 (ro)", vol, map[string]string{"10.0.0.11": "RW", "fd00::12": "RO"}, "root_squash")
	attach("unpublished from n1", vol, ro(n2))
	check("unpublished from n1", vol, map[string]string{"fd00::12": "RO"}, "root_squash")

	// A node without an address, or two nodes behind one address, cannot be
	// told apart by the server: refused, and the export stays as it was.
	for _, bad := range [][]accessmode.Attachment{
		{ro(n2), rw(node("n4", ""))},
		{ro(n2), rw(n3), rw(node("n5", "10.0.0.13"))},
	} {
		_, err := ctrl.SetAttachments(ctx, vol, bad)
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("attachments %v: %v, want FAILED_PRECONDITION", bad, err)
		}
		check("after a refused publish", vol, map[string]string{"fd00::12": "RO"}, "root_squash")
	}
	attach("unpublished everywhere", vol)
	unserved("unpublished everywhere", vol)
	attach("published again", vol, ro(n2))
	check("published again", vol, map[string]string{"fd00::12": "RO"}, "root_squash")
	attach("unpublished everywhere again", vol)

	// Squashing: on by default, off only for a value that reads as false.
	for _, tc := range []struct {
		value, want string
	}{
		{"true", "root_squash"}, {"false", "no_root_squash"}, {"0", "no_root_squash"},
		{"", "root_squash"}, {"no", "root_squash"}, {"off", "root_squash"}, {"garbage", "root_squash"},
	} {
		id := create("squash-"+tc.value, map[string]string{"rootSquash": tc.value})
		attach("squash "+tc.value, id, rw(n3))
		check("rootSquash="+tc.value, id, map[string]string{"10.0.0.13": "RW"}, tc.want)
	}

	// A restarted controller renders the export files of the published
	// volumes from the records before ganesha starts, and removes the rest
	// (they are rendered again at their next publish): nothing is served
	// wider after a crash.
	published := create("published-at-restart", nil)
	attach("published before the restart", published, rw(n1))
	want, err := os.ReadFile(filepath.Join(exportDir, published.FileName()+".conf"))
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []volumeid.ID{vol, published} {
		if err := os.WriteFile(filepath.Join(exportDir, id.FileName()+".conf"), []byte("EXPORT { Access_Type = RW; }\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := nfs.NewController(ctx, nfs.Config{Storage: dirStorage{root}, ExportDir: exportDir, Server: "10.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadFile(filepath.Join(exportDir, published.FileName()+".conf")); string(after) != string(want) {
		t.Errorf("after a restart the export file of a published volume is\n%s\nwant it rendered from the record again:\n%s", after, want)
	}
	if _, err := os.Stat(filepath.Join(exportDir, vol.FileName()+".conf")); !os.IsNotExist(err) {
		t.Errorf("after a restart the export file of a volume published nowhere is still there (%v); want it removed until its next publish", err)
	}

	if err := ctrl.DeleteVolume(ctx, vol); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(exportDir, vol.FileName()+".conf")); !os.IsNotExist(err) {
		t.Errorf("the export file of a deleted volume is still there: %v", err)
	}
}

// TestNFSRecordsArePrivate checks, under umask 0, the modes of what the NFS
// controller writes: records and export files 0600, its directories
// writable by root only, and the directory above the exported volumes
// 0711, which lets squashed users through to their export without letting
// anyone list or change the volumes.
func TestNFSRecordsArePrivate(t *testing.T) {
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) })
	ctx := context.Background()
	base := t.TempDir()
	root, exportDir := filepath.Join(base, "root"), filepath.Join(base, "exports")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	ctrl, _ := startedController(t, ctx, dirStorage{root}, exportDir)
	vid, _ := volumeid.New(accessmode.BackendNFS, "", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "v"))
	if _, err := ctrl.CreateVolume(ctx, backend.VolumeSpec{ID: vid, Name: "v", CapacityBytes: 1 << 20,
		AccessType: accessmode.Mount, Modes: []accessmode.Mode{accessmode.MultiNodeMultiWriter}}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.SetAttachments(ctx, vid, []accessmode.Attachment{{
		Node: nodeid.Node{Name: "n1", Zone: "zone-a", Address: "10.0.0.11"}, Mode: accessmode.MultiNodeMultiWriter}}); err != nil {
		t.Fatal(err)
	}
	sid, _ := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "s"))
	if _, err := ctrl.CreateSnapshot(ctx, sid, "s", vid); err != nil {
		t.Fatal(err)
	}

	if fi, err := os.Stat(filepath.Join(root, "volumes")); err != nil || fi.Mode().Perm() != 0o711 {
		t.Errorf("volumes directory: %v %v, want 0711", fi.Mode(), err)
	}
	var files []string
	for _, dir := range []string{filepath.Join(root, "meta"), exportDir, filepath.Join(root, "snapshots")} {
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if p != dir && filepath.Dir(p) == filepath.Join(root, "snapshots") {
				return fs.SkipDir // a snapshot's data: the storage's, not the controller's
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			switch m := fi.Mode(); {
			case m.IsDir() && m.Perm() != 0o700:
				t.Errorf("directory %s is %v, want 0700", p, m)
			case m.IsRegular() && m.Perm() != 0o600:
				t.Errorf("file %s is %v, want -rw-------", p, m)
			case m.IsRegular():
				files = append(files, strings.TrimPrefix(p, base))
			case !m.IsDir():
				t.Errorf("%s is %v", p, m)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	slices.Sort(files)
	want := []string{
		"/exports/" + vid.FileName() + ".conf",
		"/root/meta/snapshots/" + sid.FileName() + ".json",
		"/root/meta/volumes/" + vid.FileName() + ".json",
	}
	if !slices.Equal(files, want) {
		t.Errorf("files walked %v, want %v", files, want)
	}
}

// VolumesOn answers from an index kept with every change of attachments:
// it must list exactly the volumes whose records name the node, through
// publishes, unpublishes, a deletion and a restart that reloads the records.
func TestVolumesOnFollowsTheRecords(t *testing.T) {
	ctx := context.Background()
	root, exportDir := t.TempDir(), t.TempDir()
	open := func() *nfs.Controller {
		t.Helper()
		ctrl, _ := startedController(t, ctx, dirStorage{root}, exportDir)
		return ctrl
	}
	ctrl := open()
	att := func(name, addr string) accessmode.Attachment {
		return accessmode.Attachment{Node: nodeid.Node{Name: name, Zone: "zone-a", Address: addr}, Mode: accessmode.MultiNodeMultiWriter}
	}
	var ids []volumeid.ID
	for _, name := range []string{"a", "b", "c"} {
		ids = append(ids, createMultiWriter(t, ctx, ctrl, name))
	}
	set := func(id volumeid.ID, a ...accessmode.Attachment) {
		t.Helper()
		if _, err := ctrl.SetAttachments(ctx, id, a); err != nil {
			t.Fatal(err)
		}
	}
	check := func(step, node string, want ...volumeid.ID) {
		t.Helper()
		vols, err := ctrl.VolumesOn(ctx, node)
		if err != nil {
			t.Fatal(err)
		}
		var got, wantIDs []string
		for _, v := range vols {
			got = append(got, v.ID)
		}
		for _, id := range want {
			wantIDs = append(wantIDs, id.String())
		}
		slices.Sort(wantIDs)
		if !slices.Equal(got, wantIDs) {
			t.Errorf("%s: VolumesOn(%s) = %v, want %v", step, node, got, wantIDs)
		}
	}
	set(ids[0], att("n1", "10.0.0.11"), att("n2", "10.0.0.12"))
	set(ids[1], att("n1", "10.0.0.11"))
	check("after publishes", "n1", ids[0], ids[1])
	check("after publishes", "n2", ids[0])
	check("after publishes", "n3")
	set(ids[0], att("n2", "10.0.0.12"))
	check("after n1 let go of a", "n1", ids[1])
	set(ids[2], att("n1", "10.0.0.99")) // n1 under a new address is still n1
	check("after a publish under a new address", "n1", ids[1], ids[2])
	ctrl = open()
	check("after a restart", "n1", ids[1], ids[2])
	check("after a restart", "n2", ids[0])
	set(ids[1])
	if err := ctrl.DeleteVolume(ctx, ids[1]); err != nil {
		t.Fatal(err)
	}
	check("after a deletion", "n1", ids[2])
}

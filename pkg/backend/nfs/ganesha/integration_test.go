package ganesha

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/fsutil"
)

func requireGanesha(t *testing.T) {
	t.Helper()
	ganeshatest.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ip", "nsenter", "ganesha.nfsd", "dbus-daemon", "nfs-cp", "nfs-cat", "nfs-ls")
}

// gone reports whether pid no longer runs a process started for dir.
func gone(pid int, dir string) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return true
	}
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return err != nil || !bytes.Contains(cmdline, []byte(dir))
}

// startServer runs a Server in the network's server namespace, with
// changes to its configuration made by opts, and registers a cleanup that
// stops it and checks that every PID it ever had is gone.
func startServer(t *testing.T, net *ganeshatest.Network, dir, exportDir string, opts ...func(*ServerConfig)) *Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := ServerConfig{
		Dir:           dir,
		ExportDir:     exportDir,
		ListenAddress: net.Server.Addr.String(),
		NetNSPath:     net.Server.Path,
		Logf:          t.Logf,
	}
	for _, o := range opts {
		o(&cfg)
	}
	srv, err := StartServer(ctx, cfg)
	if err != nil {
		t.Fatalf("StartServer: %v", err)
	}
	pids := map[int]bool{srv.GaneshaPID(): true, srv.BusPID(): true}
	t.Cleanup(func() {
		pids[srv.GaneshaPID()] = true
		pids[srv.BusPID()] = true
		if err := srv.Stop(); err != nil {
			t.Errorf("Stop: %v", err)
		}
		for pid := range pids {
			if pid != 0 && !gone(pid, dir) {
				t.Errorf("pid %d still runs after Stop", pid)
			}
		}
	})
	return srv
}

// waitFor polls cond until it holds or a generous deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// refused asserts that an NFS client operation failed, and for the reason
// given (an NFSv4 status as libnfs prints it).
func refused(t *testing.T, what string, err error, reason string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s succeeded; want it refused with %s", what, reason)
	}
	if !strings.Contains(err.Error(), reason) {
		t.Errorf("%s refused, but not with %s: %v", what, reason, err)
	}
}

// testDirs makes a temp tree ganesha (root) and squashed clients can use:
// runtime dir, export dir, and a world-writable data directory.
func testDirs(t *testing.T) (runDir, exportDir, data string) {
	t.Helper()
	root := t.TempDir()
	if err := os.Chmod(root, 0o755); err != nil {
		t.Fatal(err)
	}
	runDir, exportDir, data = filepath.Join(root, "run"), filepath.Join(root, "exports"), filepath.Join(root, "data", "vol1")
	if err := os.MkdirAll(data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(data, 0o777); err != nil {
		t.Fatal(err)
	}
	return runDir, exportDir, data
}

func TestServerEnforcesClientRules(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 2})
	node1, node2 := net.Nodes[0], net.Nodes[1]
	runDir, exportDir, data := testDirs(t)
	// A short grace period: the crash below makes the nodes' clients wait
	// it out (TestGraceOnlyAfterAStartWithKnownClients is about grace).
	srv := startServer(t, net, runDir, exportDir, func(c *ServerConfig) { c.LeaseLifetime, c.GracePeriod = 5*time.Second, 10*time.Second })
	c := srv.Control()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	local := filepath.Join(t.TempDir(), "payload")
	payload := []byte("written by node1\n")
	if err := os.WriteFile(local, payload, 0o644); err != nil {
		t.Fatal(err)
	}
	const id = 17
	const pseudo = "/pvc-17"
	confPath := ExportFilePath(exportDir, id)
	e := Export{ID: id, Path: data, Pseudo: pseudo, Comment: "integration test",
		Clients: []ClientRule{{Address: node1.Addr}}}
	apply := func(e Export) {
		t.Helper()
		if err := WriteExportFile(confPath, e); err != nil {
			t.Fatal(err)
		}
		if err := c.ApplyExport(ctx, confPath, id); err != nil {
			t.Fatalf("ApplyExport: %v", err)
		}
	}
	wantClients := func(want []ClientRule) {
		t.Helper()
		info, err := c.Export(ctx, id)
		if err != nil {
			t.Fatalf("Export(%d): %v", id, err)
		}
		if info.Path != data || info.Pseudo != pseudo {
			t.Errorf("ganesha serves path %q pseudo %q, want %q %q", info.Path, info.Pseudo, data, pseudo)
		}
		got, ok := info.Rules()
		if !ok {
			t.Fatalf("ganesha reports clients a ClientRule cannot express: %+v", info.Clients)
		}
		want = slices.Clone(want)
		slices.SortFunc(want, func(a, b ClientRule) int { return a.Address.Compare(b.Address) })
		if !slices.Equal(got, want) {
			t.Fatalf("ganesha's clients %+v, want %+v", got, want)
		}
		for _, ci := range info.Clients {
			if ci.Squash != RootSquash {
				t.Errorf("client %s squash %q, want root_squash", ci.Match, ci.Squash)
			}
		}
	}
	onDisk := func(name string) bool {
		_, err := os.Stat(filepath.Join(data, name))
		return err == nil
	}

	t.Run("node1 RW only", func(t *testing.T) {
		apply(e) // not served yet: AddExport
		wantClients(e.Clients)
		if err := node1.NFSCopy(ctx, local, net.NFSURL(pseudo, "a.txt")); err != nil {
			t.Fatalf("node1 write: %v", err)
		}
		got, err := os.ReadFile(filepath.Join(data, "a.txt"))
		if err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("file on the server: %q, %v", got, err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(data, "a.txt"), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid == 0 {
			t.Errorf("root on node1 created a root-owned file: root_squash not applied")
		}
		names, err := node1.NFSLs(ctx, net.NFSURL(pseudo, ""))
		if err != nil || !slices.Contains(names, "a.txt") {
			t.Errorf("node1 nfs-ls: %v, %v", names, err)
		}
		// Not listed: the export does not even exist for node2.
		refused(t, "node2 write", node2.NFSCopy(ctx, local, net.NFSURL(pseudo, "b.txt")), "NFS4ERR_NOENT")
		if onDisk("b.txt") {
			t.Fatalf("node2's write reached the disk")
		}
		_, err = node2.NFSCat(ctx, net.NFSURL(pseudo, "a.txt"))
		refused(t, "node2 read", err, "NFS4ERR_NOENT")
	})

	t.Run("node2 added RO", func(t *testing.T) {
		e.Clients = []ClientRule{{Address: node1.Addr}, {Address: node2.Addr, ReadOnly: true}}
		apply(e) // served: UpdateExport
		wantClients(e.Clients)
		got, err := node2.NFSCat(ctx, net.NFSURL(pseudo, "a.txt"))
		if err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("node2 read: %q, %v", got, err)
		}
		refused(t, "node2 (RO) write", node2.NFSCopy(ctx, local, net.NFSURL(pseudo, "b.txt")), "NFS4ERR_ROFS")
		if onDisk("b.txt") {
			t.Fatalf("node2's write reached the disk")
		}
		if err := node1.NFSCopy(ctx, local, net.NFSURL(pseudo, "c.txt")); err != nil {
			t.Fatalf("node1 lost write access: %v", err)
		}
	})

	t.Run("node1 removed", func(t *testing.T) {
		e.Clients = []ClientRule{{Address: node2.Addr, ReadOnly: true}}
		apply(e)
		wantClients(e.Clients)
		refused(t, "node1 write after its removal", node1.NFSCopy(ctx, local, net.NFSURL(pseudo, "d.txt")), "NFS4ERR_NOENT")
		if onDisk("d.txt") {
			t.Fatalf("node1's write reached the disk after its removal")
		}
		if _, err := node2.NFSCat(ctx, net.NFSURL(pseudo, "a.txt")); err != nil {
			t.Fatalf("node2 lost read access: %v", err)
		}
	})

	t.Run("ganesha crash", func(t *testing.T) {
		old := srv.GaneshaPID()
		restarts := srv.Restarts()
		if err := srv.KillGanesha(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the supervisor to restart ganesha", func() bool {
			pid := srv.GaneshaPID()
			return srv.Restarts() > restarts && pid != 0 && pid != old
		})
		if !gone(old, runDir) {
			t.Errorf("killed ganesha %d still runs", old)
		}
		if err := srv.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		// No Add call: the export comes back from ExportDir, exact.
		wantClients(e.Clients)
		// The nodes' earlier clients may be in the recovery database, and
		// libnfs gives up on NFS4ERR_GRACE.
		if err := srv.WaitGraceEnded(ctx); err != nil {
			t.Fatal(err)
		}
		got, err := node2.NFSCat(ctx, net.NFSURL(pseudo, "a.txt"))
		if err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("node2 read after restart: %q, %v", got, err)
		}
		refused(t, "node1 write after restart", node1.NFSCopy(ctx, local, net.NFSURL(pseudo, "e.txt")), "NFS4ERR_NOENT")
		refused(t, "node2 (RO) write after restart", node2.NFSCopy(ctx, local, net.NFSURL(pseudo, "e.txt")), "NFS4ERR_ROFS")
		if onDisk("e.txt") {
			t.Fatalf("a refused write reached the disk")
		}
	})

	t.Run("path and pseudo changes", func(t *testing.T) {
		// ganesha changes a pseudo path in place but refuses to change
		// Path; ApplyExport then removes and adds the export.
		other := filepath.Join(filepath.Dir(data), "vol1b")
		if err := os.Mkdir(other, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(other, "marker"), []byte("other dir\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		moved := e
		moved.Path, moved.Pseudo = other, "/pvc-17b"
		apply(moved)
		info, err := c.Export(ctx, id)
		if err != nil || info.Path != other || info.Pseudo != "/pvc-17b" {
			t.Fatalf("after moving: %+v, %v", info, err)
		}
		got, err := node2.NFSCat(ctx, net.NFSURL("/pvc-17b", "marker"))
		if err != nil || string(got) != "other dir\n" {
			t.Fatalf("node2 reads %q, %v from the moved export", got, err)
		}
		apply(e) // and back
		wantClients(e.Clients)
		if _, err := node2.NFSCat(ctx, net.NFSURL(pseudo, "a.txt")); err != nil {
			t.Fatalf("node2 read after moving back: %v", err)
		}
	})

	t.Run("ganesha errors carry its message", func(t *testing.T) {
		bad := Export{ID: 18, Path: filepath.Join(filepath.Dir(data), "missing"), Pseudo: "/pvc-18",
			Clients: []ClientRule{{Address: node1.Addr}}}
		badPath := ExportFilePath(exportDir, 18)
		if err := WriteExportFile(badPath, bad); err != nil {
			t.Fatal(err)
		}
		err := c.ApplyExport(ctx, badPath, 18)
		var gerr *Error
		if !errors.As(err, &gerr) || gerr.Method != "AddExport" || gerr.Message == "" {
			t.Fatalf("ApplyExport of a missing directory: %v", err)
		}
		if !strings.Contains(err.Error(), badPath) {
			t.Errorf("error does not carry ganesha's message naming the file: %v", err)
		}
		t.Logf("ganesha said: %v", err)
		if err := fsutil.RemoveDurably(badPath); err != nil {
			t.Fatal(err)
		}
		err = c.RemoveExport(ctx, 18)
		if !IsNotFound(err) {
			t.Errorf("RemoveExport of an unknown id: %v, want IsNotFound", err)
		}
		if _, err := c.Export(ctx, 18); !IsNotFound(err) {
			t.Errorf("Export of an unknown id: %v, want IsNotFound", err)
		}
		if err := c.AddExport(ctx, confPath, id); err == nil {
			t.Errorf("AddExport of a served id succeeded")
		}
	})

	t.Run("IPv6 clients reach ganesha as written", func(t *testing.T) {
		v6 := Export{ID: 19, Path: data, Pseudo: "/pvc-19", Squash: NoRootSquash, Clients: []ClientRule{
			{Address: mustAddr("fd00:99::11"), ReadOnly: true},
			{Address: mustAddr("2001:db8::1:2")},
			{Address: mustAddr("10.99.250.3")},
		}}
		p := ExportFilePath(exportDir, 19)
		if err := WriteExportFile(p, v6); err != nil {
			t.Fatal(err)
		}
		if err := c.ApplyExport(ctx, p, 19); err != nil {
			t.Fatal(err)
		}
		info, err := c.Export(ctx, 19)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := info.Rules()
		want := slices.Clone(v6.Clients)
		slices.SortFunc(want, func(a, b ClientRule) int { return a.Address.Compare(b.Address) })
		if !ok || !slices.Equal(got, want) {
			t.Fatalf("clients %+v (%+v), want %+v", got, info.Clients, want)
		}
		for _, ci := range info.Clients {
			if ci.Squash != NoRootSquash {
				t.Errorf("client %s squash %q, want no_root_squash", ci.Match, ci.Squash)
			}
		}
		all, err := c.Exports(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var ids []uint16
		for _, x := range all {
			ids = append(ids, x.ID)
		}
		if !slices.Equal(ids, []uint16{id, 19}) {
			t.Errorf("Exports ids %v, want [%d 19]", ids, id)
		}
		if err := fsutil.RemoveDurably(p); err != nil {
			t.Fatal(err)
		}
		if err := c.RemoveExport(ctx, 19); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("RemoveExport", func(t *testing.T) {
		names, err := node2.NFSLs(ctx, net.NFSURL("", ""))
		if err != nil || !slices.Contains(names, strings.TrimPrefix(pseudo, "/")) {
			t.Fatalf("node2 does not see %s in the pseudo root: %v, %v", pseudo, names, err)
		}
		if err := fsutil.RemoveDurably(confPath); err != nil {
			t.Fatal(err)
		}
		if err := c.RemoveExport(ctx, id); err != nil {
			t.Fatalf("RemoveExport: %v", err)
		}
		has, err := c.HasExport(ctx, id)
		if err != nil || has {
			t.Fatalf("export still served after RemoveExport: %v, %v", has, err)
		}
		if ids, err := c.ExportIDs(ctx); err != nil || len(ids) != 0 {
			t.Fatalf("ExportIDs after removal: %v, %v", ids, err)
		}
		_, err = node2.NFSCat(ctx, net.NFSURL(pseudo, "a.txt"))
		refused(t, "node2 read of a removed export", err, "NFS4ERR_NOENT")
		names, err = node2.NFSLs(ctx, net.NFSURL("", ""))
		if err == nil && slices.Contains(names, strings.TrimPrefix(pseudo, "/")) {
			t.Errorf("the pseudo root still lists %s: %v", pseudo, names)
		}
		if err := c.RemoveExport(ctx, id); !IsNotFound(err) {
			t.Errorf("second RemoveExport: %v, want IsNotFound", err)
		}
	})

	t.Run("Stop", func(t *testing.T) {
		g, b := srv.GaneshaPID(), srv.BusPID()
		if err := srv.Stop(); err != nil {
			t.Fatalf("Stop: %v", err)
		}
		if err := srv.Stop(); err != nil {
			t.Fatalf("second Stop: %v", err)
		}
		for _, pid := range []int{g, b} {
			if !gone(pid, runDir) {
				t.Errorf("pid %d still runs after Stop", pid)
			}
		}
		if err := c.Ping(ctx); !errors.Is(err, ErrClosed) {
			t.Errorf("Ping after Stop: %v, want ErrClosed", err)
		}
		if err := srv.KillGanesha(); err == nil {
			t.Errorf("KillGanesha after Stop succeeded")
		}
	})
}

func TestStartServerReportsGaneshaLog(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 0})
	runDir, exportDir, _ := testDirs(t)
	if err := os.MkdirAll(exportDir, 0o700); err != nil {
		t.Fatal(err)
	}
	// A file ganesha cannot parse makes it refuse to start.
	if err := os.WriteFile(filepath.Join(exportDir, "broken.conf"), []byte("EXPORT {\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A leftover temporary file is removed before ganesha reads the dir.
	tmp := filepath.Join(exportDir, ".export-3.conf.tmp-123")
	if err := os.WriteFile(tmp, []byte("garbage {"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := StartServer(ctx, ServerConfig{Dir: runDir, ExportDir: exportDir, NetNSPath: net.Server.Path})
	if err == nil {
		srv.Stop()
		t.Fatal("StartServer succeeded with a broken export file")
	}
	t.Logf("StartServer: %v", err)
	if !strings.Contains(err.Error(), "broken.conf") && !strings.Contains(err.Error(), "syntax error") {
		t.Errorf("error does not carry ganesha's log: %v", err)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Errorf("temporary export file not removed: %v", err)
	}
	// Nothing is left running: the bus was stopped too (Cleanup of the
	// network would report processes in the namespace as an error).
	data, _ := os.ReadFile(filepath.Join(runDir, BusPIDName))
	if pid, _ := strconv.Atoi(strings.TrimSpace(string(data))); pid == 0 || !gone(pid, runDir) {
		t.Errorf("dbus-daemon (pid file %q) still runs", data)
	}
}

func TestSupervisorRestartsBus(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	node := net.Nodes[0]
	runDir, exportDir, data := testDirs(t)
	srv := startServer(t, net, runDir, exportDir)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := Export{ID: 3, Path: data, Pseudo: "/pvc-3", Clients: []ClientRule{{Address: node.Addr, ReadOnly: true}}}
	p := ExportFilePath(exportDir, e.ID)
	if err := WriteExportFile(p, e); err != nil {
		t.Fatal(err)
	}
	if err := srv.Control().ApplyExport(ctx, p, e.ID); err != nil {
		t.Fatal(err)
	}
	oldBus, oldG := srv.BusPID(), srv.GaneshaPID()
	if err := syscall.Kill(oldBus, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a new bus and a new ganesha", func() bool {
		b, g := srv.BusPID(), srv.GaneshaPID()
		return b != 0 && b != oldBus && g != 0 && g != oldG
	})
	if err := srv.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if !gone(oldBus, runDir) || !gone(oldG, runDir) {
		t.Errorf("old bus %d or old ganesha %d still runs", oldBus, oldG)
	}
	// The same Control works again, and the export is back from disk.
	info, err := srv.Control().Export(ctx, e.ID)
	if err != nil {
		t.Fatal(err)
	}
	if rules, ok := info.Rules(); !ok || !slices.Equal(rules, e.Clients) {
		t.Fatalf("clients after the bus restart: %+v", info.Clients)
	}
	if _, err := node.NFSLs(ctx, net.NFSURL(e.Pseudo, "")); err != nil {
		t.Fatalf("node cannot list the export after the restart: %v", err)
	}
}

// TestRefusedExportIsExplained: ganesha refuses an export whose path it
// cannot resolve to a filesystem (here one that is not there), and its
// D-Bus answer only says the block was invalid.
// LogAbout finds in its log why, naming the path; Filesystems shows what
// ganesha took for an export it did accept.
func TestRefusedExportIsExplained(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	runDir, exportDir, data := testDirs(t)
	srv := startServer(t, net, runDir, exportDir)
	c := srv.Control()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	served := Export{ID: 3, Path: data, Pseudo: "/served", Clients: []ClientRule{{Address: net.Nodes[0].Addr}}}
	if err := WriteExportFile(ExportFilePath(exportDir, served.ID), served); err != nil {
		t.Fatal(err)
	}
	if err := c.ApplyExport(ctx, ExportFilePath(exportDir, served.ID), served.ID); err != nil {
		t.Fatalf("ApplyExport of %s: %v", data, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(data, &st); err != nil {
		t.Fatal(err)
	}
	fss, err := c.Filesystems(ctx)
	if err != nil {
		t.Fatalf("Filesystems: %v", err)
	}
	if !slices.ContainsFunc(fss, func(f Filesystem) bool {
		return f.Major == uint64(unix.Major(st.Dev)) && f.Minor == uint64(unix.Minor(st.Dev))
	}) {
		t.Errorf("ganesha's filesystems %v lack device %d:%d, which holds its export %s", fss, unix.Major(st.Dev), unix.Minor(st.Dev), data)
	}

	missing := filepath.Join(t.TempDir(), "missing")
	refusedExport := Export{ID: 4, Path: missing, Pseudo: "/refused", Clients: []ClientRule{{Address: net.Nodes[0].Addr}}}
	if err := WriteExportFile(ExportFilePath(exportDir, refusedExport.ID), refusedExport); err != nil {
		t.Fatal(err)
	}
	err = c.ApplyExport(ctx, ExportFilePath(exportDir, refusedExport.ID), refusedExport.ID)
	if err == nil {
		t.Fatalf("ganesha accepted an export of a path that does not exist")
	}
	why := srv.LogAbout(missing)
	if !strings.Contains(why, missing) || !strings.Contains(why, "resolve_posix_filesystem") {
		t.Errorf("LogAbout(%s) = %q; want ganesha's reason, naming the path", missing, why)
	}
	if other := srv.LogAbout(filepath.Join(data, "elsewhere")); other != "" {
		t.Errorf("LogAbout of a path ganesha never saw = %q, want nothing", other)
	}
}

package ganesha

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
)

// TestGraceOnlyAfterAStartWithKnownClients: ganesha keeps its clients in a
// recovery database in the runtime directory. A start or restart with none
// in it has no grace period at all; a restart after a crash or a graceful
// stop with a client in it is in grace (new opens refused with
// NFS4ERR_GRACE) until the client reclaimed or, as here with libnfs, an
// NFSv4.0 client that never does, until the grace period ran out. Short
// lease and grace keep the test short; the behaviour is the same with the
// defaults.
func TestGraceOnlyAfterAStartWithKnownClients(t *testing.T) {
	requireGanesha(t)
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1})
	node := net.Nodes[0]
	runDir, exportDir, data := testDirs(t)
	const grace = 10 * time.Second
	short := func(c *ServerConfig) { c.LeaseLifetime, c.GracePeriod = 5*time.Second, grace }
	srv := startServer(t, net, runDir, exportDir, short)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	e := Export{ID: 7, Path: data, Pseudo: "/pvc-7", Clients: []ClientRule{{Address: node.Addr}}}
	confPath := ExportFilePath(exportDir, e.ID)
	if err := WriteExportFile(confPath, e); err != nil {
		t.Fatal(err)
	}
	if err := srv.Control().ApplyExport(ctx, confPath, e.ID); err != nil {
		t.Fatal(err)
	}
	local := filepath.Join(t.TempDir(), "payload")
	if err := os.WriteFile(local, []byte("payload\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	write := func(name string) error { return node.NFSCopy(ctx, local, net.NFSURL(e.Pseudo, name)) }
	inGrace := func(s *Server) bool {
		t.Helper()
		in, err := s.Control().InGrace(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return in
	}
	lastGrace := func() ganeshatest.Grace {
		t.Helper()
		periods, err := ganeshatest.ReadGracePeriods(filepath.Join(runDir, GaneshaLogName))
		if err != nil || len(periods) == 0 {
			t.Fatalf("no grace period in ganesha's log (%v)", err)
		}
		return periods[len(periods)-1]
	}
	// known lists the clients in the recovery database's current (v4recov)
	// or previous (v4old) generation; each must be the node's.
	known := func(generation string) []string {
		t.Helper()
		entries, err := os.ReadDir(filepath.Join(runDir, RecoveryDirName, generation, "node0"))
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, en := range entries {
			if !strings.HasPrefix(en.Name(), "::ffff:"+node.Addr.String()+"-(") {
				t.Errorf("unexpected client in the recovery database: %q", en.Name())
			}
			names = append(names, en.Name())
		}
		return names
	}
	crash := func() {
		t.Helper()
		old, restarts := srv.GaneshaPID(), srv.Restarts()
		if err := srv.KillGanesha(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the supervisor to start ganesha again", func() bool {
			return srv.Restarts() > restarts && srv.GaneshaPID() != 0 && srv.GaneshaPID() != old
		})
		if err := srv.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// waitOut waits for the end of grace and checks that the log agrees
	// that it ran its full length for want of RECLAIM_COMPLETE.
	waitOut := func(s *Server, knownAtStart int) {
		t.Helper()
		if err := s.WaitGraceEnded(ctx); err != nil {
			t.Fatal(err)
		}
		g := lastGrace()
		if g.Known != knownAtStart || g.EndedEarly() || g.End.Sub(g.Start) < grace-time.Second {
			t.Errorf("grace as logged: %+v; want %d known clients, none reclaimed, about %v long", g, knownAtStart, grace)
		}
		if len(known("v4old")) != 0 {
			t.Errorf("the previous generation is not emptied at the end of grace")
		}
	}

	t.Run("no known client: no grace at start or after a crash", func(t *testing.T) {
		if inGrace(srv) {
			t.Fatal("a first start is in grace")
		}
		if g := lastGrace(); g.Known != 0 || !g.EndedEarly() {
			t.Fatalf("grace as logged: %+v", g)
		}
		crash()
		if inGrace(srv) {
			t.Fatal("a restart without known clients is in grace")
		}
		if err := write("fresh"); err != nil {
			t.Fatalf("a new client right after the restart: %v", err)
		}
	})

	t.Run("crash with a known client: grace, then service", func(t *testing.T) {
		if err := write("before-crash"); err != nil {
			t.Fatal(err)
		}
		if len(known("v4recov")) == 0 {
			t.Fatal("the client is not in the recovery database")
		}
		crash()
		if !inGrace(srv) {
			t.Fatal("a restart with a known client is not in grace: the recovery database was not read")
		}
		refused(t, "a new open during grace", write("during-grace"), "NFS4ERR_GRACE")
		previous := known("v4old")
		waitOut(srv, len(previous))
		if err := write("after-grace"); err != nil {
			t.Fatalf("write after grace: %v", err)
		}
	})

	t.Run("graceful stop with a known client: grace after the next start", func(t *testing.T) {
		if err := write("before-stop"); err != nil {
			t.Fatal(err)
		}
		if err := srv.Stop(); err != nil {
			t.Fatal(err)
		}
		if len(known("v4recov")) == 0 {
			t.Fatal("a graceful stop forgot the clients")
		}
		next := startServer(t, net, runDir, exportDir, short)
		if !inGrace(next) {
			t.Fatal("a start after a graceful stop with a known client is not in grace")
		}
		refused(t, "a new open during grace", write("during-grace-2"), "NFS4ERR_GRACE")
		waitOut(next, len(known("v4old")))
		if err := write("after-grace-2"); err != nil {
			t.Fatalf("write after grace: %v", err)
		}
	})
}

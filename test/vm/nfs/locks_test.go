package nfs

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/agentapi"
)

// TestKernelNFSLockSurvivesControllerRestart: an application on vm1 holds a
// POSIX lock on a byte range of a file on an RWX volume while the
// controller is killed with SIGKILL (its ganesha dies with it) and started
// again on the same --nfs-ganesha-dir. vm1's kernel client reclaims its
// open and lock from the new ganesha; vm2 cannot take the lock while the
// server is in grace nor after it, and vm1 writes through its descriptor
// after the restart. Twice: once with a third client the server knew that
// never comes back (an NFSv4.0 libnfs client), so grace runs its full
// length, and once with every known client back, so grace ends as soon as
// they reclaimed.
func TestKernelNFSLockSurvivesControllerRestart(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestKernelNFSAccessModes and the NFS restart tests of test/integration")
	e := setup(t, 2)
	ctx, gdir := e.ctx, e.ctrl.GaneshaDir
	vm1, vm2 := e.vm("vm1"), e.vm("vm2")
	v := e.create("locks", accessmode.MultiNodeMultiWriter, nil)
	for _, n := range []string{"vm1", "vm2"} {
		wantCode(t, "start on "+n, v.start(n, "app", false), codes.OK)
	}
	path1 := filepath.Join(v.target("vm1", "app"), "shared.db")
	path2 := filepath.Join(v.target("vm2", "app"), "shared.db")
	const lockStart, lockLen = 0, 4096 // the range vm1 holds; vm2 tries [100, 110)

	holder, err := vm1.HoldLock(ctx, path1, lockStart, lockLen)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("vm1: pid %d holds a write lock on [%d, %d) of shared.db", holder.PID, lockStart, lockStart+lockLen)
	write := func(what string) {
		t.Helper()
		if err := holder.Write(ctx, 0, []byte(what+"\n")); err != nil {
			t.Fatalf("vm1 writing through the lock holder's descriptor (%s): %v", what, err)
		}
	}
	write("before the restarts")
	// try is vm2's attempt on [100, 110), which overlaps vm1's range.
	try := func(timeout time.Duration) agentapi.TryLockResponse {
		t.Helper()
		r, err := vm2.TryLock(ctx, path2, 100, 10, timeout)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("vm2 tries [100, 110): %+v", r)
		return r
	}
	mustBeDenied := func(when string) {
		t.Helper()
		r := try(time.Minute)
		if r.Outcome != agentapi.LockDenied {
			t.Fatalf("%s: vm2's F_SETLK: %s (%s), want EAGAIN: vm1 holds the range", when, r.Outcome, r.Error)
		}
		if r.Conflict == nil || r.Conflict.Type != "write" || r.Conflict.Start > 100 {
			t.Errorf("%s: F_GETLK on vm2 reports %+v, want vm1's write lock from %d", when, r.Conflict, lockStart)
		}
		// The client's own record of the lock, on vm1.
		locks, code, err := vm1.Run(ctx, "cat", "/proc/locks")
		if err != nil || code != 0 || !strings.Contains(locks, " "+strconv.Itoa(holder.PID)+" ") {
			t.Errorf("%s: vm1's /proc/locks has no lock of pid %d (%v):\n%s", when, holder.PID, err, locks)
		}
	}
	mustBeDenied("before the restarts")
	if r, err := vm2.TryLock(ctx, path2, 8192, 10, time.Minute); err != nil || r.Outcome != agentapi.LockAcquired {
		t.Fatalf("vm2 cannot lock [8192, 8202), which nobody holds: %+v, %v", r, err)
	}

	control := testenv.NFSControl(t, gdir)
	inGrace := func() bool {
		t.Helper()
		in, err := control.InGrace(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return in
	}
	restart := func() {
		t.Helper()
		g, b := testenv.NFSServerPIDs(t, gdir)
		e.ctrl.Kill()
		testenv.WaitNFSServerGone(t, gdir, g, b)
		e.ctrl.Start(ctx)
		t.Logf("controller restarted; clients in the recovery database: %q", recoveryClients(t, gdir, "v4old"))
	}
	lastGrace := func() ganeshatest.Grace {
		t.Helper()
		periods, err := ganeshatest.ReadGracePeriods(filepath.Join(gdir, ganesha.GaneshaLogName))
		if err != nil || len(periods) == 0 {
			t.Fatalf("no grace period in ganesha's log (%v)", err)
		}
		g := periods[len(periods)-1]
		t.Logf("grace: %s to %s, %d of %d known clients reclaimed", g.Start.Format(time.TimeOnly), g.End.Format(time.TimeOnly), g.Reclaimed, g.Known)
		return g
	}

	t.Log("restart 1: a known client does not come back; grace runs out, the lock holds")
	{
		// A client of the server that will not return: libnfs (NFSv4.0)
		// from the server's namespace, recorded when its id is confirmed.
		out, _ := exec.CommandContext(ctx, "nsenter", "--net="+e.c.ServerNS, "nfs-ls",
			"nfs://"+e.c.Server.String()+"/?version=4").CombinedOutput()
		if !strings.Contains(strings.Join(recoveryClients(t, gdir, "v4recov"), "\n"), "Libnfs") {
			t.Fatalf("the libnfs client is not in the recovery database (nfs-ls: %s)", out)
		}
		restart()
		if !inGrace() {
			t.Fatal("the restarted ganesha is not in grace although it knew clients")
		}
		// The kernel retries F_SETLK while the server answers
		// NFS4ERR_GRACE, so the attempt blocks or, once vm1 reclaimed, is
		// denied; it never gets the lock.
		if r := try(3 * time.Second); r.Outcome != agentapi.LockBlocked && r.Outcome != agentapi.LockDenied {
			t.Fatalf("during grace vm2's F_SETLK: %s (%s), want it blocked or denied", r.Outcome, r.Error)
		}
		write("after restart 1, in grace")
		if !inGrace() {
			t.Fatal("grace ended while vm2 tried: the attempt above was not made in grace")
		}
		testenv.WaitGraceEnded(ctx, t, gdir)
		if g := lastGrace(); g.Known != 3 || g.Reclaimed != 2 || g.EndedEarly() {
			t.Fatalf("grace as logged: %+v; want 3 known clients, the 2 VMs reclaimed, ended by its time", g)
		}
		mustBeDenied("after grace")
		write("after restart 1, grace over")
	}

	t.Log("restart 2: every known client comes back; grace ends once they reclaimed")
	{
		restart()
		write("after restart 2")
		if r := try(3 * time.Second); r.Outcome == agentapi.LockAcquired {
			t.Fatalf("vm2 took vm1's lock after the second restart")
		}
		testenv.WaitGraceEnded(ctx, t, gdir)
		g := lastGrace()
		if g.Known != 2 || !g.EndedEarly() || g.End.Sub(g.Start) >= ganesha.DefaultGracePeriod {
			t.Fatalf("grace as logged: %+v; want the 2 VMs known and reclaimed, ended before its %v", g, ganesha.DefaultGracePeriod)
		}
		mustBeDenied("after grace")
		write("after restart 2, grace over")
	}

	// vm1 lets go: now vm2 gets the range, so the refusals were vm1's lock.
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if r := try(time.Minute); r.Outcome != agentapi.LockAcquired {
		t.Fatalf("vm2 cannot lock the range vm1 released: %+v", r)
	}
	v.mustRead("vm2", "app", "shared.db", "after restart 2, grace over\n")
	v.stop("vm1", "app")
	v.stop("vm2", "app")
	v.delete()
}

// recoveryClients lists the clients in a generation (v4recov: current,
// v4old: read at the last start) of the recovery database of the ganesha
// in gdir.
func recoveryClients(t *testing.T, gdir, generation string) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(gdir, ganesha.RecoveryDirName, generation, "node0"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, en := range entries {
		names = append(names, en.Name())
	}
	return names
}

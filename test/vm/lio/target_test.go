// Package lio tests packages lio and iscsi against the LIO iSCSI target
// and the iSCSI initiator of a real kernel: the Debian kernel of test VMs
// (the host's has neither), driven by test/vm/iscsitool through the VMs'
// agents. The target is reached by two kinds of initiator: qemu-io's
// libiscsi driver on the host, in the bridge's network namespace, and the
// kernel's initiator in node VMs. Every check of who may do what is made
// by the target itself, answering them.
package lio

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

const (
	prefix   = "iqn.2026-11.io.modeguard.test"
	volume   = "vol-a"
	serial   = "6d672d766f6c2d610000000000000001"
	imageMiB = 64
)

var (
	nodeA = lio.Initiator{IQN: "iqn.2026-11.io.modeguard.node:a", User: "node-a", Secret: "secret-of-node-a"}
	nodeB = lio.Initiator{IQN: "iqn.2026-11.io.modeguard.node:b", User: "node-b", Secret: "secret-of-node-b", ReadOnly: true}
	// nodeC has credentials that look right but is on no access list.
	nodeC = lio.Initiator{IQN: "iqn.2026-11.io.modeguard.node:c", User: "node-c", Secret: "secret-of-node-c"}
)

// env is one target VM with the volume's image on its own disk, and
// node VMs.
type env struct {
	t      testing.TB
	ctx    context.Context
	c      *vmtest.Cluster
	vm     *vmtest.VM   // the target
	nodes  []*vmtest.VM // the other VMs
	tool   string
	image  string
	portal string
}

// requireQemuIO skips the test without qemu-io and its iSCSI driver.
func requireQemuIO(t *testing.T) {
	for _, tool := range []string{"qemu-io", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (Debian: qemu-utils, util-linux)", tool)
		}
	}
	if matches, _ := filepath.Glob("/usr/lib/*/qemu/block-iscsi.so"); len(matches) == 0 {
		t.Skip("qemu's iSCSI driver is not installed (Debian: qemu-block-extra)")
	}
}

// setup starts the target VM and nodes node VMs, and makes the volume's
// image on the target.
func setup(t *testing.T, nodes int) *env { return setupWith(t, nodes, "") }

// setupWith is setup with the modeguard binary bin for the node VMs'
// node plugins (vmtest.VM.StartPlugin).
func setupWith(t testing.TB, nodes int, bin string) *env {
	testenv.RequireRoot(t)
	tool := filepath.Join(t.TempDir(), "iscsitool")
	build := exec.Command("go", "build", "-race", "-o", tool, "github.com/modeguard/modeguard/test/vm/iscsitool")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building iscsitool: %v\n%s", err, out)
	}
	c := vmtest.Start(t, vmtest.Options{VMs: 1 + nodes, Prefix: "mgl", NodeDiskMB: 256, Binary: bin})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	t.Cleanup(cancel)
	vm := c.VMs[0]
	e := &env{t: t, ctx: ctx, c: c, vm: vm, nodes: c.VMs[1:], tool: tool, image: vm.Path("pool", volume+".img"),
		portal: vm.Addr.String() + ":3260"}
	e.inVM("mkdir", "-p", filepath.Dir(e.image))
	e.inVM("truncate", "-s", fmt.Sprintf("%dM", imageMiB), e.image)
	t.Cleanup(func() {
		// The kernel's LIO state goes with the VM; unexporting first
		// checks that it can be taken down piece by piece.
		if _, code, err := vm.Run(context.Background(), tool, e.flags("unexport", volume)...); err != nil || code != 0 {
			t.Errorf("unexport at cleanup: exit %d, %v", code, err)
		}
	})
	return e
}

func (e *env) flags(args ...string) []string {
	return append([]string{"-prefix", prefix, "-portal", e.portal}, args...)
}

// inVM runs a command in the target VM and fails the test unless it exits 0.
func (e *env) inVM(name string, args ...string) string {
	e.t.Helper()
	out, code, err := e.vm.Run(e.ctx, name, args...)
	if err != nil || code != 0 {
		e.t.Fatalf("%s %s in %s: exit %d, %v: %s", name, strings.Join(args, " "), e.vm.Name, code, err, out)
	}
	return out
}

func (e *env) target(args ...string) string {
	e.t.Helper()
	return e.inVM(e.tool, e.flags(args...)...)
}

func (e *env) setInitiators(list ...lio.Initiator) {
	e.t.Helper()
	js, err := json.Marshal(list)
	if err != nil {
		e.t.Fatal(err)
	}
	e.target("initiators", volume, string(js))
	e.wantAccessList(volume, list...)
}

// wantAccessList checks the target's access list of volume name: the
// initiators' names and read-only flags.
func (e *env) wantAccessList(name string, want ...lio.Initiator) {
	e.t.Helper()
	var have []lio.Initiator
	if err := json.Unmarshal([]byte(e.target("show", name)), &have); err != nil {
		e.t.Fatal(err)
	}
	got := map[string]bool{}
	for _, h := range have {
		got[h.IQN] = h.ReadOnly
	}
	if len(have) != len(want) {
		e.t.Fatalf("the target's access list is %+v, want %+v", have, want)
	}
	for _, w := range want {
		if ro, ok := got[w.IQN]; !ok || ro != w.ReadOnly {
			e.t.Fatalf("the target's access list is %+v, want %+v", have, want)
		}
	}
}

// login says how qemu-io logs in: as whom, with which secret ("" for no
// CHAP at all).
type login struct {
	iqn, user, secret string
}

func as(i lio.Initiator) login { return login{i.IQN, i.User, i.Secret} }

// qemuIOCommand is qemu-io logged in to the volume over iSCSI as l, from
// the bridge's namespace, running cmds (or reading commands from stdin
// when there are none).
func (e *env) qemuIOCommand(ctx context.Context, l login, readOnly bool, cmds ...string) *exec.Cmd {
	opts := []string{"driver=iscsi", "transport=tcp", "portal=" + e.portal,
		"target=" + prefix + ":" + volume, "lun=0", "initiator-name=" + l.iqn}
	args := []string{"--net=" + e.c.ServerNS, "--", "qemu-io"}
	if readOnly {
		args = append(args, "-r")
	}
	if l.secret != "" {
		args = append(args, "--object", "secret,id=chap,data="+l.secret)
		opts = append(opts, "user="+l.user, "password-secret=chap")
	}
	args = append(args, "--image-opts", strings.Join(opts, ","))
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	return exec.CommandContext(ctx, "nsenter", args...)
}

// qemuIO runs qemu-io's commands and returns its output. qemu-io fails to
// start when the login is refused; a command that fails says so in the
// output ("write failed: ...").
func (e *env) qemuIO(ctx context.Context, l login, readOnly bool, cmds ...string) (string, error) {
	out, err := e.qemuIOCommand(ctx, l, readOnly, cmds...).CombinedOutput()
	return string(out), err
}

// imageBytes reads n bytes of the image at off on the target, where the
// fileio backstore wrote them through.
func (e *env) imageBytes(off, n int) []byte {
	e.t.Helper()
	out := e.inVM("dd", "if="+e.image, "bs=4096", fmt.Sprintf("skip=%d", off/4096), fmt.Sprintf("count=%d", n/4096), "status=none")
	return []byte(out)
}

func filled(b []byte, v byte) bool {
	for _, x := range b {
		if x != v {
			return false
		}
	}
	return len(b) > 0
}

// TestLIOTargetEnforcesTheAccessList: a volume exported with A read/write
// and B read-only. The target lets A write, lets B read but refuses to
// open it for writing (the LUN reports write protection to B), and
// refuses the logins of a node on no list, of A with a wrong secret and
// of A without CHAP. While A holds a session: turning A read-only makes
// its next write fail at the target with DATA PROTECT; removing A from the
// list (the fence) ends its session, so its next write does not complete
// (the initiator's attempts to log in again are refused) and never reaches
// the image, and A cannot log in again while B keeps reading. Unexporting
// removes everything from configfs and leaves the image.
func TestLIOTargetEnforcesTheAccessList(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIModesOnTwoNodes, which checks the access list and read-only writers against the kernel initiator")
	requireQemuIO(t)
	e := setup(t, 0)
	e.target("export", volume, e.image, fmt.Sprint(imageMiB<<20), serial)
	e.setInitiators(nodeA, nodeB)

	t.Run("A writes, B reads", func(t *testing.T) {
		out, err := e.qemuIO(e.ctx, as(nodeA), false, "write -P 0x5a 0 64k", "read -P 0x5a 0 64k")
		if err != nil || !strings.Contains(out, "wrote 65536/65536") || !strings.Contains(out, "read 65536/65536") {
			t.Fatalf("A writing: %v\n%s", err, out)
		}
		if !filled(e.imageBytes(0, 65536), 0x5a) {
			t.Fatal("A's acknowledged write is not in the image on the target")
		}
		out, err = e.qemuIO(e.ctx, as(nodeB), true, "read -P 0x5a 0 64k")
		if err != nil || !strings.Contains(out, "read 65536/65536") {
			t.Fatalf("B reading: %v\n%s", err, out)
		}
		out, err = e.qemuIO(e.ctx, as(nodeB), false, "write -P 0x66 0 4k")
		if err == nil || strings.Contains(out, "wrote") {
			t.Fatalf("B opened its read-only LUN for writing: %v\n%s", err, out)
		}
		t.Logf("B read/write: %s", strings.TrimSpace(out))
		if !filled(e.imageBytes(0, 65536), 0x5a) {
			t.Fatal("the image changed under a read-only initiator")
		}
	})

	t.Run("strangers are refused", func(t *testing.T) {
		for name, l := range map[string]login{
			"C, on no list":      as(nodeC),
			"A, wrong secret":    {nodeA.IQN, nodeA.User, "not-the-secret-of-a"},
			"A, no CHAP":         {nodeA.IQN, "", ""},
			"B's secret as A":    {nodeA.IQN, nodeB.User, nodeB.Secret},
			"C with A's secret":  {nodeC.IQN, nodeA.User, nodeA.Secret},
			"A's name, B's user": {nodeA.IQN, nodeB.User, nodeA.Secret},
		} {
			out, err := e.qemuIO(e.ctx, l, true, "read 0 4k")
			if err == nil || strings.Contains(out, "read 4096/4096") {
				t.Errorf("%s logged in: %v\n%s", name, err, out)
			}
		}
	})

	t.Run("A turned read-only mid-session", func(t *testing.T) {
		e.setInitiators(nodeA, nodeB)
		a := e.openSession(as(nodeA))
		if out, ok := a.do("write -P 0x11 0 64k", time.Minute); !ok || !strings.Contains(out, "wrote 65536/65536") {
			t.Fatalf("A writing before the change: %s", out)
		}
		ro := nodeA
		ro.ReadOnly = true
		e.setInitiators(ro, nodeB)
		if out, ok := a.do("write -P 0x22 64k 64k", time.Minute); !ok || !strings.Contains(out, "write failed") || !strings.Contains(out, "DATA PROTECTION") {
			t.Fatalf("A's write after it was made read-only did not fail with DATA PROTECTION: %s", out)
		}
		if out, ok := a.do("read -P 0x11 0 64k", time.Minute); !ok || strings.Contains(out, "failed") {
			t.Fatalf("A could not read after it was made read-only: %s", out)
		}
		a.close()
		if filled(e.imageBytes(65536, 65536), 0x22) {
			t.Fatal("A's refused write reached the image")
		}
	})

	t.Run("A fenced mid-session", func(t *testing.T) {
		e.setInitiators(nodeA, nodeB)
		a := e.openSession(as(nodeA))
		if out, ok := a.do("write -P 0x33 0 64k", time.Minute); !ok || !strings.Contains(out, "wrote 65536/65536") {
			t.Fatalf("A writing before the fence: %s", out)
		}
		e.setInitiators(nodeB)
		// The session is gone: the write either fails or never completes
		// (the initiator keeps trying to log in again, and is refused);
		// it must not succeed, and must not reach the image.
		out, ok := a.do("write -P 0x22 64k 64k", 20*time.Second)
		if strings.Contains(out, "wrote") {
			t.Fatalf("A's write after the fence succeeded: %s", out)
		}
		t.Logf("A's write after the fence: %s", map[bool]string{true: strings.TrimSpace(out), false: "no answer within 20 s"}[ok])
		a.close()
		if filled(e.imageBytes(65536, 65536), 0x22) {
			t.Fatal("A's write after the fence reached the image")
		}
		out, err := e.qemuIO(e.ctx, as(nodeA), true, "read 0 4k")
		if err == nil || strings.Contains(out, "read 4096/4096") {
			t.Fatalf("A logged in again after the fence: %v\n%s", err, out)
		}
		out, err = e.qemuIO(e.ctx, as(nodeB), true, "read -P 0x33 0 64k")
		if err != nil || !strings.Contains(out, "read 65536/65536") {
			t.Fatalf("B lost access with A's fence: %v\n%s", err, out)
		}
	})

	t.Run("unexport", func(t *testing.T) {
		e.target("unexport", volume)
		// Neither the target nor a backstore of the volume's name, in
		// whichever HBA, is left.
		glob := fmt.Sprintf("ls -d %[1]s/iscsi/%[2]s:%[3]s %[1]s/core/*/%[3]s 2>/dev/null", lio.DefaultRoot, prefix, volume)
		if out, _, err := e.vm.Run(e.ctx, "sh", "-c", glob); err != nil || strings.TrimSpace(out) != "" {
			t.Errorf("left in configfs after unexport: %q (%v)", out, err)
		}
		if !filled(e.imageBytes(0, 65536), 0x33) {
			t.Error("the image lost its data at unexport")
		}
		out, err := e.qemuIO(e.ctx, as(nodeB), true, "read 0 4k")
		if err == nil || strings.Contains(out, "read 4096/4096") {
			t.Fatalf("B read an unexported volume: %v\n%s", err, out)
		}
		// Exporting again serves the same data.
		e.target("export", volume, e.image, fmt.Sprint(imageMiB<<20), serial)
		e.setInitiators(nodeB)
		out, err = e.qemuIO(e.ctx, as(nodeB), true, "read -P 0x33 0 64k")
		if err != nil || !strings.Contains(out, "read 65536/65536") {
			t.Fatalf("B reading after a new export: %v\n%s", err, out)
		}
	})
}

// session is an interactive qemu-io logged in to the volume: one iSCSI
// session the test sends commands through, one at a time.
type session struct {
	t      testing.TB
	cancel context.CancelFunc
	in     io.WriteCloser
	lines  chan string
	done   chan struct{}
}

// openSession logs l in read/write and keeps the session open.
func (e *env) openSession(l login) *session {
	e.t.Helper()
	ctx, cancel := context.WithCancel(e.ctx)
	cmd := e.qemuIOCommand(ctx, l, false)
	in, err := cmd.StdinPipe()
	if err != nil {
		e.t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		e.t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	s := &session{t: e.t, cancel: cancel, in: in, lines: make(chan string, 100), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		cmd.Wait()
		close(s.done)
	}()
	e.t.Cleanup(s.close)
	return s
}

// do sends one command and returns its output up to the line that gives
// its outcome, and whether that line came within wait.
func (s *session) do(command string, wait time.Duration) (string, bool) {
	s.t.Helper()
	if _, err := io.WriteString(s.in, command+"\n"); err != nil {
		return "writing to qemu-io: " + err.Error(), false
	}
	var out strings.Builder
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case line := <-s.lines:
			out.WriteString(line + "\n")
			// qemu-io's prompt may precede the line; the driver's own
			// messages ("qemu-io: iSCSI WRITE10/16 failed ...") come
			// before the outcome and are not one.
			line = strings.TrimPrefix(line, "qemu-io> ")
			for _, outcome := range []string{"wrote ", "read ", "write failed", "read failed", "Pattern verification failed"} {
				if strings.HasPrefix(line, outcome) {
					return out.String(), true
				}
			}
		case <-s.done:
			return out.String() + "(qemu-io exited)", false
		case <-timer.C:
			return out.String(), false
		}
	}
}

// close ends qemu-io (killing it if it hangs on a session that cannot come
// back) and waits for it.
func (s *session) close() {
	s.in.Close()
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		s.cancel()
		<-s.done
	}
	s.cancel()
}

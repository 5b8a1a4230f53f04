package lio

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/backend/block/served"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// targetRole is `modeguard --roles target` running in the target VM.
type targetRole struct {
	e    *env
	args []string
	log  string
	api  remote.Target
}

// start runs the role in the background in the target VM (its log on the
// host, through 9p), waits until its API answers and takes its lease, as a
// controller does.
func (r *targetRole) start() *remote.Client {
	r.e.t.Helper()
	c := r.launch()
	if err := c.Hold(r.e.ctx, "test-controller", func(string) {}); err != nil {
		r.e.t.Fatal(err)
	}
	return c
}

// launch runs the role and returns a client once its API answers,
// without taking the lease (for a controller process to take).
func (r *targetRole) launch() *remote.Client {
	r.e.t.Helper()
	runInVM(r.e.t, r.e.ctx, r.e.vm, r.log, r.args...)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ctx, cancel := context.WithTimeout(r.e.ctx, 5*time.Second)
		c, err := remote.Dial(ctx, r.api)
		cancel()
		if err == nil {
			return c
		}
		if time.Now().After(deadline) {
			data, _ := os.ReadFile(r.log)
			r.e.t.Fatalf("the target role does not answer: %v\n%s", err, data)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// kill ends the role with SIGKILL, as a crash would.
func (r *targetRole) kill() { r.e.t.Helper(); killInVM(r.e.t, r.e.ctx, r.e.vm, r.log) }

// runInVM runs args in the background in vm, its output appended to log
// (a host path, which the VM sees through 9p) and its PID in log.pid.
func runInVM(t testing.TB, ctx context.Context, vm *vmtest.VM, log string, args ...string) {
	t.Helper()
	script := `"$@" >> "$LOG" 2>&1 < /dev/null & echo $! > "$LOG.pid"`
	if out, code, err := vm.Run(ctx, "env", append([]string{"LOG=" + log, "sh", "-c", script, "sh"}, args...)...); err != nil || code != 0 {
		t.Fatalf("starting %s in %s: exit %d, %v: %s", filepath.Base(args[0]), vm.Name, code, err, out)
	}
}

// killInVM sends SIGKILL to what runInVM started with log, by its PID,
// and waits until it is gone.
func killInVM(t testing.TB, ctx context.Context, vm *vmtest.VM, log string) {
	t.Helper()
	if out, code, err := vm.Run(ctx, "sh", "-c", `kill -9 "$(cat "$1")"; while kill -0 "$(cat "$1")" 2>/dev/null; do sleep 0.1; done`, "sh", log+".pid"); err != nil || code != 0 {
		t.Fatalf("killing %s in %s: exit %d, %v: %s", log, vm.Name, code, err, out)
	}
}

// attachment is node's attachment in the id its node plugin would report.
func attachment(node string, i lio.Initiator, mode accessmode.Mode) accessmode.Attachment {
	id := nodeid.Node{Name: node, Zone: "zone-a", Initiator: i.IQN}
	return accessmode.Attachment{Node: id, Mode: mode, ReadOnly: i.ReadOnly}
}

// TestTargetRoleServesAttachmentsOverISCSI: the storage target role of
// the binary, in the target VM with LIO, driven through its mutual-TLS
// API as the controller drives it. Its volume's iSCSI access list follows
// SetAttachments: a node not attached is refused at login; a read-only
// attachment is write-protected at the target; detaching the writer (what
// every ControllerUnpublishVolume does, a force-detach included) fails
// its next write before SetAttachments returns to the next writer; a
// restarted target serves the same list again; DeleteVolume leaves
// nothing in LIO.
func TestTargetRoleServesAttachmentsOverISCSI(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIFencesAForceDetachedWriter, which drives the target role through CSI")
	requireInitiatorTools(t)
	bin := testenv.BuildBinary(t)
	e := setup(t, 2)
	a, b := e.nodes[0], e.nodes[1]
	for vm, i := range map[*vmtest.VM]lio.Initiator{a: nodeA, b: nodeB} {
		if err := vm.StartISCSIInitiator(e.ctx, i.IQN); err != nil {
			t.Fatal(err)
		}
	}
	// The nodes' CHAP secrets, one file per node key, as a mounted Secret.
	chap := filepath.Join(t.TempDir(), "chap")
	if err := os.Mkdir(chap, 0o700); err != nil {
		t.Fatal(err)
	}
	for node, i := range map[string]lio.Initiator{"node-a": nodeA, "node-b": nodeB} {
		if err := os.WriteFile(filepath.Join(chap, node), []byte(i.Secret+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	authority := certs.NewCA(t, "modeguard")
	server := authority.Server(e.vm.Addr.String())
	api := net.JoinHostPort(e.vm.Addr.String(), "9443")
	dialer := e.c.Dialer()
	pool := e.vm.Path("served-pool")
	e.inVM("mkdir", "-p", pool)
	role := &targetRole{e: e, log: filepath.Join(t.TempDir(), "target.log"),
		args: []string{bin, "--roles", "target", "--block-pool", "zone-a=" + pool, "--block-pool-filesystem=direct",
			"--target-endpoint", "tcp://" + api, "--tls-cert", server.Cert, "--tls-key", server.Key, "--tls-ca", server.CA,
			"--iscsi-portal", e.portal, "--iscsi-iqn-prefix", prefix, "--iscsi-chap-dir", chap, "-v", "2"},
		api: remote.Target{Address: api, TLS: remote.TLSFiles(authority.Client("controller")),
			Dial: func(ctx context.Context, _, addr string) (net.Conn, error) { return dialer(ctx, addr) }},
	}
	ctrl := role.start()
	t.Cleanup(func() {
		ctrl.Close()
		role.kill()
		if t.Failed() {
			data, _ := os.ReadFile(role.log)
			t.Logf("target role log:\n%s", data)
		}
	})

	id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "served"))
	if err != nil {
		t.Fatal(err)
	}
	const size = 32 << 20
	vol, err := ctrl.CreateVolume(e.ctx, backend.VolumeSpec{ID: id, Name: "served", CapacityBytes: size, AccessType: accessmode.Block,
		Modes: []accessmode.Mode{accessmode.MultiNodeSingleWriter}})
	if err != nil {
		t.Fatal(err)
	}
	if vol.Context[iscsi.ContextTransport] != iscsi.TransportName || vol.Context[iscsi.ContextPortal] != e.portal ||
		vol.Context[iscsi.ContextSerial] != served.Serial(id) || !strings.HasPrefix(vol.Context[iscsi.ContextTarget], prefix+":") {
		t.Fatalf("the volume context does not say how to reach the volume: %v", vol.Context)
	}
	target := func(i lio.Initiator, user string) iscsi.Target {
		return iscsi.Target{IQN: vol.Context[iscsi.ContextTarget], Portal: netip.MustParseAddrPort(e.portal), User: user, Secret: i.Secret}
	}
	login := func(vm *vmtest.VM, tg iscsi.Target) (iscsi.Disk, string, int) {
		return e.loginTo(vm, tg, vol.Context[iscsi.ContextSerial])
	}
	set := func(list ...accessmode.Attachment) {
		t.Helper()
		if _, err := ctrl.SetAttachments(e.ctx, id, list); err != nil {
			t.Fatalf("SetAttachments: %v", err)
		}
	}
	writerA := attachment("node-a", lio.Initiator{IQN: nodeA.IQN}, accessmode.MultiNodeSingleWriter)
	readerB := attachment("node-b", lio.Initiator{IQN: nodeB.IQN, ReadOnly: true}, accessmode.MultiNodeSingleWriter)
	writerB := attachment("node-b", lio.Initiator{IQN: nodeB.IQN}, accessmode.MultiNodeSingleWriter)

	var diskA iscsi.Disk
	t.Run("only the attached node gets in", func(t *testing.T) {
		if _, out, code := login(b, target(nodeB, "node-b")); code == 0 || !strings.Contains(out, iscsi.ErrLoginRefused.Error()) {
			t.Fatalf("B logged in to a volume attached to no one: exit %d: %s", code, out)
		}
		set(writerA)
		var out string
		var code int
		if diskA, out, code = login(a, target(nodeA, "node-a")); code != 0 {
			t.Fatalf("A logging in once attached: exit %d: %s", code, out)
		}
		if err := diskA.Check(size, false); err != nil {
			t.Fatal(err)
		}
		if out, code := writeBlock(e, a, diskA.Device, 0, 'A'); code != 0 {
			t.Fatalf("A writing: exit %d: %s", code, out)
		}
	})

	t.Run("a reader is write-protected at the target", func(t *testing.T) {
		set(writerA, readerB)
		diskB, out, code := login(b, target(nodeB, "node-b"))
		if code != 0 {
			t.Fatalf("B logging in as a reader: exit %d: %s", code, out)
		}
		if err := diskB.Check(size, true); err != nil {
			t.Fatal(err)
		}
		if out, code := sgWrite(e, b, diskB.Device, 1, 'B'); code == 0 || !strings.Contains(out, "Data Protect") {
			t.Fatalf("the target took the reader's write: exit %d: %s", code, out)
		}
		if got := readBlock(e, b, diskB.Device, 0); !filled(got, 'A') {
			t.Fatalf("B reads %q, not A's write", got[:16])
		}
		e.logoutOf(b, vol.Context[iscsi.ContextTarget])
	})

	var diskB iscsi.Disk
	t.Run("detaching the writer fences it", func(t *testing.T) {
		set(writerB) // A detached, B the writer: one call, as a force-detach and the next attach make
		if out, code := writeBlock(e, a, diskA.Device, 2, 'X'); code == 0 {
			t.Fatalf("A wrote after it was detached: %s", out)
		}
		var out string
		var code int
		if diskB, out, code = login(b, target(nodeB, "node-b")); code != 0 {
			t.Fatalf("B logging in as the writer: exit %d: %s", code, out)
		}
		if err := diskB.Check(size, false); err != nil {
			t.Fatal(err)
		}
		if got := readBlock(e, b, diskB.Device, 2); !filled(got, 0) {
			t.Fatalf("A's write after its detach reached the volume: B reads %q", got[:16])
		}
		if out, code := writeBlock(e, b, diskB.Device, 3, 'B'); code != 0 {
			t.Fatalf("B writing: exit %d: %s", code, out)
		}
		e.logoutOf(a, vol.Context[iscsi.ContextTarget])
		if _, out, code := login(a, target(nodeA, "node-a")); code == 0 || !strings.Contains(out, iscsi.ErrLoginRefused.Error()) {
			t.Fatalf("A logged in again after its detach: exit %d: %s", code, out)
		}
	})

	t.Run("a restarted target serves the same list, and the session comes back", func(t *testing.T) {
		// C, attached as a reader, has no secret on the target yet: the
		// attach is refused, saying why.
		readerC := attachment("node-c", lio.Initiator{IQN: nodeC.IQN, ReadOnly: true}, accessmode.MultiNodeSingleWriter)
		if _, err := ctrl.SetAttachments(e.ctx, id, []accessmode.Attachment{writerB, readerC}); status.Code(err) != codes.FailedPrecondition ||
			!strings.Contains(err.Error(), "no CHAP secret") {
			t.Fatalf("attaching a node without a secret: %v", err)
		}
		if err := os.WriteFile(filepath.Join(chap, "node-c"), []byte(nodeC.Secret), 0o600); err != nil {
			t.Fatal(err)
		}
		set(writerB, readerC)
		// Its secret goes away while the target is down: the restarted
		// target leaves C out and serves B as before.
		if err := os.Remove(filepath.Join(chap, "node-c")); err != nil {
			t.Fatal(err)
		}
		ctrl.Close()
		role.kill()
		// As after a reboot of the target's host: LIO forgot the volume,
		// and B's session is lost.
		lun := strings.TrimPrefix(vol.Context[iscsi.ContextTarget], prefix+":")
		e.target("unexport", lun)
		ctrl = role.start()
		e.wantAccessList(lun, lio.Initiator{IQN: nodeB.IQN})
		// iscsid logs B in again by itself; its disk then reads what it
		// wrote before.
		deadline := time.Now().Add(2 * time.Minute)
		for {
			out, code, err := b.Run(e.ctx, "dd", "if="+diskB.Device, "bs=4096", "skip=3", "count=1", "iflag=direct", "status=none")
			if err == nil && code == 0 && filled([]byte(out), 'B') {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("B's disk does not come back after the target's restart: exit %d, %v", code, err)
			}
			time.Sleep(time.Second)
		}
	})

	t.Run("delete leaves nothing", func(t *testing.T) {
		e.logoutOf(b, vol.Context[iscsi.ContextTarget])
		if _, err := ctrl.SetAttachments(e.ctx, id, nil); err != nil {
			t.Fatal(err)
		}
		if err := ctrl.DeleteVolume(e.ctx, id); err != nil {
			t.Fatal(err)
		}
		glob := fmt.Sprintf("ls -d %[1]s/iscsi/%[2]s %[1]s/core/*/%[3]s 2>/dev/null", lio.DefaultRoot, vol.Context[iscsi.ContextTarget],
			strings.TrimPrefix(vol.Context[iscsi.ContextTarget], prefix+":"))
		if out, _, err := e.vm.Run(e.ctx, "sh", "-c", glob); err != nil || strings.TrimSpace(out) != "" {
			t.Errorf("left in configfs after DeleteVolume: %q (%v)", out, err)
		}
	})
}

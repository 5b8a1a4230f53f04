package vmtest_test

import (
	"bufio"
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/agentapi"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// controller is the modeguard controller, run inside the cluster's server
// namespace so that the ganesha it starts serves the VMs.
type controller struct {
	cmd  *exec.Cmd
	done chan struct{}
	log  string
	conn *grpc.ClientConn
}

func startController(t *testing.T, ctx context.Context, c *vmtest.Cluster, bin, work string) *controller {
	t.Helper()
	endpoint := "unix://" + filepath.Join(work, "csi.sock")
	ctrl := &controller{log: filepath.Join(work, "controller.log"), done: make(chan struct{})}
	logFile, err := os.Create(ctrl.log)
	if err != nil {
		t.Fatal(err)
	}
	ctrl.cmd = exec.Command("nsenter", "--net="+c.ServerNS, "--", bin,
		"--roles", "controller", "--endpoint", endpoint, "-v", "2",
		"--nfs-export-root", filepath.Join(work, "nfs"), "--nfs-pool-size", "1Gi",
		"--nfs-server", c.Server.String(), "--nfs-ganesha-dir", filepath.Join(work, "ganesha"))
	ctrl.cmd.Stdout, ctrl.cmd.Stderr = logFile, logFile
	ctrl.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := ctrl.cmd.Start(); err != nil {
		logFile.Close()
		t.Fatal(err)
	}
	go func() { ctrl.cmd.Wait(); logFile.Close(); close(ctrl.done) }()
	t.Cleanup(func() {
		if ctrl.conn != nil {
			ctrl.conn.Close()
		}
		select {
		case <-ctrl.done:
		default:
			_ = ctrl.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-ctrl.done:
			case <-time.After(30 * time.Second):
				t.Errorf("the controller did not stop on SIGTERM; killing it")
				_ = ctrl.cmd.Process.Signal(syscall.SIGKILL)
				<-ctrl.done
			}
		}
		testenv.CleanupUnder(t, work)
		if t.Failed() {
			data, _ := os.ReadFile(ctrl.log)
			t.Logf("controller log:\n%s", data)
		}
	})
	ctrl.conn, err = grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	id := csi.NewIdentityClient(ctrl.conn)
	for deadline := time.Now().Add(60 * time.Second); ; {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := id.Probe(pctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && resp.GetReady().GetValue() {
			return ctrl
		}
		select {
		case <-ctrl.done:
			t.Fatalf("the controller exited during start-up: %v", ctrl.cmd.ProcessState)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the controller is not ready after 60 s: %v", err)
		}
	}
}

// mountLine returns the line of /proc/self/mounts inside vm whose mount
// point is path, or "".
func mountLine(t *testing.T, ctx context.Context, vm *vmtest.VM, path string) string {
	t.Helper()
	data, err := vm.ReadFile(ctx, "/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) > 2 && f[1] == path {
			return sc.Text()
		}
	}
	return ""
}

// TestVMKernelNFSMount runs the node plugin in a VM whose kernel has an NFS
// client: the volume the controller exports to vm1 is mounted by vm1's
// kernel through NodeStage, bind-mounted by NodePublish, written to there
// and the data found on the server; vm2, to which the volume is not
// published, cannot mount the export at all.
func TestVMKernelNFSMount(t *testing.T) {
	testenv.OnlyInTestAll(t, "the VM tests make test runs, which use the same harness")
	testenv.RequireRoot(t)
	for _, tool := range []string{"ganesha.nfsd", "dbus-daemon", "nsenter", "mkfs.xfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed", tool)
		}
	}
	work := t.TempDir()
	bin := filepath.Join(work, "modeguard")
	t0 := time.Now()
	if out, err := exec.Command("go", "build", "-race", "-o", bin, "github.com/modeguard/modeguard/cmd/modeguard").CombinedOutput(); err != nil {
		t.Fatalf("building modeguard: %v\n%s", err, out)
	}
	t.Logf("built modeguard -race in %s", time.Since(t0).Round(time.Millisecond))

	t0 = time.Now()
	c := vmtest.Start(t, vmtest.Options{VMs: 2, Binary: bin})
	t.Logf("timing: boot of 2 VMs (image cached or built, agents answering): %s", time.Since(t0).Round(time.Millisecond))
	vm1, vm2 := c.VMs[0], c.VMs[1]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	ctrl := startController(t, ctx, c, bin, work)
	cc := csi.NewControllerClient(ctrl.conn)

	t0 = time.Now()
	if err := vm1.StartPlugin(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("timing: node plugin (-race) start in vm1 until its port answers: %s", time.Since(t0).Round(time.Millisecond))
	nodeConn, err := grpc.NewClient("passthrough:///"+vm1.NodeEndpoint(),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(c.Dialer()))
	if err != nil {
		t.Fatal(err)
	}
	defer nodeConn.Close()
	node := csi.NewNodeClient(nodeConn)
	info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatalf("NodeGetInfo through the VM: %v", err)
	}
	nodeID := "vm1@zone-a@" + vm1.Addr.String() + "@128"
	if info.GetNodeId() != nodeID || vm1.NodeID() != nodeID {
		t.Fatalf("vm1's node id is %q (VM.NodeID %q), want %q", info.GetNodeId(), vm1.NodeID(), nodeID)
	}

	capability := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
	created, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "vm-smoke", CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{capability},
		Parameters:         map[string]string{"backend": "nfs"},
	})
	if err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	vol := created.GetVolume()
	volID := vol.GetVolumeId()
	share := vol.GetVolumeContext()["nfsShare"]
	t.Logf("volume %s, context %v", volID, vol.GetVolumeContext())
	if share == "" {
		t.Fatalf("no nfsShare in the volume context %v", vol.GetVolumeContext())
	}

	published, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: nodeID, VolumeCapability: capability,
		VolumeContext: vol.GetVolumeContext(),
	})
	if err != nil {
		t.Fatalf("ControllerPublishVolume to vm1: %v", err)
	}

	staging := vm1.Path("plugins", "staging", "pv-smoke")
	target := vm1.Path("pods", "pod-1", "volumes", "pv-smoke")
	t0 = time.Now()
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, VolumeCapability: capability,
		VolumeContext: vol.GetVolumeContext(), PublishContext: published.GetPublishContext(),
	}); err != nil {
		t.Fatalf("NodeStageVolume in vm1: %v", err)
	}
	t.Logf("timing: NodeStageVolume (kernel NFS mount in vm1): %s", time.Since(t0).Round(time.Millisecond))
	line := mountLine(t, ctx, vm1, staging)
	if f := strings.Fields(line); len(f) < 3 || f[2] != "nfs4" {
		t.Fatalf("the staging path in vm1 is not an nfs4 mount: %q", line)
	}
	t.Logf("vm1: %s", line)

	t0 = time.Now()
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: volID, StagingTargetPath: staging, TargetPath: target, VolumeCapability: capability,
		VolumeContext: vol.GetVolumeContext(), PublishContext: published.GetPublishContext(),
	}); err != nil {
		t.Fatalf("NodePublishVolume in vm1: %v", err)
	}
	t.Logf("timing: NodePublishVolume (bind mount in vm1): %s", time.Since(t0).Round(time.Millisecond))
	if line := mountLine(t, ctx, vm1, target); !strings.Contains(line, " nfs4 ") {
		t.Fatalf("the target path in vm1 is not the NFS mount: %q", line)
	}

	payload := []byte("written by vm1's kernel NFS client\n")
	t0 = time.Now()
	if err := vm1.WriteFile(ctx, filepath.Join(target, "hello.txt"), payload); err != nil {
		t.Fatalf("writing through the target path: %v", err)
	}
	t.Logf("timing: write+fsync of %d bytes through the target path: %s", len(payload), time.Since(t0).Round(time.Millisecond))
	if got, err := vm1.ReadFile(ctx, filepath.Join(target, "hello.txt")); err != nil || string(got) != string(payload) {
		t.Fatalf("reading it back in vm1: %q, %v", got, err)
	}

	// On the server: the file is in the volume's directory of the export root.
	var found []string
	filepath.WalkDir(filepath.Join(work, "nfs"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == "hello.txt" {
			found = append(found, p)
		}
		return nil
	})
	if len(found) != 1 {
		t.Fatalf("hello.txt is %d times under the export root %s: %v", len(found), filepath.Join(work, "nfs"), found)
	}
	if got, err := os.ReadFile(found[0]); err != nil || string(got) != string(payload) {
		t.Fatalf("on the server, %s holds %q (%v), want %q", found[0], got, err, payload)
	}
	t.Logf("the server has it at %s", found[0])

	// vm2 has no publish: the server must refuse a mount by hand.
	mnt := vm2.Path("by-hand")
	if out, code, err := vm2.Run(ctx, "mkdir", "-p", mnt); err != nil || code != 0 {
		t.Fatalf("mkdir in vm2: %d %v %s", code, err, out)
	}
	t0 = time.Now()
	out, code, err := vm2.Run(ctx, "mount", "-t", "nfs4", "-o",
		"vers=4.2,retry=0,addr="+c.Server.String()+",clientaddr="+vm2.Addr.String(),
		c.Server.String()+":"+share, mnt)
	if err != nil {
		t.Fatal(err)
	}
	if code == 0 {
		vm2.Run(ctx, "umount", mnt)
		t.Fatalf("vm2 mounted %s although the volume is published to vm1 only", share)
	}
	t.Logf("vm2's mount was refused in %s (exit %d): %s", time.Since(t0).Round(time.Millisecond), code, strings.TrimSpace(out))
	if line := mountLine(t, ctx, vm2, mnt); line != "" {
		t.Fatalf("vm2 has a mount at %s: %s", mnt, line)
	}

	// Clean up in CO order.
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	mounts, err := vm1.ReadFile(ctx, "/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mounts), " nfs4 ") {
		t.Fatalf("vm1 still has an NFS mount after unstage:\n%s", mounts)
	}
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: nodeID}); err != nil {
		t.Fatalf("ControllerUnpublishVolume: %v", err)
	}
	if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volID}); err != nil {
		t.Fatalf("DeleteVolume: %v", err)
	}
	if err := vm1.KillPlugin(ctx); err != nil {
		t.Fatal(err)
	}
	if log, err := vm1.PluginLog(ctx); err != nil || !strings.Contains(log, "Volume staged") {
		t.Errorf("vm1's plugin log (%v) does not tell of the stage:\n%s", err, log)
	}
}

// TestVMAgent checks the harness itself on one VM: commands, files with
// their errno, and the plugin's start, restart, kill and a start that fails.
func TestVMAgent(t *testing.T) {
	testenv.OnlyInTestAll(t, "the VM tests make test runs, which use the same harness")
	testenv.RequireRoot(t)
	bin := filepath.Join(t.TempDir(), "modeguard")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/modeguard/modeguard/cmd/modeguard").CombinedOutput(); err != nil {
		t.Fatalf("building modeguard: %v\n%s", err, out)
	}
	c := vmtest.Start(t, vmtest.Options{VMs: 1, Binary: bin, Prefix: "mgva"})
	vm := c.VMs[0]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	out, code, err := vm.Run(ctx, "sh", "-c", "echo out; echo err >&2; exit 3")
	if err != nil || code != 3 || out != "out\nerr\n" {
		t.Errorf("Run: %q %d %v", out, code, err)
	}
	if out, code, err := vm.Run(ctx, "uname", "-r"); err != nil || code != 0 || !strings.HasSuffix(strings.TrimSpace(out), "-amd64") {
		t.Errorf("the VM should run Debian's kernel: %q %d %v", out, code, err)
	}
	if out, code, err := vm.Run(ctx, "hostname"); err != nil || code != 0 || strings.TrimSpace(out) != vm.Name {
		t.Errorf("the VM's host name (its NFS client's identity): %q %d %v; want %s", out, code, err, vm.Name)
	}
	if _, code, err := vm.Run(ctx, "no-such-command-here"); err != nil || code != 127 {
		t.Errorf("a missing command: exit %d, %v; want 127", code, err)
	}
	if out, code, err := vm.Run(ctx, "sh", "-c", "kill -KILL $$"); err != nil || code != 128+9 {
		t.Errorf("a killed command: exit %d, %v, %q; want 137", code, err, out)
	}

	p := vm.Path("dir", "f")
	if err := vm.WriteFile(ctx, p, []byte("x")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("writing below a missing directory: %v, want ENOENT", err)
	}
	if _, code, _ := vm.Run(ctx, "mkdir", vm.Path("dir")); code != 0 {
		t.Fatal("mkdir failed")
	}
	if err := vm.WriteFile(ctx, p, []byte("data")); err != nil {
		t.Fatal(err)
	}
	if got, err := vm.ReadFile(ctx, p); err != nil || string(got) != "data" {
		t.Errorf("ReadFile: %q %v", got, err)
	}
	if _, err := os.Stat(p); err == nil {
		t.Errorf("%s exists on the host: Path must be VM-local", p)
	}
	// POSIX locks, each held or tried by a process of its own.
	lk := vm.Path("dir", "locked")
	holder, err := vm.HoldLock(ctx, lk, 10, 20)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := vm.TryLock(ctx, lk, 25, 1, time.Minute); err != nil || r.Outcome != agentapi.LockDenied || r.Errno != int(syscall.EAGAIN) ||
		r.Conflict == nil || *r.Conflict != (agentapi.LockRange{Type: "write", Start: 10, Len: 20, PID: holder.PID}) {
		t.Errorf("trying a held range: %+v (conflict %+v), %v; want denied by pid %d's [10, 30)", r, r.Conflict, err, holder.PID)
	}
	if r, err := vm.TryLock(ctx, lk, 30, 0, time.Minute); err != nil || r.Outcome != agentapi.LockAcquired {
		t.Errorf("trying the free rest of the file: %+v, %v", r, err)
	}
	if err := holder.Write(ctx, 3, []byte("abc")); err != nil {
		t.Fatal(err)
	}
	if got, err := vm.ReadFile(ctx, lk); err != nil || string(got) != "\x00\x00\x00abc" {
		t.Errorf("written through the holder: %q %v", got, err)
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := vm.TryLock(ctx, lk, 0, 0, time.Minute); err != nil || r.Outcome != agentapi.LockAcquired {
		t.Errorf("trying the whole file after the release: %+v, %v", r, err)
	}
	if err := holder.Write(ctx, 0, []byte("x")); err == nil {
		t.Errorf("a released holder still writes")
	}
	if r, err := vm.TryLock(ctx, vm.Path("dir", "missing"), 0, 0, time.Minute); err != nil || r.Outcome != agentapi.LockFailed || r.Errno != int(syscall.ENOENT) {
		t.Errorf("trying a missing file: %+v, %v; want failed with ENOENT", r, err)
	}
	if _, err := vm.HoldLock(ctx, vm.Path("no-dir", "f"), 0, 0); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("holding a lock below a missing directory: %v, want ENOENT", err)
	}

	if _, code, _ := vm.Run(ctx, "mount", "-o", "remount,ro", vm.Path()); code != 0 {
		t.Fatal("remounting the VM-local tmpfs read-only failed")
	}
	err = vm.WriteFile(ctx, p, []byte("more"))
	if !errors.Is(err, syscall.EROFS) || !strings.Contains(err.Error(), "read-only file system") {
		t.Errorf("writing to a read-only filesystem: %v", err)
	}
	if _, code, _ := vm.Run(ctx, "mount", "-o", "remount,rw", vm.Path()); code != 0 {
		t.Fatal("remounting the VM-local tmpfs read-write failed")
	}

	if err := vm.StartPlugin(ctx, "--no-such-flag"); err == nil || !strings.Contains(err.Error(), "no-such-flag") {
		t.Errorf("a plugin that cannot start: %v, want its log tail", err)
	}
	for i := range 2 { // start, then restart
		if err := vm.StartPlugin(ctx); err != nil {
			t.Fatalf("start %d: %v", i+1, err)
		}
		conn, err := c.Dialer()(ctx, vm.NodeEndpoint())
		if err != nil {
			t.Fatalf("start %d: dialing %s: %v", i+1, vm.NodeEndpoint(), err)
		}
		conn.Close()
	}
	if err := vm.KillPlugin(ctx); err != nil {
		t.Fatal(err)
	}
	dctx, dcancel := context.WithTimeout(ctx, 3*time.Second)
	if conn, err := c.Dialer()(dctx, vm.NodeEndpoint()); err == nil {
		conn.Close()
		t.Error("the plugin's port still answers after KillPlugin")
	}
	dcancel()
	if err := vm.KillPlugin(ctx); err != nil {
		t.Errorf("KillPlugin with no plugin running: %v", err)
	}
	log, err := vm.PluginLog(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The plugin listens before it logs "Serving CSI", so the last one may
	// have been killed before logging it; the agent's lines are certain.
	if n := strings.Count(log, " starting "+bin+" "); n != 3 || !strings.Contains(log, "ended: signal: killed") ||
		!strings.Contains(log, "Serving CSI") {
		t.Errorf("the plugin log tells of %d starts, want 3, and should show the kill:\n%s", n, log)
	}
}

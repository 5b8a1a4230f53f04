// Command vmcluster boots the VMs of package vmtest as long-lived machines
// on a bridge of the host's own network, for a Kubernetes cluster whose
// worker nodes are VMs (hack/local-cluster/vm-up.sh). Unlike vmtest.Start,
// which ties its VMs to a test process and a network namespace of its own,
// the VMs outlive this command: their qemu processes run in sessions of
// their own, recorded in files, and "down" stops them by PID.
//
//	vmcluster up   -dir DIR -bridge BR [-memory MB] [-disk MB | -disk-seed IMG] [-tb-size MB] NAME=ADDR ...
//	vmcluster run  -dir DIR [-e K=V]... [-timeout D] NAME -- COMMAND [ARG...]
//	vmcluster reboot -dir DIR NAME
//	vmcluster down -dir DIR
//
// up builds the VM image (cached, see vmtest.CacheDir) and the agent, gives
// each VM a fresh node disk (ext4, DIR/NAME/disk.img, mounted by the VM's
// init at DIR/NAME/local; with -disk-seed a copy of that ext4 image, e.g.
// one whose containerd holds the images already), a tap device on BR (which must exist and hold
// the VMs' /24), boots them all and returns once every VM's agent answers.
// ADDR is the VM's address on BR. Each VM's record is DIR/NAME/vm.json;
// its console is DIR/NAME/console.log.
//
// run runs a command inside a VM (chrooted into the host's root over 9p),
// through its agent, prints its output and exits with its exit code.
//
// reboot cuts one VM's power and boots it again on the same node disk.
//
// down stops every recorded qemu (SIGTERM, SIGKILL after 5 s; a recorded
// PID counts only while its command line is qemu's with this DIR), and
// deletes the tap devices.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/modeguard/modeguard/test/vm/agentapi"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

const agentPort = 10001

// vmName: the tap device is "mgvt" + name, within the 15 bytes of an interface name.
var vmName = regexp.MustCompile(`^[a-z0-9]{1,11}$`)

// record is what up writes to DIR/NAME/vm.json.
type record struct {
	Name     string     `json:"name"`
	Addr     netip.Addr `json:"addr"`
	Tap      string     `json:"tap"`
	PID      int        `json:"pid"`
	MemoryMB int        `json:"memoryMB"`
	TBSizeMB int        `json:"tbSizeMB"`
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "up":
		err = up(os.Args[2:])
	case "run":
		var code int
		code, err = run(os.Args[2:])
		if err == nil {
			os.Exit(code)
		}
	case "down":
		err = down(os.Args[2:])
	case "reboot":
		err = reboot(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "vmcluster %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprint(os.Stderr, `usage:
  vmcluster up   -dir DIR -bridge BR [-memory MB] [-disk MB | -disk-seed IMG] [-tb-size MB] NAME=ADDR ...
  vmcluster run  -dir DIR [-e K=V]... [-timeout D] NAME -- COMMAND [ARG...]
  vmcluster reboot -dir DIR NAME
  vmcluster down -dir DIR
`)
	os.Exit(2)
}

func logf(format string, args ...any) {
	fmt.Printf("[vmcluster %s] %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func up(args []string) error {
	fs := flag.NewFlagSet("up", flag.ExitOnError)
	dir := fs.String("dir", "", "directory of the VMs (absolute; agent, node disks, consoles)")
	bridge := fs.String("bridge", "", "bridge the VMs' tap devices are attached to")
	memory := fs.Int("memory", 1024, "memory per VM, MiB")
	disk := fs.Int("disk", 2048, "node disk per VM, MiB (sparse)")
	tbSize := fs.Int("tb-size", 0, "qemu's translated code cache per VM, MiB (0: qemu's default, 1 GiB)")
	seed := fs.String("disk-seed", "", "a node disk to copy (sparse) for each VM instead of an empty one of -disk MiB")
	wait := fs.Duration("wait", 3*time.Minute, "how long to wait for the VMs' agents")
	fs.Parse(args)
	if *dir == "" || *bridge == "" || fs.NArg() == 0 {
		usage()
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root")
	}
	if _, err := os.Stat("/sys/class/net/" + *bridge + "/bridge"); err != nil {
		return fmt.Errorf("no bridge %s", *bridge)
	}
	var vms []record
	for _, a := range fs.Args() {
		name, addr, ok := strings.Cut(a, "=")
		ip, err := netip.ParseAddr(addr)
		if !ok || !vmName.MatchString(name) || err != nil || !ip.Is4() {
			return fmt.Errorf("%q is not NAME=IPv4 (NAME: up to 11 lower-case letters and digits)", a)
		}
		vms = append(vms, record{Name: name, Addr: ip, Tap: "mgvt" + name})
	}
	if existing, _ := filepath.Glob(filepath.Join(*dir, "*", "vm.json")); len(existing) > 0 {
		for _, f := range existing {
			if r, err := readRecord(f); err == nil && qemuOf(r.PID, *dir) {
				return fmt.Errorf("%s (qemu pid %d) still runs: run vmcluster down first", r.Name, r.PID)
			}
		}
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		return err
	}

	t0 := time.Now()
	img, err := vmtest.PrepareImage(logf)
	if err != nil {
		return fmt.Errorf("the VM image: %w", err)
	}
	if err := vmtest.BuildAgent(filepath.Join(*dir, "agent")); err != nil {
		return err
	}
	logf("image and agent ready in %s", time.Since(t0).Round(time.Millisecond))

	for i := range vms {
		v := &vms[i]
		vdir := filepath.Join(*dir, v.Name)
		if err := os.RemoveAll(vdir); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(vdir, "local"), 0o755); err != nil {
			return err
		}
		if *seed != "" {
			// A sparse copy: only the seed's written blocks cost a copy (cp, as
			// Go's io.Copy writes the holes too).
			if out, err := exec.Command("cp", "--sparse=always", *seed, filepath.Join(vdir, "disk.img")).CombinedOutput(); err != nil {
				return fmt.Errorf("copying the node disk seed %s: %v: %s", *seed, err, bytes.TrimSpace(out))
			}
		} else if err := vmtest.MakeNodeDisk(filepath.Join(vdir, "disk.img"), *disk); err != nil {
			return err
		}
		if _, err := os.Stat("/sys/class/net/" + v.Tap); err == nil {
			return fmt.Errorf("tap %s exists already: run vmcluster down first", v.Tap)
		}
		for _, s := range [][]string{
			{"tuntap", "add", v.Tap, "mode", "tap"},
			{"link", "set", v.Tap, "master", *bridge},
			{"link", "set", v.Tap, "up"},
		} {
			if out, err := exec.Command("ip", s...).CombinedOutput(); err != nil {
				return fmt.Errorf("ip %s: %v: %s", strings.Join(s, " "), err, bytes.TrimSpace(out))
			}
		}
		// Recorded before qemu starts: down deletes the tap even if the boot fails.
		if err := writeRecord(*dir, *v); err != nil {
			return err
		}
	}

	t0 = time.Now()
	for i := range vms {
		vms[i].MemoryMB, vms[i].TBSizeMB = *memory, *tbSize
		if err := boot(*dir, img, &vms[i]); err != nil {
			return err
		}
	}
	errs := make([]error, len(vms))
	var wg sync.WaitGroup
	for i := range vms {
		wg.Go(func() { errs[i] = waitAgent(*dir, vms[i], t0, *wait) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// boot starts the VM's qemu in a session of its own and records its PID.
func boot(dir string, img vmtest.Image, v *record) error {
	vdir := filepath.Join(dir, v.Name)
	m := vmtest.Machine{Name: v.Name, Addr: v.Addr, WorkDir: dir, MemoryMB: v.MemoryMB, Tap: v.Tap,
		Console: filepath.Join(vdir, "console.log"), Disk: filepath.Join(vdir, "disk.img"), TBSizeMB: v.TBSizeMB}
	logFile, err := os.Create(filepath.Join(vdir, "qemu.log"))
	if err != nil {
		return err
	}
	cmd := exec.Command("qemu-system-x86_64", vmtest.QemuArgs(img, m)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// A session of its own: the VM outlives this command and its terminal.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	logFile.Close()
	if err != nil {
		return fmt.Errorf("starting qemu for %s: %w", v.Name, err)
	}
	v.PID = cmd.Process.Pid
	cmd.Process.Release()
	return writeRecord(dir, *v)
}

// waitAgent waits until the VM's agent answers, then names the VM after
// itself, as vmtest does: the NFSv4 client names itself to the server by
// the host name.
func waitAgent(dir string, v record, t0 time.Time, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		var resp struct{}
		err := call(ctx, v.Addr, agentapi.PathPing, struct{}{}, &resp)
		cancel()
		if err == nil {
			break
		}
		if !qemuOf(v.PID, dir) {
			return fmt.Errorf("%s: qemu stopped while booting; console %s", v.Name, filepath.Join(dir, v.Name, "console.log"))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no answer from its agent within %s (%v); console %s", v.Name, wait, err, filepath.Join(dir, v.Name, "console.log"))
		}
		time.Sleep(200 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rr agentapi.RunResponse
	if err := call(ctx, v.Addr, agentapi.PathRun, agentapi.RunRequest{Name: "hostname", Args: []string{v.Name}}, &rr); err != nil || rr.ExitCode != 0 {
		return fmt.Errorf("%s: naming it: %v %s", v.Name, err, rr.Output)
	}
	logf("%s (%s, qemu pid %d) up in %s", v.Name, v.Addr, v.PID, time.Since(t0).Round(time.Millisecond))
	return nil
}

// reboot cuts a VM's power (SIGKILL to its qemu: nothing in the guest gets
// to flush or unmount) and boots it again with the same address, tap and
// node disk, as vmtest.VM.Reboot does. The node's daemons are vm-node.sh's
// to start again, as a machine's init would.
func reboot(args []string) error {
	fs := flag.NewFlagSet("reboot", flag.ExitOnError)
	dir := fs.String("dir", "", "directory of the VMs")
	wait := fs.Duration("wait", 3*time.Minute, "how long to wait for the VM's agent")
	fs.Parse(args)
	if *dir == "" || fs.NArg() != 1 {
		usage()
	}
	r, err := readRecord(filepath.Join(*dir, fs.Arg(0), "vm.json"))
	if err != nil {
		return err
	}
	if !qemuOf(r.PID, *dir) {
		return fmt.Errorf("%s (qemu pid %d) is not running", r.Name, r.PID)
	}
	if r.MemoryMB == 0 {
		return fmt.Errorf("%s: its record has no memory size (written by an older vmcluster): bring the cluster up again", r.Name)
	}
	img, err := vmtest.PrepareImage(logf)
	if err != nil {
		return fmt.Errorf("the VM image: %w", err)
	}
	t0 := time.Now()
	logf("cutting the power of %s (SIGKILL to qemu pid %d)", r.Name, r.PID)
	if err := syscall.Kill(r.PID, syscall.SIGKILL); err != nil {
		return err
	}
	for qemuOf(r.PID, *dir) {
		if time.Since(t0) > 30*time.Second {
			return fmt.Errorf("%s: qemu pid %d survives SIGKILL", r.Name, r.PID)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Keep the console of the boot before for a failure's report.
	console := filepath.Join(*dir, r.Name, "console.log")
	if err := os.Rename(console, console+".before-reboot"); err != nil && !os.IsNotExist(err) {
		return err
	}
	if err := boot(*dir, img, &r); err != nil {
		return err
	}
	return waitAgent(*dir, r, t0, *wait)
}

func run(args []string) (int, error) {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	dir := fs.String("dir", "", "directory of the VMs")
	timeout := fs.Duration("timeout", 10*time.Minute, "how long the command may take")
	var env []string
	fs.Func("e", "K=V added to the command's environment (repeatable)", func(s string) error {
		if !strings.Contains(s, "=") {
			return fmt.Errorf("%q is not K=V", s)
		}
		env = append(env, s)
		return nil
	})
	fs.Parse(args)
	rest := fs.Args()
	if *dir == "" || len(rest) < 3 || rest[1] != "--" {
		usage()
	}
	r, err := readRecord(filepath.Join(*dir, rest[0], "vm.json"))
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	var resp agentapi.RunResponse
	if err := call(ctx, r.Addr, agentapi.PathRun, agentapi.RunRequest{Name: rest[2], Args: rest[3:], Env: env}, &resp); err != nil {
		return 0, err
	}
	os.Stdout.Write(resp.Output)
	return resp.ExitCode, nil
}

func down(args []string) error {
	fs := flag.NewFlagSet("down", flag.ExitOnError)
	dir := fs.String("dir", "", "directory of the VMs")
	fs.Parse(args)
	if *dir == "" {
		usage()
	}
	files, _ := filepath.Glob(filepath.Join(*dir, "*", "vm.json"))
	var (
		errs []error
		mu   sync.Mutex
		wg   sync.WaitGroup
	)
	for _, f := range files {
		r, err := readRecord(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		wg.Go(func() {
			if r.PID > 0 && qemuOf(r.PID, *dir) {
				logf("stopping %s (qemu pid %d)", r.Name, r.PID)
				_ = syscall.Kill(r.PID, syscall.SIGTERM)
				deadline := time.Now().Add(5 * time.Second)
				for qemuOf(r.PID, *dir) && time.Now().Before(deadline) {
					time.Sleep(50 * time.Millisecond)
				}
				if qemuOf(r.PID, *dir) {
					logf("%s (qemu pid %d) ignored SIGTERM; SIGKILL", r.Name, r.PID)
					_ = syscall.Kill(r.PID, syscall.SIGKILL)
					for qemuOf(r.PID, *dir) {
						time.Sleep(50 * time.Millisecond)
					}
				}
			}
			if r.Tap != "" {
				if _, err := os.Stat("/sys/class/net/" + r.Tap); err == nil {
					if out, err := exec.Command("ip", "link", "del", r.Tap).CombinedOutput(); err != nil {
						mu.Lock()
						errs = append(errs, fmt.Errorf("deleting %s: %v: %s", r.Tap, err, bytes.TrimSpace(out)))
						mu.Unlock()
						return
					}
				}
			}
			os.Remove(f)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// qemuOf tells whether pid is a live qemu of a VM of dir (guards against a
// recycled PID). A zombie counts as gone.
func qemuOf(pid int, dir string) bool {
	if pid <= 0 {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	if i := bytes.LastIndexByte(stat, ')'); i > 0 && len(stat) > i+2 && stat[i+2] == 'Z' {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	argv := strings.Split(string(cmdline), "\x00")
	return filepath.Base(argv[0]) == "qemu-system-x86_64" && bytes.Contains(cmdline, []byte("mgwork="+dir+" "))
}

func writeRecord(dir string, r record) error {
	data, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, r.Name, "vm.json"), append(data, '\n'), 0o644)
}

func readRecord(path string) (record, error) {
	var r record
	data, err := os.ReadFile(path)
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal(data, &r); err != nil {
		return r, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}

var client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2, IdleConnTimeout: 30 * time.Second}}

// call posts req to the agent of the VM at addr and decodes its answer.
func call(ctx context.Context, addr netip.Addr, path string, req, resp any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	url := "http://" + netip.AddrPortFrom(addr, agentPort).String() + path
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	hreq.Header.Set("Content-Type", "application/json")
	hresp, err := client.Do(hreq)
	if err != nil {
		return fmt.Errorf("agent at %s: %w", addr, err)
	}
	defer hresp.Body.Close()
	if hresp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(hresp.Body, 4096))
		return fmt.Errorf("agent at %s: %s: %s", addr, hresp.Status, bytes.TrimSpace(msg))
	}
	return json.NewDecoder(hresp.Body).Decode(resp)
}

package lio

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

// replacementTimeout is how long the nodes' I/O waits for a lost session:
// short, so that a fenced writer's writes fail within the test.
const replacementTimeout = "5s"

// requireInitiatorTools skips the test without the host's open-iscsi
// (which the node VMs run) and sg_raw.
func requireInitiatorTools(t testing.TB) {
	for tool, pkg := range map[string]string{"iscsiadm": "open-iscsi", "iscsid": "open-iscsi", "sg_raw": "sg3-utils"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (Debian: %s)", tool, pkg)
		}
	}
}

// onNode runs iscsitool on a node VM; it returns the output and exit code.
func (e *env) onNode(vm *vmtest.VM, args ...string) (string, int) {
	e.t.Helper()
	args = append([]string{"-replacement-timeout", replacementTimeout}, args...)
	out, code, err := vm.Run(e.ctx, e.tool, args...)
	if err != nil {
		e.t.Fatalf("iscsitool on %s: %v", vm.Name, err)
	}
	return out, code
}

func (e *env) targetOf(i lio.Initiator) iscsi.Target {
	return iscsi.Target{IQN: prefix + ":" + volume, Portal: netip.MustParseAddrPort(e.portal), User: i.User, Secret: i.Secret}
}

// login logs vm in as i and returns the disk the package found.
func (e *env) login(vm *vmtest.VM, i lio.Initiator) iscsi.Disk {
	e.t.Helper()
	d, out, code := e.loginTo(vm, e.targetOf(i), serial)
	if code != 0 {
		e.t.Fatalf("%s logging in as %s: exit %d: %s", vm.Name, i.IQN, code, out)
	}
	return d
}

// loginTo logs vm in to tg and finds the disk with serial; it returns the
// tool's output and exit code too, for logins that should fail.
func (e *env) loginTo(vm *vmtest.VM, tg iscsi.Target, serial string) (iscsi.Disk, string, int) {
	e.t.Helper()
	js, err := json.Marshal(tg)
	if err != nil {
		e.t.Fatal(err)
	}
	out, code := e.onNode(vm, "login", string(js), serial)
	var d iscsi.Disk
	if code == 0 {
		if err := json.Unmarshal([]byte(out), &d); err != nil {
			e.t.Fatalf("%s: %v: %s", vm.Name, err, out)
		}
	}
	return d, out, code
}

// logout logs vm out of the volume's target and checks that the kernel
// has no session left and open-iscsi no record.
func (e *env) logout(vm *vmtest.VM) { e.t.Helper(); e.logoutOf(vm, prefix+":"+volume) }

func (e *env) logoutOf(vm *vmtest.VM, target string) {
	e.t.Helper()
	if out, code := e.onNode(vm, "logout", target, e.portal); code != 0 {
		e.t.Fatalf("%s logging out: exit %d: %s", vm.Name, code, out)
	}
	e.wantNoSession(vm)
}

func (e *env) wantNoSession(vm *vmtest.VM) {
	e.t.Helper()
	if out, code := e.onNode(vm, "sessions"); code != 0 || strings.TrimSpace(out) != "null" {
		e.t.Fatalf("%s has sessions: exit %d: %s", vm.Name, code, out)
	}
	// iscsiadm's "no records found" is its exit status 21.
	if out, code, err := vm.Run(e.ctx, "iscsiadm", "-m", "node"); err != nil || code != 21 {
		e.t.Fatalf("%s has node records: exit %d, %v: %s", vm.Name, code, err, out)
	}
}

// writeBlock writes 4 KiB of fill at block n of dev, bypassing the page
// cache, and returns the output and exit code.
func writeBlock(e *env, vm *vmtest.VM, dev string, n int, fill byte) (string, int) {
	e.t.Helper()
	out, code, err := vm.Run(e.ctx, "sh", "-c",
		`head -c 4096 /dev/zero | tr '\000' "$1" | dd of="$2" bs=4096 seek="$3" oflag=direct conv=fsync status=none`,
		"sh", string(fill), dev, fmt.Sprint(n))
	if err != nil {
		e.t.Fatalf("%s: %v", vm.Name, err)
	}
	return out, code
}

// sgWrite sends a SCSI WRITE(10) of 4 KiB of fill at block n straight to
// the target (SG_IO on a descriptor opened read-only: the kernel's
// read-only flag is not consulted), as a node working around its driver
// would.
func sgWrite(e *env, vm *vmtest.VM, dev string, n int, fill byte) (string, int) {
	e.t.Helper()
	lba := n * 8
	out, code, err := vm.Run(e.ctx, "sh", "-c",
		`head -c 4096 /dev/zero | tr '\000' "$1" > /tmp/mg-sg-block && sg_raw -R -s 4096 -i /tmp/mg-sg-block "$2" 2a 00 $3 00 00 08 00`,
		"sh", string(fill), dev, fmt.Sprintf("%02x %02x %02x %02x", lba>>24&0xff, lba>>16&0xff, lba>>8&0xff, lba&0xff))
	if err != nil {
		e.t.Fatalf("%s: %v", vm.Name, err)
	}
	return out, code
}

func readBlock(e *env, vm *vmtest.VM, dev string, n int) []byte {
	e.t.Helper()
	out, code, err := vm.Run(e.ctx, "dd", "if="+dev, "bs=4096", fmt.Sprintf("skip=%d", n), "count=1", "iflag=direct", "status=none")
	if err != nil || code != 0 {
		e.t.Fatalf("%s reading block %d of %s: exit %d, %v: %s", vm.Name, n, dev, code, err, out)
	}
	return []byte(out)
}

// TestKernelInitiatorFindsItsDiskAndIsFenced: two node VMs log in to a
// volume with the kernel's initiator through package iscsi, which finds
// the disk by its serial and reports what the target allows: A
// read/write, B read-only. B's kernel refuses to open the disk for
// writing, and a write that goes around its kernel (SG_IO) is refused by
// the target with DATA PROTECT. Taken off the list, B cannot log in (the
// target refuses, and no record is left behind). A writer on A that is
// fenced (removed from the list while writing) gets its next write
// failed; every write it had acknowledged is in the image and none after;
// B, now the writer, reads them and writes; A cannot log in again and
// logs out cleanly.
func TestKernelInitiatorFindsItsDiskAndIsFenced(t *testing.T) {
	testenv.OnlyInTestAll(t, "TestCSIOverISCSIFencesAForceDetachedWriter, which fences the kernel initiator through the whole driver")
	requireInitiatorTools(t)
	e := setup(t, 2)
	a, b := e.nodes[0], e.nodes[1]
	if err := a.StartISCSIInitiator(e.ctx, nodeA.IQN); err != nil {
		t.Fatal(err)
	}
	if err := b.StartISCSIInitiator(e.ctx, nodeB.IQN); err != nil {
		t.Fatal(err)
	}
	const size = imageMiB << 20
	e.target("export", volume, e.image, fmt.Sprint(size), serial)
	e.setInitiators(nodeA, nodeB)
	var diskA, diskB iscsi.Disk

	t.Run("A writes, B reads and cannot write around its kernel", func(t *testing.T) {
		diskA = e.login(a, nodeA)
		if err := diskA.Check(size, false); err != nil {
			t.Fatalf("A's disk: %v", err)
		}
		if err := diskA.Check(size, true); err == nil {
			t.Fatal("A's writable disk passed as read-only")
		}
		if out, code := writeBlock(e, a, diskA.Device, 0, 'A'); code != 0 {
			t.Fatalf("A writing: exit %d: %s", code, out)
		}
		if !filled(e.imageBytes(0, 4096), 'A') {
			t.Fatal("A's acknowledged write is not in the image on the target")
		}
		// The write around the kernel works where the target allows it,
		// so its refusal below is the target's.
		if out, code := sgWrite(e, a, diskA.Device, 1, 'S'); code != 0 || !strings.Contains(out, "Good") {
			t.Fatalf("A's SG_IO write: exit %d: %s", code, out)
		}
		if !filled(e.imageBytes(4096, 4096), 'S') {
			t.Fatal("A's SG_IO write is not in the image on the target")
		}

		diskB = e.login(b, nodeB)
		if err := diskB.Check(size, true); err != nil {
			t.Fatalf("B's disk: %v", err)
		}
		if err := diskB.Check(size, false); err == nil {
			t.Fatal("B's read-only disk passed as read/write")
		}
		if got := readBlock(e, b, diskB.Device, 0); !filled(got, 'A') {
			t.Fatalf("B reads %q, not A's write", got[:16])
		}
		if out, code := writeBlock(e, b, diskB.Device, 2, 'B'); code == 0 || !strings.Contains(out, "Read-only file system") {
			t.Fatalf("B's kernel let it open its read-only disk for writing: exit %d: %s", code, out)
		}
		out, code := sgWrite(e, b, diskB.Device, 2, 'B')
		if code == 0 || !strings.Contains(out, "Data Protect") {
			t.Fatalf("the target took B's write: exit %d: %s", code, out)
		}
		t.Logf("B's SG_IO write: %s", strings.Join(strings.Fields(out), " "))
		if !filled(e.imageBytes(8192, 4096), 0) {
			t.Fatal("B's refused write reached the image")
		}
	})

	t.Run("a node on no list is refused at the target", func(t *testing.T) {
		e.logout(b)
		e.setInitiators(nodeA)
		js, _ := json.Marshal(e.targetOf(nodeB))
		out, code := e.onNode(b, "login", string(js), serial)
		if code == 0 || !strings.Contains(out, iscsi.ErrLoginRefused.Error()) {
			t.Fatalf("B logging in when only A is on the list: exit %d: %s", code, out)
		}
		if strings.Contains(out, nodeB.Secret) {
			t.Fatalf("the refusal shows B's secret: %s", out)
		}
		e.wantNoSession(b)
	})

	t.Run("A fenced while writing", func(t *testing.T) {
		const first = 8
		log := a.Path("writer.log")
		// Each write is acknowledged (O_DIRECT, fsync) before it is
		// logged; the loop stops at the first failure.
		writer := `i=$3
while [ $i -lt 4000 ] && head -c 4096 /dev/zero | tr '\000' W | dd of="$1" bs=4096 seek=$i oflag=direct conv=fsync status=none; do
	echo "ok $i" >> "$2"; i=$((i+1)); sleep 0.1
done
echo "stopped $i" >> "$2"`
		if out, code, err := a.Run(e.ctx, "sh", "-c", `w="$1"; shift; sh -c "$w" writer "$@" > /dev/null 2>&1 < /dev/null &`, "sh", writer, diskA.Device, log, fmt.Sprint(first)); err != nil || code != 0 {
			t.Fatalf("starting the writer on A: exit %d, %v: %s", code, err, out)
		}
		waitLog := func(what string, min int, within time.Duration) []string {
			t.Helper()
			deadline := time.Now().Add(within)
			for {
				data, _ := a.ReadFile(e.ctx, log)
				lines := strings.Split(strings.TrimSpace(string(data)), "\n")
				if n := strings.Count(string(data), what); n >= min {
					return lines
				}
				if time.Now().After(deadline) {
					t.Fatalf("A's writer log after %v has no %d %q: %q", within, min, what, data)
				}
				time.Sleep(200 * time.Millisecond)
			}
		}
		waitLog("ok ", 5, time.Minute)
		rw := nodeB
		rw.ReadOnly = false
		e.setInitiators(rw) // the fence
		fencedAt := time.Now()
		lines := waitLog("stopped ", 1, time.Minute)
		t.Logf("A's writer stopped %v after the fence: %s", time.Since(fencedAt).Round(100*time.Millisecond), lines[len(lines)-1])
		var stopped int
		if _, err := fmt.Sscanf(lines[len(lines)-1], "stopped %d", &stopped); err != nil || stopped >= 4000 {
			t.Fatalf("A's writer log ends with %q", lines[len(lines)-1])
		}
		// Every acknowledged write is in the image. The one that failed
		// may or may not have reached the target before its session went;
		// nothing after it did.
		acked := e.imageBytes(first*4096, (stopped-first)*4096)
		if !filled(acked, 'W') {
			t.Fatalf("an acknowledged write of A is missing from the image (blocks %d to %d)", first, stopped-1)
		}
		if after := e.imageBytes((stopped+1)*4096, 16*4096); !bytes.Equal(after, make([]byte, len(after))) {
			t.Fatal("a write of A after its failed one reached the image")
		}
		t.Logf("A's acknowledged writes: blocks %d to %d, all in the image", first, stopped-1)

		diskB = e.login(b, rw)
		if err := diskB.Check(size, false); err != nil {
			t.Fatalf("B's disk after the fence: %v", err)
		}
		if got := readBlock(e, b, diskB.Device, stopped-1); !filled(got, 'W') {
			t.Fatalf("B reads %q where A's last acknowledged write was", got[:16])
		}
		if out, code := writeBlock(e, b, diskB.Device, stopped+2, 'B'); code != 0 {
			t.Fatalf("B writing after the fence: exit %d: %s", code, out)
		}
		if !filled(e.imageBytes((stopped+2)*4096, 4096), 'B') {
			t.Fatal("B's write is not in the image")
		}

		js, _ := json.Marshal(e.targetOf(nodeA))
		out, code := e.onNode(a, "logout", prefix+":"+volume, e.portal)
		if code != 0 {
			t.Fatalf("A logging out after the fence: exit %d: %s", code, out)
		}
		e.wantNoSession(a)
		if out, code := e.onNode(a, "login", string(js), serial); code == 0 || !strings.Contains(out, iscsi.ErrLoginRefused.Error()) {
			t.Fatalf("A logging in again after the fence: exit %d: %s", code, out)
		}
		e.wantNoSession(a)
	})

	t.Run("B logs out", func(t *testing.T) {
		e.logout(b)
	})
}

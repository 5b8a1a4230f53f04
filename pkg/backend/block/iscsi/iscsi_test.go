package iscsi

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestParseUnitSerial(t *testing.T) {
	for _, tc := range []struct {
		name string
		page []byte
		want string
		err  bool
	}{
		// What LIO's disk showed in a VM: length 9, the serial and a NUL.
		{"LIO", []byte("\x00\x80\x00\x09mg-vol-a\x00"), "mg-vol-a", false},
		{"blank padded", []byte("\x00\x80\x00\x0amg-vol-a  "), "mg-vol-a", false},
		{"longer than its length", []byte("\x00\x80\x00\x02abcd"), "ab", false},
		{"empty serial", []byte("\x00\x80\x00\x00"), "", false},
		{"shorter than its length", []byte("\x00\x80\x00\x09mg"), "", true},
		{"another page", []byte("\x00\x83\x00\x02ab"), "", true},
		{"no header", []byte("\x00\x80"), "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseUnitSerial(tc.page)
			if (err != nil) != tc.err || got != tc.want {
				t.Fatalf("got %q, %v; want %q (error: %v)", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestDiskCheck(t *testing.T) {
	d := Disk{Device: "/dev/sdb", Serial: "s", Size: 64 << 20}
	ro := d
	ro.ReadOnly = true
	for _, tc := range []struct {
		name     string
		disk     Disk
		size     int64
		readOnly bool
		want     string
	}{
		{"read/write as attached", d, 64 << 20, false, ""},
		{"read-only as attached", ro, 64 << 20, true, ""},
		{"smaller", d, 128 << 20, false, "has 67108864 bytes"},
		{"grown since the attach", d, 32 << 20, false, ""},
		{"writable for a reader", d, 64 << 20, true, "lets this node write"},
		{"read-only for a writer", ro, 64 << 20, false, "read-only to this node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.disk.Check(tc.size, tc.readOnly)
			if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

// A failed iscsiadm is reported with its command line, but never with
// the CHAP secret that was one of its values.
func TestCommandErrorsLeaveTheSecretOut(t *testing.T) {
	in := &Initiator{Iscsiadm: "false"}
	_, err := in.iscsiadm(context.Background(), "-m", "node", "-o", "update",
		"-n", "node.session.auth.password", "-v", "secret-of-node-a")
	if err == nil {
		t.Fatal("false succeeded")
	}
	if strings.Contains(err.Error(), "secret-of-node-a") {
		t.Fatalf("the error shows the secret: %v", err)
	}
	if !strings.Contains(err.Error(), "node.session.auth.password -v ...") {
		t.Fatalf("the error does not say what ran: %v", err)
	}
	var ee interface{ ExitCode() int }
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("the error does not carry the exit status: %v", err)
	}
}

func TestTargetValidation(t *testing.T) {
	good := Target{IQN: "iqn.2026-11.io.example.target:vol-1", Portal: netip.MustParseAddrPort("10.0.0.1:3260"), User: "node-1", Secret: "secret-of-node-1"}
	for _, tc := range []struct {
		name string
		edit func(*Target)
		want string
	}{
		{"good", func(*Target) {}, ""},
		{"option as a name", func(t *Target) { t.IQN = "--login" }, "not an IQN"},
		{"no portal", func(t *Target) { t.Portal = netip.AddrPort{} }, "portal"},
		{"port 0", func(t *Target) { t.Portal = netip.MustParseAddrPort("10.0.0.1:0") }, "portal"},
		{"user with a blank", func(t *Target) { t.User = "node 1" }, "CHAP user"},
		{"secret with a newline", func(t *Target) { t.Secret = "secret-of-node-1\nnode.startup = automatic" }, "CHAP secret"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			target := good
			tc.edit(&target)
			// No iscsiadm runs: a bad target is refused before.
			in := &Initiator{Iscsiadm: "/nonexistent/iscsiadm", Sysfs: t.TempDir()}
			err := in.Login(context.Background(), target)
			switch {
			case tc.want == "" && err != nil && !strings.Contains(err.Error(), "/nonexistent/iscsiadm"):
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %v, want an error about %s", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), target.Secret) {
				t.Fatalf("the error shows the secret: %v", err)
			}
		})
	}
}

// fakeSysfs lays out what the kernel's sysfs shows for sessions and
// their disks, as seen in a VM with Debian's kernel: the host kernel here
// has no iSCSI initiator, so the layout is written by hand. The device
// nodes are real (mknod in a temporary directory).
type fakeSysfs struct {
	t        *testing.T
	sys, dev string
}

func newFakeSysfs(t *testing.T) *fakeSysfs {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mknod of the device nodes)")
	}
	root := t.TempDir()
	f := &fakeSysfs{t: t, sys: filepath.Join(root, "sys"), dev: filepath.Join(root, "dev")}
	f.mkdir(f.dev)
	return f
}

func (f *fakeSysfs) mkdir(p string) {
	if err := os.MkdirAll(p, 0o755); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fakeSysfs) write(p, s string) {
	f.mkdir(filepath.Dir(p))
	if err := os.WriteFile(p, []byte(s+"\n"), 0o644); err != nil {
		f.t.Fatal(err)
	}
}

// session adds sessionN to target at portal in state.
func (f *fakeSysfs) session(n int, target, portal, state string) {
	ap := netip.MustParseAddrPort(portal)
	dev := filepath.Join(f.sys, "devices", "platform", fmt.Sprintf("host%d", n), fmt.Sprintf("session%d", n))
	f.mkdir(dev)
	class := filepath.Join(f.sys, "class", "iscsi_session", fmt.Sprintf("session%d", n))
	f.write(filepath.Join(class, "targetname"), target)
	f.write(filepath.Join(class, "state"), state)
	if err := os.Symlink(dev, filepath.Join(class, "device")); err != nil {
		f.t.Fatal(err)
	}
	conn := filepath.Join(f.sys, "class", "iscsi_connection", fmt.Sprintf("connection%d:0", n))
	f.write(filepath.Join(conn, "persistent_address"), ap.Addr().String())
	f.write(filepath.Join(conn, "persistent_port"), fmt.Sprint(ap.Port()))
}

// disk adds disk name (device major:minor, a node made in dev unless
// node is false) with serial as LUN lun of session n.
func (f *fakeSysfs) disk(n, lun int, name, serial string, minor uint32, sectors int64, ro bool) {
	scsi := filepath.Join(f.sys, "devices", "platform", fmt.Sprintf("host%d", n), fmt.Sprintf("session%d", n),
		fmt.Sprintf("target%d:0:0", n), fmt.Sprintf("%d:0:0:%d", n, lun))
	page := append([]byte{0, 0x80, 0, byte(len(serial) + 1)}, append([]byte(serial), 0)...)
	f.mkdir(scsi)
	if err := os.WriteFile(filepath.Join(scsi, "vpd_pg80"), page, 0o444); err != nil {
		f.t.Fatal(err)
	}
	block := filepath.Join(scsi, "block", name)
	f.write(filepath.Join(block, "size"), fmt.Sprint(sectors))
	roFlag := "0"
	if ro {
		roFlag = "1"
	}
	f.write(filepath.Join(block, "ro"), roFlag)
	f.write(filepath.Join(block, "dev"), fmt.Sprintf("8:%d", minor))
	// The kernel's links from the block class and back to the SCSI device.
	f.mkdir(filepath.Join(f.sys, "class", "block"))
	for link, to := range map[string]string{filepath.Join(f.sys, "class", "block", name): block, filepath.Join(block, "device"): scsi} {
		if err := os.Symlink(to, link); err != nil {
			f.t.Fatal(err)
		}
	}
	if err := unix.Mknod(filepath.Join(f.dev, name), unix.S_IFBLK|0o600, int(unix.Mkdev(8, minor))); err != nil {
		f.t.Fatal(err)
	}
}

const (
	targetA = "iqn.2026-11.io.example.target:vol-a"
	targetB = "iqn.2026-11.io.example.target:vol-b"
	serialA = "6d672d766f6c2d610000000000000001"
	serialB = "6d672d766f6c2d620000000000000002"
	portal  = "10.0.0.1:3260"
)

// The disk is found through its session and serial, whatever its name or
// the order the kernel made the disks in.
func TestFindDiskInAFakeSysfs(t *testing.T) {
	f := newFakeSysfs(t)
	f.session(1, targetB, portal, "LOGGED_IN")
	f.disk(1, 0, "sda", serialB, 0, 2048, false)
	f.session(2, targetA, portal, "LOGGED_IN")
	f.disk(2, 0, "sdb", serialA, 16, 131072, true)
	f.session(3, targetA, "10.0.0.2:3260", "LOGGED_IN") // the same name on another portal
	f.disk(3, 0, "sdc", serialA, 32, 4096, false)
	in := &Initiator{Sysfs: f.sys, Dev: f.dev}
	ap := netip.MustParseAddrPort(portal)

	got, err := in.FindDisk(targetA, ap, serialA)
	want := Disk{Device: filepath.Join(f.dev, "sdb"), Serial: serialA, Size: 131072 * 512, ReadOnly: true, Session: 2}
	if err != nil || got != want {
		t.Fatalf("FindDisk(%s) = %+v, %v; want %+v", targetA, got, err, want)
	}
	// The serial must match too: session 1 leads to vol-b's disk only.
	if _, err := in.FindDisk(targetB, ap, serialA); !errors.Is(err, ErrNoDisk) {
		t.Fatalf("a session without the serial: %v, want ErrNoDisk", err)
	}
	if _, err := in.FindDisk("iqn.2026-11.io.example.target:vol-c", ap, serialA); !errors.Is(err, ErrNoDisk) {
		t.Fatalf("no session: %v, want ErrNoDisk", err)
	}
	sessions, err := in.Sessions()
	if err != nil || len(sessions) != 3 || sessions[0].ID != 1 || sessions[2].Portal.String() != "10.0.0.2:3260" {
		t.Fatalf("Sessions() = %+v, %v", sessions, err)
	}
}

// A /dev node that is not the kernel's disk of that name is not trusted.
func TestFindDiskChecksTheDeviceNodeInAFakeSysfs(t *testing.T) {
	f := newFakeSysfs(t)
	f.session(1, targetA, portal, "LOGGED_IN")
	f.disk(1, 0, "sda", serialA, 0, 2048, false)
	f.write(filepath.Join(f.sys, "devices", "platform", "host1", "session1", "target1:0:0", "1:0:0:0", "block", "sda", "dev"), "8:48")
	in := &Initiator{Sysfs: f.sys, Dev: f.dev}
	_, err := in.FindDisk(targetA, netip.MustParseAddrPort(portal), serialA)
	if err == nil || !strings.Contains(err.Error(), "is device 8:0, but the kernel's sda is 8:48") {
		t.Fatalf("got %v, want a refusal of the device node", err)
	}
}

// Two sessions to one target, or two disks with the volume's serial,
// are not guessed between.
func TestFindDiskRefusesAmbiguityInAFakeSysfs(t *testing.T) {
	f := newFakeSysfs(t)
	f.session(1, targetA, portal, "LOGGED_IN")
	f.disk(1, 0, "sda", serialA, 0, 2048, false)
	f.disk(1, 1, "sdb", serialA, 16, 2048, false)
	in := &Initiator{Sysfs: f.sys, Dev: f.dev}
	ap := netip.MustParseAddrPort(portal)
	if _, err := in.FindDisk(targetA, ap, serialA); err == nil || !strings.Contains(err.Error(), "2 disks with serial") {
		t.Fatalf("two disks: %v", err)
	}
	f.session(2, targetA, portal, "FAILED")
	if _, err := in.FindDisk(targetA, ap, serialA); err == nil || !strings.Contains(err.Error(), "2 sessions") {
		t.Fatalf("two sessions: %v", err)
	}
}

func TestWaitDiskGivesUpWithWhatItSawInAFakeSysfs(t *testing.T) {
	f := newFakeSysfs(t)
	f.session(1, targetA, portal, "LOGGED_IN")
	in := &Initiator{Sysfs: f.sys, Dev: f.dev}
	ctx, cancel := context.WithTimeout(context.Background(), 300e6)
	defer cancel()
	_, err := in.WaitDisk(ctx, targetA, netip.MustParseAddrPort(portal), serialA)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "session 1") {
		t.Fatalf("got %v, want a deadline naming the session it saw", err)
	}
}

// Without a record of the target, a volume's disks are found among all
// sessions by serial, each with the session it is behind; a disk's serial
// is read from its name.
func TestDisksWithSerialLooksBehindEverySessionInAFakeSysfs(t *testing.T) {
	f := newFakeSysfs(t)
	f.session(1, targetB, portal, "LOGGED_IN")
	f.disk(1, 0, "sda", serialB, 0, 2048, false)
	f.session(4, targetA, portal, "FAILED")
	f.disk(4, 0, "sdd", serialA, 48, 2048, false)
	in := &Initiator{Sysfs: f.sys, Dev: f.dev}
	disks, sessions, err := in.DisksWithSerial(serialA)
	if err != nil || len(disks) != 1 || disks[0].Device != filepath.Join(f.dev, "sdd") || sessions[0].ID != 4 ||
		sessions[0].Target != targetA || sessions[0].State != "FAILED" {
		t.Fatalf("DisksWithSerial = %+v, %+v, %v", disks, sessions, err)
	}
	if disks, _, err := in.DisksWithSerial("00000000000000000000000000000000"); err != nil || len(disks) != 0 {
		t.Fatalf("an unknown serial: %+v, %v", disks, err)
	}
	for name, want := range map[string]string{"sda": serialB, "sdd": serialA, "sdz": "", "../sda": "", "": ""} {
		if got := in.SerialOf(name); got != want {
			t.Errorf("SerialOf(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestVolumeFromContext(t *testing.T) {
	const id = "block_zone-a_vol-1"
	good := Volume{Target: targetA, Portal: netip.MustParseAddrPort(portal), Serial: VolumeSerial(id)}
	with := func(k, v string) map[string]string {
		c := good.Context()
		c[k] = v
		return c
	}
	for _, tc := range []struct {
		name   string
		ctx    map[string]string
		ok     bool
		reject string // "" for accepted
	}{
		{"not iSCSI", map[string]string{"fsType": "ext4"}, false, ""},
		{"iSCSI", good.Context(), true, ""},
		{"another transport", with(ContextTransport, "nvme-tcp"), true, "the only network transport"},
		{"target not an IQN", with(ContextTarget, "vol-1"), true, "not an IQN"},
		{"portal without port", with(ContextPortal, "10.0.0.1"), true, "not an address and port"},
		{"portal port 0", with(ContextPortal, "10.0.0.1:0"), true, "not an address and port"},
		{"another volume's serial", with(ContextSerial, VolumeSerial("block_zone-a_vol-2")), true, "is not volume " + id},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, ok, err := FromContext(id, tc.ctx)
			if ok != tc.ok || (tc.reject == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.reject)) {
				t.Fatalf("FromContext = %+v, %v, %v; want ok=%v, rejection %q", v, ok, err, tc.ok, tc.reject)
			}
			if tc.ok && tc.reject == "" && v != good {
				t.Fatalf("FromContext = %+v, want %+v", v, good)
			}
		})
	}
	if s := VolumeSerial(id); !ValidSerial(s) || s == VolumeSerial(id+"x") {
		t.Fatalf("VolumeSerial(%s) = %q: not a serial, or not distinct", id, s)
	}
}

// A disk of a read-only attachment that the kernel first saw as writable
// is probed once more (a rescan) before it is refused: accepted when the
// probe now finds it write-protected, refused when it still does not.
func TestCheckAttachedProbesAWritableReaderOnceMoreInAFakeSysfs(t *testing.T) {
	for _, tc := range []struct {
		name         string
		roAfterProbe bool
		wantErr      string
	}{
		{"write-protected on the second probe", true, ""},
		{"still writable", false, "also after the kernel probed it again"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeSysfs(t)
			f.session(1, targetA, portal, "LOGGED_IN")
			f.disk(1, 0, "sda", serialA, 0, 2048, false)
			in := &Initiator{Sysfs: f.sys, Dev: f.dev}
			d, err := in.FindDisk(targetA, netip.MustParseAddrPort(portal), serialA)
			if err != nil {
				t.Fatal(err)
			}
			block := filepath.Join(f.sys, "class", "block", "sda")
			if tc.roAfterProbe {
				// What the kernel's rescan would leave: the probe's answer.
				f.write(filepath.Join(block, "ro"), "1")
			}
			got, err := in.CheckAttached(d, 1024*512, true)
			if tc.wantErr == "" && (err != nil || !got.ReadOnly) {
				t.Fatalf("CheckAttached = %+v, %v; want the disk, read-only", got, err)
			}
			if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("CheckAttached = %v; want an error saying %q", err, tc.wantErr)
			}
			if _, err := os.Stat(filepath.Join(block, "device", "rescan")); err != nil {
				t.Fatalf("the disk was not rescanned: %v", err)
			}
		})
	}
	// Only the writable reader is probed again: a disk too small, or
	// read-only for a writer, is refused at once.
	f := newFakeSysfs(t)
	f.session(1, targetA, portal, "LOGGED_IN")
	f.disk(1, 0, "sda", serialA, 0, 2048, true)
	in := &Initiator{Sysfs: f.sys, Dev: f.dev}
	d, err := in.FindDisk(targetA, netip.MustParseAddrPort(portal), serialA)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.CheckAttached(d, 1024*512, false); err == nil || !strings.Contains(err.Error(), "attached read/write") {
		t.Fatalf("a read-only disk for a writer: %v", err)
	}
	if _, err := os.Stat(filepath.Join(f.sys, "class", "block", "sda", "device", "rescan")); err == nil {
		t.Fatal("a read-only disk for a writer was rescanned")
	}
}

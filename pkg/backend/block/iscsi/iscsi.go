// Package iscsi is the node's side of the block backend's iSCSI
// transport: it logs the node in to a volume's target with open-iscsi
// (iscsiadm, through the node's iscsid: the kernel's initiator takes its
// logins from no one else), finds the volume's disk through sysfs, and
// logs out.
//
// # Finding the disk
//
// A disk is found from the session, never by its name: the session to
// the volume's target (sysfs iscsi_session: target name, and the
// connection's portal) leads to the SCSI devices under it, and the one
// whose unit serial (VPD page 0x80) is the volume's is the disk. Its
// /dev node is checked to be that device (major:minor), and its size and
// read-only flag are read from the kernel, so the caller compares what
// the kernel has with what the attachment says rather than trusting that
// the newest /dev/sdX is the volume.
//
// # Records
//
// open-iscsi keeps a node record per target and portal; every Login
// writes it in full (CHAP, manual startup so that iscsid never logs in by
// itself at boot, how long I/O waits for a lost session) and every Logout
// deletes it. Logout works from the kernel's sessions, not from records,
// so it also ends a session that a crash left behind.
package iscsi

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/command"
	"github.com/modeguard/modeguard/pkg/iqn"
)

// iscsiadm's exit statuses that say something the caller acts on
// (open-iscsi's include/iscsi_err.h).
const (
	exitNoObjectsFound = 21 // no such session or record: nothing to undo
	exitLoginAuth      = 24 // the target refused the initiator's name or secret
)

// ErrLoginRefused is a login the target refused: this initiator is not on
// the volume's access list, or its CHAP secret is not the one the target
// has.
var ErrLoginRefused = errors.New("the target refused the login")

// ErrNoDisk is a target with no session, or a session without the
// volume's disk.
var ErrNoDisk = errors.New("no disk")

// Target is a volume's iSCSI target as a node logs in to it.
type Target struct {
	IQN    string
	Portal netip.AddrPort
	// User and Secret are this node's CHAP credentials for it.
	User, Secret string
}

func (t Target) validate() error {
	switch {
	case !iqn.Valid(t.IQN):
		return fmt.Errorf("target name %q is not an IQN (iqn.YYYY-MM.reversed.domain[:unique], lower case)", t.IQN)
	case !t.Portal.IsValid() || t.Portal.Port() == 0:
		return fmt.Errorf("target portal %q is not an address and port", t.Portal)
	case !ValidCHAPUser(t.User):
		return fmt.Errorf("CHAP user %q: want 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-'", t.User)
	case !ValidCHAPSecret(t.Secret):
		return errors.New("the CHAP secret is not 12 to 255 printable ASCII characters without blanks")
	}
	return nil
}

// Session is one of the kernel's iSCSI sessions.
type Session struct {
	ID     int // N of sessionN
	Target string
	Portal netip.AddrPort
	// State is the kernel's: LOGGED_IN, FAILED (recovering: I/O waits
	// for the replacement timeout) or FREE (given up: I/O fails).
	State string
}

// Disk is the disk a session leads to.
type Disk struct {
	Device   string // its /dev node
	Serial   string
	Size     int64 // bytes
	ReadOnly bool  // the kernel's read-only flag: the target reports the LUN write-protected to this initiator
	Session  int
}

// Initiator drives open-iscsi on this node.
type Initiator struct {
	// Sysfs and Dev are where sysfs and the device nodes are ("/sys" and
	// "/dev" when empty).
	Sysfs, Dev string
	// Iscsiadm is the iscsiadm command ("iscsiadm" when empty).
	Iscsiadm string
	// ReplacementTimeout is how long I/O on a session that lost its
	// target waits for it to come back before failing; 0 keeps
	// open-iscsi's (120 s). It bounds how long a writer on a fenced node
	// hangs before its writes fail.
	ReplacementTimeout time.Duration
	// LoginRetries is how often a first login is retried when the target
	// does not answer (0: once more). A refusal is never retried.
	LoginRetries int
}

func (in *Initiator) sysfs(elem ...string) string {
	root := in.Sysfs
	if root == "" {
		root = "/sys"
	}
	return filepath.Join(append([]string{root}, elem...)...)
}

func (in *Initiator) devDir() string {
	if in.Dev == "" {
		return "/dev"
	}
	return in.Dev
}

// Sessions lists the kernel's iSCSI sessions, ordered by ID.
func (in *Initiator) Sessions() ([]Session, error) {
	dirs, err := filepath.Glob(in.sysfs("class", "iscsi_session", "session*"))
	if err != nil {
		return nil, err
	}
	var list []Session
	for _, dir := range dirs {
		id, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(dir), "session"))
		if err != nil {
			continue
		}
		s := Session{ID: id}
		if s.Target, err = readAttr(filepath.Join(dir, "targetname")); err != nil {
			return nil, err
		}
		if s.State, err = readAttr(filepath.Join(dir, "state")); err != nil {
			return nil, err
		}
		conn := in.sysfs("class", "iscsi_connection", fmt.Sprintf("connection%d:0", id))
		addr, err := readAttr(filepath.Join(conn, "persistent_address"))
		if err != nil {
			return nil, err
		}
		port, err := readAttr(filepath.Join(conn, "persistent_port"))
		if err != nil {
			return nil, err
		}
		if s.Portal, err = netip.ParseAddrPort(joinHostPort(addr, port)); err != nil {
			return nil, fmt.Errorf("session %d: portal %s port %s: %w", id, addr, port, err)
		}
		list = append(list, s)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
	return list, nil
}

func joinHostPort(addr, port string) string {
	if strings.Contains(addr, ":") {
		return "[" + addr + "]:" + port
	}
	return addr + ":" + port
}

// sessionsTo lists the sessions to target at portal.
func (in *Initiator) sessionsTo(target string, portal netip.AddrPort) ([]Session, error) {
	all, err := in.Sessions()
	if err != nil {
		return nil, err
	}
	var list []Session
	for _, s := range all {
		if s.Target == target && s.Portal == portal {
			list = append(list, s)
		}
	}
	return list, nil
}

// Login logs this node in to t, unless a session to it is there already
// (one that is recovering counts: iscsid brings it back by itself). The
// node record is written in full first; a refused login deletes it again
// and is ErrLoginRefused.
func (in *Initiator) Login(ctx context.Context, t Target) error {
	if err := t.validate(); err != nil {
		return err
	}
	have, err := in.sessionsTo(t.IQN, t.Portal)
	if err != nil {
		return err
	}
	if len(have) > 0 {
		return nil
	}
	node := []string{"-m", "node", "-T", t.IQN, "-p", t.Portal.String()}
	if _, err := in.iscsiadm(ctx, append(node, "-o", "new")...); err != nil {
		return err
	}
	set := append(node, "-o", "update",
		"-n", "node.startup", "-v", "manual",
		"-n", "node.session.initial_login_retry_max", "-v", strconv.Itoa(in.LoginRetries+1),
		"-n", "node.session.auth.authmethod", "-v", "CHAP",
		"-n", "node.session.auth.username", "-v", t.User,
		"-n", "node.session.auth.password", "-v", t.Secret)
	if in.ReplacementTimeout > 0 {
		set = append(set, "-n", "node.session.timeo.replacement_timeout",
			"-v", strconv.Itoa(int((in.ReplacementTimeout+time.Second-1)/time.Second)))
	}
	if _, err := in.iscsiadm(ctx, set...); err != nil {
		in.deleteRecord(t.IQN, t.Portal)
		return err
	}
	if _, err := in.iscsiadm(ctx, append(node, "--login")...); err != nil {
		in.deleteRecord(t.IQN, t.Portal)
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == exitLoginAuth {
			return fmt.Errorf("logging in to %s at %s: %w (%v)", t.IQN, t.Portal, ErrLoginRefused, err)
		}
		return fmt.Errorf("logging in to %s at %s: %w", t.IQN, t.Portal, err)
	}
	return nil
}

// deleteRecord removes a node record after a failed login, so that no
// record of a target this node is not logged in to stays behind.
func (in *Initiator) deleteRecord(target string, portal netip.AddrPort) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	in.iscsiadm(ctx, "-m", "node", "-T", target, "-p", portal.String(), "-o", "delete")
}

// FindDisk returns the disk with the given serial behind this node's
// session to target at portal: ErrNoDisk when there is no session or the
// session has no such disk (yet: the kernel scans a new session's LUNs
// after the login).
func (in *Initiator) FindDisk(target string, portal netip.AddrPort, serial string) (Disk, error) {
	sessions, err := in.sessionsTo(target, portal)
	if err != nil {
		return Disk{}, err
	}
	switch len(sessions) {
	case 0:
		return Disk{}, fmt.Errorf("%w: this node has no session to %s at %s", ErrNoDisk, target, portal)
	case 1:
	default:
		return Disk{}, fmt.Errorf("this node has %d sessions to %s at %s; there should be one", len(sessions), target, portal)
	}
	s := sessions[0]
	found, err := in.disksOf(s, serial)
	if err != nil {
		return Disk{}, err
	}
	switch len(found) {
	case 0:
		return Disk{}, fmt.Errorf("%w: session %d to %s (%s) has no disk with serial %s", ErrNoDisk, s.ID, target, s.State, serial)
	case 1:
		return found[0], nil
	}
	return Disk{}, fmt.Errorf("session %d to %s has %d disks with serial %s", s.ID, target, len(found), serial)
}

// describe reads a disk's size, read-only flag and device number from its
// sysfs directory and checks that its /dev node is that device.
func (in *Initiator) describe(block string) (Disk, error) {
	name := filepath.Base(block)
	var d Disk
	sectors, err := readInt(filepath.Join(block, "size"))
	if err != nil {
		return d, err
	}
	d.Size = sectors * 512
	ro, err := readInt(filepath.Join(block, "ro"))
	if err != nil {
		return d, err
	}
	d.ReadOnly = ro != 0
	devNumber, err := readAttr(filepath.Join(block, "dev"))
	if err != nil {
		return d, err
	}
	d.Device = filepath.Join(in.devDir(), name)
	var st unix.Stat_t
	if err := unix.Stat(d.Device, &st); err != nil {
		return d, fmt.Errorf("disk %s: %w", name, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return d, fmt.Errorf("%s is not a block device", d.Device)
	}
	if got := fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)); got != devNumber {
		return d, fmt.Errorf("%s is device %s, but the kernel's %s is %s", d.Device, got, name, devNumber)
	}
	return d, nil
}

// parseUnitSerial reads the serial out of a VPD page 0x80 (SPC-4 7.8.15):
// a 4-byte header whose last two bytes are the length, then the serial,
// which targets pad with NULs or blanks.
func parseUnitSerial(page []byte) (string, error) {
	if len(page) < 4 || page[1] != 0x80 {
		return "", errors.New("not a unit serial number page")
	}
	n := int(page[2])<<8 | int(page[3])
	if len(page) < 4+n {
		return "", fmt.Errorf("unit serial page says %d bytes, has %d", n, len(page)-4)
	}
	return strings.TrimRight(string(page[4:4+n]), "\x00 "), nil
}

// WaitDisk waits until FindDisk finds the disk, polling sysfs, for as
// long as ctx allows; then it says what it last saw.
func (in *Initiator) WaitDisk(ctx context.Context, target string, portal netip.AddrPort, serial string) (Disk, error) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		d, err := in.FindDisk(target, portal, serial)
		if err == nil || !errors.Is(err, ErrNoDisk) {
			return d, err
		}
		select {
		case <-ctx.Done():
			return Disk{}, fmt.Errorf("waiting for the disk: %w: %v", ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// Logout flushes the disks of this node's sessions to target at portal,
// ends the sessions and deletes the node record. It works from the
// kernel's sessions, so it also ends one that a crash left behind, and
// it is done only when sysfs shows no session to the target any more. A
// disk that cannot be flushed stops it (what the disk holds would be
// lost), unless its session has already failed for good (FREE): then the
// target is gone and no flush can reach it.
func (in *Initiator) Logout(ctx context.Context, target string, portal netip.AddrPort) error {
	if !iqn.Valid(target) {
		return fmt.Errorf("target name %q is not an IQN", target)
	}
	sessions, err := in.sessionsTo(target, portal)
	if err != nil {
		return err
	}
	for _, s := range sessions {
		if err := in.flush(s); err != nil && s.State != "FREE" {
			return fmt.Errorf("flushing the disks of session %d (%s) to %s before logging out: %w", s.ID, s.State, target, err)
		}
	}
	node := []string{"-m", "node", "-T", target, "-p", portal.String()}
	if len(sessions) > 0 {
		if _, err := in.iscsiadm(ctx, append(node, "--logout")...); err != nil && !exitedWith(err, exitNoObjectsFound) {
			return fmt.Errorf("logging out of %s: %w", target, err)
		}
	}
	if _, err := in.iscsiadm(ctx, append(node, "-o", "delete")...); err != nil && !exitedWith(err, exitNoObjectsFound) {
		return fmt.Errorf("deleting the node record of %s: %w", target, err)
	}
	left, err := in.sessionsTo(target, portal)
	if err != nil {
		return err
	}
	if len(left) > 0 {
		return fmt.Errorf("session %d to %s is still there after logging out (%s)", left[0].ID, target, left[0].State)
	}
	return nil
}

// flush writes what the page cache holds for the session's disks and
// asks the target to make it durable (fsync of a block device flushes
// the device's write cache too).
func (in *Initiator) flush(s Session) error {
	blocks, err := filepath.Glob(in.diskGlob(s))
	if err != nil {
		return err
	}
	for _, block := range blocks {
		d, err := in.describe(block)
		if err != nil {
			return err
		}
		f, err := os.OpenFile(d.Device, os.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		err = f.Sync()
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", d.Device, err)
		}
	}
	return nil
}

func exitedWith(err error, code int) bool {
	var ee *exec.ExitError
	return errors.As(err, &ee) && ee.ExitCode() == code
}

// iscsiadm runs iscsiadm (package command: errors say what ran and what
// it said), with every value after -v left out of the quoted command
// line: one of them is the CHAP secret, and errors end up in logs and in
// the CO's events.
func (in *Initiator) iscsiadm(ctx context.Context, args ...string) ([]byte, error) {
	name := in.Iscsiadm
	if name == "" {
		name = "iscsiadm"
	}
	out, err := command.Run(ctx, name, args...)
	var ce *command.Error
	if errors.As(err, &ce) {
		ce.Line = redactedLine(name, args)
	}
	return out, err
}

// redactedLine is the command line with the values of -v left out.
func redactedLine(name string, args []string) string {
	parts := []string{name}
	for i, a := range args {
		if i > 0 && args[i-1] == "-v" {
			a = "..."
		}
		parts = append(parts, a)
	}
	return strings.Join(parts, " ")
}

func readAttr(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(data)), nil
}

func readInt(path string) (int64, error) {
	s, err := readAttr(path)
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return n, nil
}

// Rescan asks the kernel to read the disk's capacity again from the
// target (after the volume grew there) and describes it anew.
func (in *Initiator) Rescan(d Disk) (Disk, error) {
	name := filepath.Base(d.Device)
	block, err := filepath.EvalSymlinks(in.sysfs("class", "block", name))
	if err != nil {
		return Disk{}, err
	}
	if err := os.WriteFile(filepath.Join(block, "device", "rescan"), []byte("1"), 0); err != nil {
		return Disk{}, fmt.Errorf("rescanning %s: %w", d.Device, err)
	}
	now, err := in.describe(block)
	if err != nil {
		return Disk{}, err
	}
	now.Serial, now.Session = d.Serial, d.Session
	return now, nil
}

// CheckAttached is Check for a disk just found after a login, with one
// second look where the kernel's first may have been wrong. The kernel
// learns whether the target write-protects a disk from a MODE SENSE it
// sends while making the disk; when that probe fails (a target slow to
// answer under load), sd assumes the disk writable. A disk of a read-only
// attachment that looks writable is therefore rescanned once, which sends
// the probe again, before it is refused. Nothing else is retried, and a
// disk still writable after the rescan is refused as before: the check
// fails closed.
func (in *Initiator) CheckAttached(d Disk, size int64, readOnly bool) (Disk, error) {
	err := d.Check(size, readOnly)
	if err == nil || !readOnly || d.ReadOnly || d.Size < size {
		return d, err
	}
	again, rerr := in.Rescan(d)
	if rerr != nil {
		return d, fmt.Errorf("%w (and asking the kernel to probe it again failed: %v)", err, rerr)
	}
	if err := again.Check(size, readOnly); err != nil {
		return again, fmt.Errorf("%w, also after the kernel probed it again", err)
	}
	return again, nil
}

// Check compares the disk the kernel has with the attachment: at least
// the volume's size when it was attached (it may have grown since), and
// whether this node may only read. A disk the target
// lets this node write for a read-only attachment is refused as firmly as
// the opposite: the target's access list is then not what the controller
// published, and a read-only mount on top would only hide that.
func (d Disk) Check(size int64, readOnly bool) error {
	switch {
	case d.Size < size:
		return fmt.Errorf("disk %s (serial %s) has %d bytes, the volume %d", d.Device, d.Serial, d.Size, size)
	case d.ReadOnly && !readOnly:
		return fmt.Errorf("the target serves disk %s (serial %s) read-only to this node, but it is attached read/write", d.Device, d.Serial)
	case !d.ReadOnly && readOnly:
		return fmt.Errorf("the target lets this node write disk %s (serial %s), but it is attached read-only", d.Device, d.Serial)
	}
	return nil
}

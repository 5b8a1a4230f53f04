// Package lio serves image files as iSCSI logical units through the Linux
// kernel's LIO target, configured entirely through configfs: directories
// made and removed, attributes written, symbolic links. No daemon and no
// library stand between it and the kernel, and nothing is remembered here:
// every question (who may log in, read-only or not, is the volume served)
// is answered by reading configfs back, which is the kernel's own state.
//
// # Layout
//
// Each volume is a target of its own, so its access list is its own:
//
//	core/fileio_<hbaIndex>/<name>               the backstore: the volume's file or device, its unit serial
//	iscsi/<prefix>:<name>/tpgt_1                the portal group: CHAP required, no demo mode
//	iscsi/<prefix>:<name>/tpgt_1/np/<ip:port>   where it listens
//	iscsi/<prefix>:<name>/tpgt_1/lun/lun_0      the volume, linked to the backstore
//	iscsi/<prefix>:<name>/tpgt_1/acls/<IQN>     one node: its CHAP name and secret,
//	    lun_0/  (write_protect)                 the volume mapped to it, read-only or not
//
// # Access list
//
// The access list is exactly the initiators given to SetInitiators. The
// portal group refuses every initiator without an ACL of its own
// (generate_node_acls=0) and every login without CHAP (authentication=1),
// so a node name alone is not an identity. A mapped LUN starts
// write-protected (prod_mode_write_protect=1) and is opened for writing
// only when that initiator may write; LIO then refuses every write command
// from a read-only initiator with DATA PROTECT, whatever its kernel's own
// read-only flag says. Removing an initiator unmaps the volume from it
// and deletes its ACL, which closes its sessions before the rmdir returns:
// its next command finds no session and its reconnect is refused. That is
// the fence.
package lio

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/iqn"
)

// DefaultRoot is where configfs shows the LIO target.
const DefaultRoot = "/sys/kernel/config/target"

// hbaIndex numbers the fileio HBA that holds this package's backstores,
// one of its own so they are told apart from an operator's (targetcli
// counts its HBAs up from 0).
const hbaIndex = 4207

// tpg is the one portal group of every target.
const tpg = "tpgt_1"

// lunDir is the volume's LUN in its portal group and in every ACL.
const lunDir = "lun_0"

// Config says where LIO is and how its targets are named and reached.
type Config struct {
	// Root is LIO's configfs directory (DefaultRoot when empty).
	Root string
	// Prefix names every target: Prefix + ":" + the volume's name. An IQN
	// (iqn.YYYY-MM.reversed.domain).
	Prefix string
	// Portal is the address and port the targets listen on.
	Portal netip.AddrPort
}

// LUN is one volume served over iSCSI.
type LUN struct {
	// Name identifies the volume in configfs and in its target's IQN.
	Name string
	// Image is the absolute path of the image file, or of a block device
	// (a loop device over the image): LIO serves a file at the size it
	// was enabled with, a block device at its size of the moment, so a
	// volume that must grow while served is given as a device.
	Image string
	// Size is the size the initiators see, in bytes (a multiple of 512),
	// for a file.
	Size int64
	// Serial is the unit serial number (VPD page 0x80) a node finds the
	// disk by.
	Serial string
}

// Initiator is a node allowed to log in to a volume's target.
type Initiator struct {
	IQN      string
	ReadOnly bool
	// User and Secret are the CHAP credentials the node logs in with.
	User, Secret string
}

// Target configures the LIO target.
type Target struct {
	cfg Config
}

var namePattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

// New checks cfg and that LIO is there to configure.
func New(cfg Config) (*Target, error) {
	if cfg.Root == "" {
		cfg.Root = DefaultRoot
	}
	if !iqn.Valid(cfg.Prefix) || strings.Contains(cfg.Prefix, ":") {
		return nil, fmt.Errorf("target name prefix %q is not an IQN without a unique part (iqn.YYYY-MM.reversed.domain, lower case)", cfg.Prefix)
	}
	if !cfg.Portal.IsValid() || cfg.Portal.Port() == 0 {
		return nil, fmt.Errorf("portal %q is not an address and port", cfg.Portal)
	}
	if _, err := os.Stat(filepath.Join(cfg.Root, "core")); err != nil {
		return nil, fmt.Errorf("no LIO target at %s (configfs mounted? target_core_mod loaded?): %w", cfg.Root, err)
	}
	return &Target{cfg: cfg}, nil
}

// IQN is the name of name's target.
func (t *Target) IQN(name string) string { return t.cfg.Prefix + ":" + name }

func (t *Target) backstore(name string) string {
	return filepath.Join(t.cfg.Root, "core", "fileio_"+strconv.Itoa(hbaIndex), name)
}

func (t *Target) group(name string) string {
	return filepath.Join(t.cfg.Root, "iscsi", t.IQN(name), tpg)
}

func (t *Target) portal() string {
	if t.cfg.Portal.Addr().Is6() {
		return "[" + t.cfg.Portal.Addr().String() + "]:" + strconv.Itoa(int(t.cfg.Portal.Port()))
	}
	return t.cfg.Portal.String()
}

func checkLUN(l LUN) error {
	switch {
	case !namePattern.MatchString(l.Name):
		return fmt.Errorf("volume name %q: want 1 to 63 of a-z, 0-9 and -, starting with a letter or digit", l.Name)
	case !filepath.IsAbs(l.Image) || filepath.Clean(l.Image) != l.Image || strings.ContainsAny(l.Image, ",\n"):
		return fmt.Errorf("image %q: want a clean absolute path without commas", l.Image)
	case l.Size <= 0 || l.Size%512 != 0:
		return fmt.Errorf("size %d: want a positive multiple of 512", l.Size)
	case !iscsi.ValidSerial(l.Serial):
		return fmt.Errorf("serial %q: want 32 lower-case hex digits (the disk's world-wide name is made of them)", l.Serial)
	}
	return nil
}

func checkInitiator(i Initiator) error {
	switch {
	case !iqn.Valid(i.IQN):
		return fmt.Errorf("initiator %q is not an IQN (iqn.YYYY-MM.reversed.domain[:name], lower case, at most %d bytes)", i.IQN, iqn.MaxLength)
	case !iscsi.ValidCHAPUser(i.User):
		return fmt.Errorf("initiator %s: CHAP user %q: want 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-'", i.IQN, i.User)
	case !iscsi.ValidCHAPSecret(i.Secret):
		return fmt.Errorf("initiator %s: CHAP secret: want 12 to 255 printable ASCII characters without blanks", i.IQN)
	}
	return nil
}

// Export serves l on its own target with nobody allowed in. It is
// idempotent; a backstore of l's name that holds another image or serial
// is refused rather than taken over.
func (t *Target) Export(l LUN) error {
	if err := checkLUN(l); err != nil {
		return err
	}
	if err := t.ensureBackstore(l); err != nil {
		return err
	}
	g := t.group(l.Name)
	if err := mkdirAll(g); err != nil {
		return err
	}
	// Closed before anything is served: CHAP for every login, explicit
	// ACLs only, every newly mapped LUN read-only until opened.
	for _, a := range []struct{ attr, value string }{
		{"attrib/authentication", "1"},
		{"attrib/generate_node_acls", "0"},
		{"attrib/demo_mode_write_protect", "1"},
		{"attrib/prod_mode_write_protect", "1"},
		{"attrib/demo_mode_discovery", "0"},
	} {
		if err := writeAttr(filepath.Join(g, a.attr), a.value); err != nil {
			return err
		}
	}
	lun := filepath.Join(g, "lun", lunDir)
	if err := mkdirAll(lun); err != nil {
		return err
	}
	if err := ensureLink(filepath.Join(lun, l.Name), t.backstore(l.Name)); err != nil {
		return err
	}
	if err := mkdirAll(filepath.Join(g, "np", t.portal())); err != nil {
		return err
	}
	if v, err := readAttr(filepath.Join(g, "enable")); err != nil || v != "1" {
		if err := writeAttr(filepath.Join(g, "enable"), "1"); err != nil {
			return err
		}
	}
	return nil
}

// ensureBackstore makes l's fileio backstore, or checks that the one there
// is l's.
func (t *Target) ensureBackstore(l LUN) error {
	dir := t.backstore(l.Name)
	if _, err := os.Stat(dir); err == nil {
		return t.checkBackstore(l)
	}
	if err := mkdirAll(dir); err != nil {
		return err
	}
	// A fileio backstore without fd_buffered_io writes through (O_DSYNC):
	// a write the initiator was told is done is on the target's disk.
	control := fmt.Sprintf("fd_dev_name=%s,fd_dev_size=%d", l.Image, l.Size)
	if err := writeAttr(filepath.Join(dir, "control"), control); err != nil {
		return err
	}
	// The serial can only change while nothing exports the device.
	if err := writeAttr(filepath.Join(dir, "wwn", "vpd_unit_serial"), l.Serial); err != nil {
		return err
	}
	if err := writeAttr(filepath.Join(dir, "enable"), "1"); err != nil {
		return err
	}
	return t.checkBackstore(l)
}

// checkBackstore compares the backstore of l's name with l, as the kernel
// describes it.
func (t *Target) checkBackstore(l LUN) error {
	got, err := t.describe(l.Name)
	if err != nil {
		return err
	}
	if got.Image != l.Image || got.Serial != l.Serial {
		return fmt.Errorf("backstore %s serves %s (serial %s), not %s (serial %s)", l.Name, got.Image, got.Serial, l.Image, l.Serial)
	}
	return nil
}

// describe reads a backstore's image and serial from configfs. Its info
// attribute reads like "... File: /pool/a.img  Size: 67108864  Mode:
// O_DSYNC ..." (the size is not compared: a grown volume's differs) and wwn/vpd_unit_serial like "T10 VPD Unit Serial Number:
// abc".
func (t *Target) describe(name string) (LUN, error) {
	dir := t.backstore(name)
	info, err := readAttr(filepath.Join(dir, "info"))
	if err != nil {
		return LUN{}, err
	}
	l := LUN{Name: name}
	fields := strings.Fields(info)
	for i := 0; i+1 < len(fields); i++ {
		if fields[i] == "File:" {
			l.Image = fields[i+1]
		}
	}
	serial, err := readAttr(filepath.Join(dir, "wwn", "vpd_unit_serial"))
	if err != nil {
		return LUN{}, err
	}
	l.Serial = strings.TrimSpace(serial[strings.LastIndex(serial, ":")+1:])
	return l, nil
}

// SetInitiators makes the access list of name's target exactly want.
// Initiators that leave are removed first, so a fence never waits on
// anything that could fail later; each change is read back from configfs.
func (t *Target) SetInitiators(name string, want []Initiator) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("volume name %q: want 1 to 63 of a-z, 0-9 and -", name)
	}
	seen := map[string]bool{}
	for _, i := range want {
		if err := checkInitiator(i); err != nil {
			return err
		}
		if seen[i.IQN] {
			return fmt.Errorf("initiator %s is listed twice", i.IQN)
		}
		seen[i.IQN] = true
	}
	g := t.group(name)
	if _, err := os.Stat(g); err != nil {
		return fmt.Errorf("volume %s is not exported: %w", name, err)
	}
	have, err := listDirs(filepath.Join(g, "acls"))
	if err != nil {
		return err
	}
	for _, iqn := range have {
		if !seen[iqn] {
			if err := t.revoke(name, iqn); err != nil {
				return err
			}
		}
	}
	for _, i := range want {
		if err := t.grant(name, i); err != nil {
			return err
		}
	}
	return nil
}

// grant gives one initiator its ACL, credentials and mapping, and sets
// the mapping's write protection, checking it took.
func (t *Target) grant(name string, i Initiator) error {
	acl := filepath.Join(t.group(name), "acls", i.IQN)
	if err := mkdirAll(acl); err != nil {
		return err
	}
	for attr, value := range map[string]string{"auth/userid": i.User, "auth/password": i.Secret} {
		if v, err := readAttr(filepath.Join(acl, attr)); err == nil && v == value {
			continue
		}
		if err := writeAttr(filepath.Join(acl, attr), value); err != nil {
			return err
		}
	}
	mapped := filepath.Join(acl, lunDir)
	if err := mkdirAll(mapped); err != nil {
		return err
	}
	if err := ensureLink(filepath.Join(mapped, name), filepath.Join(t.group(name), "lun", lunDir)); err != nil {
		return err
	}
	want := "1"
	if !i.ReadOnly {
		want = "0"
	}
	wp := filepath.Join(mapped, "write_protect")
	if v, err := readAttr(wp); err == nil && v == want {
		return nil
	}
	if err := writeAttr(wp, want); err != nil {
		return err
	}
	if v, err := readAttr(wp); err != nil || v != want {
		return fmt.Errorf("%s: write_protect reads %q after writing %s (%v)", mapped, v, want, err)
	}
	return nil
}

// revoke unmaps name's volume from iqn and deletes its ACL. The rmdir of
// the ACL returns once the kernel has shut the initiator's sessions down.
func (t *Target) revoke(name, iqn string) error {
	acl := filepath.Join(t.group(name), "acls", iqn)
	mapped := filepath.Join(acl, lunDir)
	links, err := os.ReadDir(mapped)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, l := range links {
		if l.Type()&os.ModeSymlink != 0 {
			if err := os.Remove(filepath.Join(mapped, l.Name())); err != nil {
				return fmt.Errorf("unmapping %s from %s: %w", name, iqn, err)
			}
		}
	}
	if err := rmdir(mapped); err != nil {
		return err
	}
	if err := rmdir(acl); err != nil {
		return fmt.Errorf("removing initiator %s from %s: %w", iqn, name, err)
	}
	if _, err := os.Stat(acl); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("initiator %s is still in %s's access list after removing it", iqn, name)
	}
	return nil
}

// Initiators reads name's access list back from configfs; secrets are
// not read.
func (t *Target) Initiators(name string) ([]Initiator, error) {
	if !namePattern.MatchString(name) {
		return nil, fmt.Errorf("volume name %q: want 1 to 63 of a-z, 0-9 and -", name)
	}
	acls := filepath.Join(t.group(name), "acls")
	iqns, err := listDirs(acls)
	if err != nil {
		return nil, err
	}
	var out []Initiator
	for _, iqn := range iqns {
		i := Initiator{IQN: iqn, ReadOnly: true}
		if user, err := readAttr(filepath.Join(acls, iqn, "auth", "userid")); err == nil {
			i.User = user
		}
		// A mapping that cannot be read is reported read-only: it is
		// never taken for more access than it has.
		if wp, err := readAttr(filepath.Join(acls, iqn, lunDir, "write_protect")); err == nil && wp == "0" {
			i.ReadOnly = false
		}
		out = append(out, i)
	}
	return out, nil
}

// Unexport stops serving name: every initiator is fenced first, then the
// target and the backstore are removed. The image file is left alone.
func (t *Target) Unexport(name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("volume name %q: want 1 to 63 of a-z, 0-9 and -", name)
	}
	g := t.group(name)
	if _, err := os.Stat(g); err == nil {
		if err := t.SetInitiators(name, nil); err != nil {
			return err
		}
		if v, err := readAttr(filepath.Join(g, "enable")); err != nil || v != "0" {
			if err := writeAttr(filepath.Join(g, "enable"), "0"); err != nil {
				return err
			}
		}
		lun := filepath.Join(g, "lun", lunDir)
		links, _ := os.ReadDir(lun)
		for _, l := range links {
			if l.Type()&os.ModeSymlink != 0 {
				if err := os.Remove(filepath.Join(lun, l.Name())); err != nil {
					return err
				}
			}
		}
		if err := rmdir(lun); err != nil {
			return err
		}
		nps, err := listDirs(filepath.Join(g, "np"))
		if err != nil {
			return err
		}
		for _, np := range nps {
			if err := rmdir(filepath.Join(g, "np", np)); err != nil {
				return err
			}
		}
		if err := rmdir(g); err != nil {
			return err
		}
	}
	if err := rmdir(filepath.Join(t.cfg.Root, "iscsi", t.IQN(name))); err != nil {
		return err
	}
	return rmdir(t.backstore(name))
}

// writeAttr writes a configfs attribute in one write, as configfs wants.
func writeAttr(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("LIO: %w", err)
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("LIO: writing %q to %s: %w", value, path, err)
	}
	return nil
}

func readAttr(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("LIO: %w", err)
	}
	return strings.TrimRight(string(b), "\n\x00"), nil
}

// mkdirAll makes a configfs group and its parents; configfs makes a
// group's default subgroups itself.
func mkdirAll(path string) error {
	if err := os.MkdirAll(path, 0o755); err != nil {
		return fmt.Errorf("LIO: %w", err)
	}
	return nil
}

func rmdir(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("LIO: %w", err)
	}
	return nil
}

// ensureLink links link to target unless it already points there
// (configfs reads a link back relative to the link's directory).
func ensureLink(link, target string) error {
	if got, err := os.Readlink(link); err == nil {
		if !filepath.IsAbs(got) {
			got = filepath.Join(filepath.Dir(link), got)
		}
		if filepath.Clean(got) == filepath.Clean(target) {
			return nil
		}
		return fmt.Errorf("LIO: %s links to %s, not %s", link, got, target)
	}
	if err := os.Symlink(target, link); err != nil {
		return fmt.Errorf("LIO: %w", err)
	}
	return nil
}

// listDirs lists the subdirectories of dir ("" entries for a missing dir).
func listDirs(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("LIO: %w", err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

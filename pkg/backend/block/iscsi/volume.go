package iscsi

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/modeguard/modeguard/pkg/iqn"
)

// The volume context keys that carry a volume's iSCSI coordinates from
// the storage target to the node (CreateVolume's answer, which the CO
// hands to NodeStageVolume).
const (
	ContextTransport = "transport" // TransportName for a volume served over iSCSI
	ContextTarget    = "iscsiTarget"
	ContextPortal    = "iscsiPortal"
	ContextSerial    = "iscsiSerial"
)

// TransportName is ContextTransport's value for a volume served over
// iSCSI.
const TransportName = "iscsi"

// VolumeSerial is a volume's unit serial: 32 hex digits of a hash of its
// id. LIO makes the disk's world-wide name of the serial's hex digits, so
// serials that differ only in other characters would give disks one WWN,
// which multipath would merge; these differ in 128 bits. The node derives
// it as the target does, so a volume context that names another volume's
// serial is caught.
func VolumeSerial(volumeID string) string {
	sum := sha256.Sum256([]byte("serial\x00" + volumeID))
	return hex.EncodeToString(sum[:])[:32]
}

// Volume is where a node finds one volume's disk.
type Volume struct {
	Target string
	Portal netip.AddrPort
	Serial string
}

// Context is v as volume context keys.
func (v Volume) Context() map[string]string {
	return map[string]string{
		ContextTransport: TransportName,
		ContextTarget:    v.Target,
		ContextPortal:    v.Portal.String(),
		ContextSerial:    v.Serial,
	}
}

// FromContext reads a volume's iSCSI coordinates from its volume context:
// ok is false for a volume that is not served over iSCSI, and the error
// says which key is wrong for one that is.
func FromContext(volumeID string, ctx map[string]string) (v Volume, ok bool, err error) {
	if ctx[ContextTransport] == "" {
		return Volume{}, false, nil
	}
	if t := ctx[ContextTransport]; t != TransportName {
		return Volume{}, true, fmt.Errorf("volume context %s=%q: the only network transport is %q", ContextTransport, t, TransportName)
	}
	v.Target = ctx[ContextTarget]
	if !iqn.Valid(v.Target) {
		return Volume{}, true, fmt.Errorf("volume context %s=%q is not an IQN", ContextTarget, v.Target)
	}
	if v.Portal, err = netip.ParseAddrPort(ctx[ContextPortal]); err != nil || v.Portal.Port() == 0 {
		return Volume{}, true, fmt.Errorf("volume context %s=%q is not an address and port", ContextPortal, ctx[ContextPortal])
	}
	v.Serial = ctx[ContextSerial]
	if want := VolumeSerial(volumeID); v.Serial != want {
		return Volume{}, true, fmt.Errorf("volume context %s=%q is not volume %s's serial (%s)", ContextSerial, v.Serial, volumeID, want)
	}
	return v, true, nil
}

// DisksWithSerial finds every disk with the given unit serial behind any
// of the kernel's iSCSI sessions, whatever target they lead to: what a
// node checks when it has no record of the session (a stage interrupted
// before it was recorded) or its record may be stale.
func (in *Initiator) DisksWithSerial(serial string) ([]Disk, []Session, error) {
	sessions, err := in.Sessions()
	if err != nil {
		return nil, nil, err
	}
	var disks []Disk
	var of []Session
	for _, s := range sessions {
		found, err := in.disksOf(s, serial)
		if err != nil {
			return nil, nil, err
		}
		for _, d := range found {
			disks, of = append(disks, d), append(of, s)
		}
	}
	return disks, of, nil
}

// SerialOf reads the unit serial of the disk named (sdX) from sysfs; ""
// for a disk that is not SCSI or has no serial page.
func (in *Initiator) SerialOf(name string) string {
	if strings.ContainsRune(name, '/') || name == "" {
		return ""
	}
	page, err := os.ReadFile(in.sysfs("class", "block", name, "device", "vpd_pg80"))
	if err != nil {
		return ""
	}
	serial, err := parseUnitSerial(page)
	if err != nil {
		return ""
	}
	return serial
}

// diskGlob is where a session's disks are in sysfs.
func (in *Initiator) diskGlob(s Session) string {
	return in.sysfs("class", "iscsi_session", fmt.Sprintf("session%d", s.ID), "device", "target*", "*", "block", "*")
}

// disksOf lists the disks of session s with the given serial.
func (in *Initiator) disksOf(s Session, serial string) ([]Disk, error) {
	blocks, err := filepath.Glob(in.diskGlob(s))
	if err != nil {
		return nil, err
	}
	var found []Disk
	for _, block := range blocks {
		page, err := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(block)), "vpd_pg80"))
		if err != nil {
			continue // a LUN without a unit serial is not a volume of ours
		}
		got, err := parseUnitSerial(page)
		if err != nil || got != serial {
			continue
		}
		d, err := in.describe(block)
		if err != nil {
			return nil, err
		}
		d.Serial, d.Session = got, s.ID
		found = append(found, d)
	}
	return found, nil
}

package iscsi

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"regexp"
	"strings"

	"github.com/modeguard/modeguard/pkg/iqn"
)

// InitiatorNameFile is where open-iscsi keeps the node's initiator name:
// iscsid logs in under it, so it is the node's identity on every target's
// access list.
const InitiatorNameFile = "/etc/iscsi/initiatorname.iscsi"

var (
	userPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)
	// A secret goes to configfs as one line, to iscsiadm as one argument
	// and into CHAP as text: printable ASCII without blanks. RFC 3720 asks
	// for at least 12 bytes.
	secretPattern = regexp.MustCompile(`^[!-~]{12,255}$`)
	serialPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)
)

// ValidCHAPUser tells whether s can be a CHAP user name: 1 to 64 of
// A-Z a-z 0-9 . _ -.
func ValidCHAPUser(s string) bool { return userPattern.MatchString(s) }

// ValidCHAPSecret tells whether s can be a CHAP secret: 12 to 255
// printable ASCII characters without blanks.
func ValidCHAPSecret(s string) bool { return secretPattern.MatchString(s) }

// ValidSerial tells whether s can be a volume's unit serial: exactly 32
// lower-case hex digits. LIO makes the disk's world-wide name (VPD page
// 0x83, what udev's by-id links and multipath go by) from the serial's
// first 25 hex digits and drops every other character, so a serial of
// names ("vol-a", "vol-b") would give two volumes one world-wide name and
// a multipath daemon would merge their disks. Serials are derived from a
// hash of the volume's identity, which makes them unique in those digits.
func ValidSerial(s string) bool { return serialPattern.MatchString(s) }

// ReadInitiatorName returns the InitiatorName of open-iscsi's file at path
// (InitiatorNameFile on a node), checked to be an IQN: the node reports
// it, so a malformed one is refused here rather than by every target.
func ReadInitiatorName(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("reading the iSCSI initiator name: %w (open-iscsi writes it when installed)", err)
	}
	name := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		key, value, ok := strings.Cut(line, "=")
		if !ok || strings.HasPrefix(line, "#") || strings.TrimSpace(key) != "InitiatorName" {
			continue
		}
		if name != "" {
			return "", fmt.Errorf("%s names more than one initiator", path)
		}
		name = strings.TrimSpace(value)
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	if name == "" {
		return "", fmt.Errorf("%s has no InitiatorName= line", path)
	}
	if !iqn.Valid(name) {
		return "", fmt.Errorf("%s: initiator name %q is not an IQN (iqn.YYYY-MM.reversed.domain[:unique], lower case)", path, name)
	}
	return name, nil
}

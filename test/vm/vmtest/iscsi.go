package vmtest

import (
	"context"
	"fmt"
	"strings"
)

// iscsidScript gives the VM an open-iscsi configuration of its own and
// starts iscsid. /etc/iscsi in a VM is the host's (9p), which every VM
// would share: one initiator name, one node database. A tmpfs over it in
// the VM's own mount table keeps both per VM and leaves the host's alone.
const iscsidScript = `set -e
mkdir -p /run/lock
mount -t tmpfs -o mode=0755 mgiscsi /etc/iscsi
printf 'InitiatorName=%s\n' "$1" > /etc/iscsi/initiatorname.iscsi
iscsid
`

// StartISCSIInitiator makes the VM an iSCSI initiator named iqn: its own
// /etc/iscsi (a tmpfs in the VM) with that initiator name, and iscsid
// running, which iscsiadm needs to log in. It needs the host's open-iscsi
// (Debian: open-iscsi), which the VM runs through 9p. iscsid goes when
// the VM does.
func (v *VM) StartISCSIInitiator(ctx context.Context, iqn string) error {
	out, code, err := v.Run(ctx, "sh", "-c", iscsidScript, "sh", iqn)
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("%s: starting iscsid: exit %d: %s", v.Name, code, strings.TrimSpace(out))
	}
	return nil
}

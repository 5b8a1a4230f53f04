package lio

import (
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
)

// TestSanityOverISCSIInVM runs csi-sanity against the controller (on the
// host, holding no pool), the storage target role (in the target VM,
// serving the volumes over iSCSI from LIO) and the node plugin in a node
// VM, which logs in with the kernel's initiator: every stage is a real
// login, a real disk found by its serial, mkfs and mount; every
// ControllerUnpublishVolume a real fence. Filesystem volumes: the raw
// block ones are the modes test's (csi-sanity runs once per process).
func TestSanityOverISCSIInVM(t *testing.T) {
	// The attach limit is small so that its spec fits the target's disk.
	e := setupCSI(t, 1, replacementTimeout, "--max-volumes-per-node", "3")
	vm := e.env.nodes[0]
	cfg := vm.SanityConfig(e.ctx)
	cfg.ControllerAddress = e.ctrl.Endpoint
	cfg.TestVolumeParameters = map[string]string{"backend": "block"}
	cfg.TestVolumeMutableParameters = map[string]string{"readAheadKiB": "512"}
	cfg.TestVolumeAccessType = "mount"
	cfg.TestVolumeSize = 16 << 20
	cfg.TestVolumeExpandSize = 32 << 20
	cfg.IdempotentCount = 10
	cfg.TestNodeVolumeAttachLimit = true
	sanity.Test(t, cfg)
	e.wantNoISCSI(vm.Name)
	e.wantNoLoopDevices(vm.Name)
}

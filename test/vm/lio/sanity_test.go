package lio

import (
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/modeguard/modeguard/test/testenv"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
)

// TestSanityOverISCSIInVM runs csi-sanity against the controller (on the
// host, holding no pool), the storage target role (in the target VM,
// serving the volumes over iSCSI from LIO) and the node plugin in a node
// VM, which logs in with the kernel's initiator: every stage is a real
// login, a real disk found by its serial; every ControllerUnpublishVolume a
// real fence. Once with filesystem volumes (mkfs, mount, growing the
// mounted filesystem) and once with raw block volumes, in one Ginkgo
// suite (it runs once per process).
func TestSanityOverISCSIInVM(t *testing.T) {
	testenv.OnlyInTestAll(t, "test/sanity/target (csi-sanity through a storage target) and the iSCSI tests of test/vm/lio")
	// The attach limit is small so that its spec fits the target's disk.
	e := setupCSI(t, 1, replacementTimeout, "--max-volumes-per-node", "3")
	vm := e.env.nodes[0]
	var contexts []*sanity.TestContext
	for _, accessType := range []string{"mount", "block"} {
		cfg := vm.SanityConfig(e.ctx)
		cfg.ControllerAddress = e.ctrl.Endpoint
		cfg.TargetPath = vm.Path("sanity-"+accessType, "target")
		cfg.StagingPath = vm.Path("sanity-"+accessType, "staging")
		cfg.TestVolumeParameters = map[string]string{"backend": "block"}
		cfg.TestVolumeMutableParameters = map[string]string{"readAheadKiB": "512"}
		cfg.TestVolumeAccessType = accessType
		cfg.TestVolumeSize = 16 << 20
		cfg.TestVolumeExpandSize = 32 << 20
		cfg.IdempotentCount = 10
		cfg.TestNodeVolumeAttachLimit = true
		ginkgo.Describe("access type "+accessType, func() {
			contexts = append(contexts, sanity.GinkgoTest(&cfg))
		})
	}
	gomega.RegisterFailHandler(ginkgo.Fail)
	ginkgo.RunSpecs(t, "csi-sanity over iSCSI")
	for _, sc := range contexts {
		sc.Finalize()
	}
	e.wantNoISCSI(vm.Name)
	e.wantNoLoopDevices(vm.Name)
}

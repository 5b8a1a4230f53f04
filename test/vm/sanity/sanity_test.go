// Package sanity runs csi-sanity against the NFS backend with the node
// specs served by the node plugin inside a VM, so every stage is a real
// kernel NFS mount of a real ganesha export.
package sanity

import (
	"context"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

func TestSanityNFSKernelClientInVM(t *testing.T) {
	testenv.OnlyInTestAll(t, "test/sanity/nfs and TestKernelNFSAccessModes")
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	c := vmtest.Start(t, vmtest.Options{VMs: 1, Binary: bin})
	vm := c.VMs[0]
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	// The attach limit is small so that its spec stays quick: each NFS
	// volume here is an xfs image of at least 300 MiB.
	ctrl := testenv.StartNFSController(ctx, t, bin, c.ServerNS, c.Server.String(), "--max-volumes-per-node", "3")
	t.Cleanup(func() {
		if t.Failed() {
			if log, err := vm.PluginLog(context.Background()); err == nil {
				t.Logf("node plugin log:\n%s", log)
			}
		}
	})
	if err := vm.StartPlugin(ctx, "--max-volumes-per-node", "3"); err != nil {
		t.Fatal(err)
	}

	cfg := vm.SanityConfig(ctx)
	cfg.ControllerAddress = ctrl.Endpoint
	cfg.TestVolumeParameters = map[string]string{"backend": "nfs"}
	cfg.TestVolumeMutableParameters = map[string]string{"rootSquash": "false"}
	cfg.TestVolumeSize = 300 << 20
	cfg.TestVolumeExpandSize = 364 << 20
	cfg.IdempotentCount = 10
	cfg.TestNodeVolumeAttachLimit = true
	sanity.Test(t, cfg)
}

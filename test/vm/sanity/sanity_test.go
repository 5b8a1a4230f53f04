// Package sanity runs csi-sanity against the NFS backend with the node
// specs served by the node plugin inside a VM, so every stage is a real
// kernel NFS mount of a real ganesha export.
package sanity

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/test/testenv"
	"github.com/modeguard/modeguard/test/vm/vmtest"
)

func TestSanityNFSKernelClientInVM(t *testing.T) {
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

	// Target and staging paths live on the VM's own tmpfs: sanity creates,
	// checks and removes them through the VM, where the node plugin mounts.
	run := func(name string, args ...string) (string, error) {
		out, code, err := vm.Run(ctx, name, args...)
		if err != nil {
			return out, err
		}
		if code != 0 {
			return out, fmt.Errorf("%s %s in %s: exit %d: %s", name, strings.Join(args, " "), vm.Name, code, out)
		}
		return out, nil
	}
	mkdir := func(p string) (string, error) { _, err := run("mkdir", "-p", p); return p, err }
	remove := func(p string) error { _, err := run("rm", "-rf", p); return err }

	cfg := sanity.NewTestConfig()
	cfg.Address = "passthrough:///" + vm.NodeEndpoint()
	cfg.DialOptions = []grpc.DialOption{grpc.WithContextDialer(c.Dialer()),
		grpc.WithTransportCredentials(insecure.NewCredentials())}
	cfg.ControllerAddress = ctrl.Endpoint
	cfg.TargetPath = vm.Path("sanity", "target")
	cfg.StagingPath = vm.Path("sanity", "staging")
	cfg.CreateTargetDir, cfg.CreateStagingDir = mkdir, mkdir
	cfg.RemoveTargetPath, cfg.RemoveStagingPath = remove, remove
	cfg.CheckPath = func(p string) (sanity.PathKind, error) {
		out, err := run("stat", "-c", "%F", p)
		switch {
		case err != nil && strings.Contains(out, "No such file"):
			return sanity.PathIsNotFound, nil
		case err != nil:
			return sanity.PathIsOther, err
		case strings.Contains(out, "directory"):
			return sanity.PathIsDir, nil
		case strings.Contains(out, "regular"):
			return sanity.PathIsFile, nil
		}
		return sanity.PathIsOther, nil
	}
	cfg.TestVolumeParameters = map[string]string{"backend": "nfs"}
	cfg.TestVolumeMutableParameters = map[string]string{"rootSquash": "false"}
	cfg.TestVolumeSize = 300 << 20
	cfg.TestVolumeExpandSize = 364 << 20
	cfg.IdempotentCount = 10
	cfg.TestNodeVolumeAttachLimit = true
	sanity.Test(t, cfg)
}

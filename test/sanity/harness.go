// Package sanity runs the CSI conformance suite (csi-test's sanity package)
// against a real modeguard process: real loop devices, mkfs and mounts, with
// pools and state on a size-capped tmpfs. Ginkgo allows one suite per
// process, so each access type has its own test package calling Run.
package sanity

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/test/testenv"
)

// Run starts a controller+node driver with one block pool and runs the whole
// sanity suite with volumes of the given access type ("mount" or "block").
func Run(t *testing.T, accessType string) {
	testenv.RequireRoot(t)
	root := testenv.Tmpfs(t, "768m")
	pool := filepath.Join(root, "pool-zone-a")
	for _, d := range []string{pool, filepath.Join(root, "state")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	pools := map[string]string{"zone-a": pool}
	ctrl, err := block.NewController(pools)
	if err != nil {
		t.Fatal(err)
	}
	node, err := block.NewNode(pools)
	if err != nil {
		t.Fatal(err)
	}
	d, err := driver.New(driver.Config{
		Version:           "sanity",
		Roles:             []driver.Role{driver.RoleController, driver.RoleNode},
		NodeName:          "sanity-node",
		Zone:              "zone-a",
		StateDir:          filepath.Join(root, "state"),
		MaxVolumesPerNode: 16,
		Controllers:       map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: ctrl},
		Nodes:             map[accessmode.Backend]backend.Node{accessmode.BackendBlock: node},
	})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(root, "csi.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := d.NewGRPCServer()
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)

	cfg := sanity.NewTestConfig()
	cfg.Address = "unix://" + sock
	cfg.TargetPath = filepath.Join(root, "target")
	cfg.StagingPath = filepath.Join(root, "staging")
	cfg.TestVolumeSize = 16 << 20
	cfg.TestVolumeExpandSize = 32 << 20
	cfg.TestVolumeAccessType = accessType
	cfg.IdempotentCount = 10
	cfg.TestNodeVolumeAttachLimit = true
	sanity.Test(t, cfg)
}

// Package sanity runs the CSI conformance suite (csi-test's sanity package)
// against a real modeguard process: real loop devices, mkfs and mounts, with
// pools and state on a size-capped tmpfs. Ginkgo allows one suite per
// process, so each access type has its own test package calling Run.
package sanity

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"k8s.io/mount-utils"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
)

// Run starts a controller+node driver with one block pool and runs the whole
// sanity suite with volumes of the given access type ("mount" or "block").
func Run(t *testing.T, accessType string) { runBlock(t, accessType, false) }

// RunThroughTarget is Run with the pool owned by a storage target: the
// driver's controller reaches it through the remote API over loopback TCP
// with mutual TLS, as a controller reaches a zone's target; the node sees
// the pool itself (the loop transport).
func RunThroughTarget(t *testing.T, accessType string) { runBlock(t, accessType, true) }

func runBlock(t *testing.T, accessType string, throughTarget bool) {
	testenv.RequireRoot(t)
	root := testenv.Tmpfs(t, "768m")
	pool := filepath.Join(root, "pool-zone-a")
	if err := os.MkdirAll(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	pools := map[string]string{"zone-a": pool}
	var ctrl backend.Controller
	ctrl, err := block.NewController(pools)
	if err != nil {
		t.Fatal(err)
	}
	if throughTarget {
		ctrl = serveThroughTarget(t, ctrl)
	}
	node, err := block.NewNode(pools)
	if err != nil {
		t.Fatal(err)
	}
	cfg := sanity.NewTestConfig()
	cfg.TestVolumeSize = 16 << 20
	cfg.TestVolumeExpandSize = 32 << 20
	cfg.TestVolumeAccessType = accessType
	// What a VolumeAttributesClass may say of a block volume: the
	// ModifyVolume specs create and modify volumes with it.
	cfg.TestVolumeMutableParameters = map[string]string{"readAheadKiB": "512"}
	run(t, root, driver.Config{
		Controllers: map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: ctrl},
		Nodes:       map[accessmode.Backend]backend.Node{accessmode.BackendBlock: node},
	}, cfg)
}

// serveThroughTarget serves ctrl's API on loopback with mutual TLS and
// returns a client of it.
func serveThroughTarget(t *testing.T, ctrl backend.Controller) backend.Controller {
	authority := certs.NewCA(t, "modeguard")
	serverTLS, err := remote.TLSFiles(authority.Server("127.0.0.1")).ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: remote.Handler(ctrl), TLSConfig: serverTLS}
	go srv.ServeTLS(lis, "", "")
	t.Cleanup(func() { srv.Close() })
	c, err := remote.Dial(context.Background(), remote.Target{Address: lis.Addr().String(), TLS: remote.TLSFiles(authority.Client("controller"))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	if err := c.Hold(context.Background(), "sanity", func(string) {}); err != nil {
		t.Fatal(err)
	}
	return c
}

// RunNFSWithFakeKernelMount runs the whole suite against the NFS backend:
// the controller with a real ganesha (on loopback, on a free port) and real
// storage; the node plugin with its kernel NFS mount replaced by a bind
// mount of the exported directory (bindInsteadOfNFS), because this kernel
// has no NFS client. Everything else on the node — lock files, bind mounts,
// stats, size limits — is real.
func RunNFSWithFakeKernelMount(t *testing.T) { runNFS(t, false) }

// RunNFSThroughTarget is RunNFSWithFakeKernelMount with the NFS backend
// behind a storage target, reached over its mutual-TLS API.
func RunNFSThroughTarget(t *testing.T) { runNFS(t, true) }

func runNFS(t *testing.T, throughTarget bool) {
	testenv.RequireRoot(t)
	root := testenv.Tmpfs(t, "256m") // staging, targets, state: the volumes live on disk
	disk := t.TempDir()
	nfsCtrl := testenv.NFSController(t, disk, 4<<30)
	var ctrl backend.Controller = nfsCtrl
	if throughTarget {
		ctrl = serveThroughTarget(t, ctrl)
	}
	cfg := sanity.NewTestConfig()
	cfg.TestVolumeSize = ctrl.MinimumSize()
	cfg.TestVolumeExpandSize = ctrl.MinimumSize() + 64<<20
	cfg.TestVolumeAccessType = "mount"
	cfg.TestVolumeParameters = map[string]string{"backend": "nfs"}
	cfg.TestVolumeMutableParameters = map[string]string{"rootSquash": "false"}
	run(t, root, driver.Config{
		NodeAddress: "127.0.0.1",
		Controllers: map[accessmode.Backend]backend.Controller{accessmode.BackendNFS: ctrl},
		Nodes:       map[accessmode.Backend]backend.Node{accessmode.BackendNFS: newBindInsteadOfNFS(filepath.Join(disk, "nfs"))},
	}, cfg)
}

// bindInsteadOfNFS stands in for the kernel's NFS client, which this
// machine lacks: an "nfs4" mount of SERVER:/<pseudo> becomes a bind mount of
// the directory the server exports under that pseudo path, so the node
// specs act on the volume's real data with its real size limit. Every other
// mount goes to the real mounter. Its mount table shows those bind mounts
// (and bind mounts of them) as the NFS mounts they stand for, so the node's
// checks of what is mounted see what a kernel NFS client would show.
type bindInsteadOfNFS struct {
	mount.Interface
	exportRoot string

	mu      sync.Mutex
	sources map[string]string // staging path -> the NFS source it stands for
}

func newBindInsteadOfNFS(exportRoot string) backend.Node {
	b := &bindInsteadOfNFS{Interface: mount.New(""), exportRoot: exportRoot, sources: map[string]string{}}
	return nfs.NewNode(b, b)
}

func (b *bindInsteadOfNFS) Mount(source, target, fstype string, options []string) error {
	if fstype != "nfs4" {
		return b.Interface.Mount(source, target, fstype, options)
	}
	_, pseudo, ok := strings.Cut(source, ":/")
	if !ok || strings.ContainsAny(pseudo, "/.") && !strings.HasPrefix(pseudo, "nfs__") {
		return fmt.Errorf("not an export of this driver: %s", source)
	}
	opts := []string{"bind"}
	if slices.Contains(options, "ro") {
		opts = append(opts, "ro")
	}
	if err := b.Interface.Mount(filepath.Join(b.exportRoot, "volumes", pseudo), target, "", opts); err != nil {
		return err
	}
	b.mu.Lock()
	b.sources[target] = source
	b.mu.Unlock()
	return nil
}

// At reads the kernel's mount table and names a bind mount standing for an
// NFS mount (or a bind mount of one) as that NFS mount.
func (b *bindInsteadOfNFS) At(path string) (*mounts.Mount, error) {
	m, err := mounts.Table{}.At(path)
	if m == nil || err != nil {
		return m, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for staging, source := range b.sources {
		sm, err := mounts.Table{}.At(staging)
		if err != nil {
			return nil, err
		}
		if sm != nil && sm.Major == m.Major && sm.Minor == m.Minor && sm.Root == m.Root {
			nfsView := *m
			nfsView.FSType, nfsView.Source = "nfs4", source
			return &nfsView, nil
		}
	}
	return m, nil
}

// run serves cfg's backends as one controller+node driver over a unix
// socket under root and runs the suite against it.
func run(t *testing.T, root string, dcfg driver.Config, cfg sanity.TestConfig) {
	dcfg.Version = "sanity"
	dcfg.Roles = []driver.Role{driver.RoleController, driver.RoleNode}
	dcfg.NodeName = "sanity-node"
	dcfg.Zone = "zone-a"
	dcfg.StateDir = filepath.Join(root, "state")
	dcfg.MaxVolumesPerNode = 16
	d, err := driver.New(dcfg)
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

	cfg.Address = "unix://" + sock
	cfg.TargetPath = filepath.Join(root, "target")
	cfg.StagingPath = filepath.Join(root, "staging")
	cfg.IdempotentCount = 10
	cfg.TestNodeVolumeAttachLimit = true
	sanity.Test(t, cfg)
}

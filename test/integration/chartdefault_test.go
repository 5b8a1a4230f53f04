package integration

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
	"github.com/modeguard/modeguard/pkg/peer"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
)

// TestTwoControllersOverLoopPoolsAndAnNFSTarget is the chart's default
// without iSCSI (kind, one machine, a cluster filesystem): two controllers,
// each with the block pools as host directories (--block-pool) and the NFS
// target (--nfs-target), peers of each other. One acts, and the other
// forwards block and NFS calls to it; when the acting one dies the other
// acts. With one pool directory the lock files decide; with a directory
// each (machines that do not share it, which the node plugins then refuse)
// the NFS target's lease still lets only one act: the other's pool is never
// written while the first acts.
func TestTwoControllersOverLoopPoolsAndAnNFSTarget(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	ganeshatest.RequireCommands(t, "ganesha.nfsd", "dbus-daemon", "nsenter", "mkfs.xfs")
	bin := testenv.BuildBinary(t)
	ca := certs.NewCA(t, "controllers")
	files := ca.Peer(peer.ServerName)
	rwoBlock, rwoNFS := capability(accessmode.SingleNodeWriter, ""), nfsCapability(accessmode.SingleNodeWriter)

	for _, tc := range []struct {
		name     string
		pools    [2]string
		oneActor bool
	}{
		{"one pool", [2]string{"pool", "pool"}, true},
		{"a pool each", [2]string{"pool-1", "pool-2"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			work := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 1, Prefix: "mgc"})
			target := testenv.StartNFSTarget(ctx, t, bin, net.Server.Path, net.Server.Addr.String(), "--nfs-pool-size", "1Gi")
			addrs := []string{freePort(t), freePort(t)}
			controller := func(i int) *crashProc {
				return runController(t, bin, work, []string{"first", "second"}[i],
					"--block-pool=zone-a="+filepath.Join(work, tc.pools[i]), "--block-pool-filesystem=direct",
					"--nfs-target="+target.Endpoint(),
					"--controller-peer-listen=tcp://"+addrs[i], "--controller-peers="+strings.Join(addrs, ","),
					"--tls-cert="+files.Cert, "--tls-key="+files.Key, "--tls-ca="+files.CA)
			}
			create := func(p *crashProc, name string, params map[string]string) error {
				c := rwoBlock
				if params != nil {
					c = rwoNFS
				}
				_, err := csi.NewControllerClient(p.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name,
					CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}, VolumeCapabilities: []*csi.VolumeCapability{c},
					Parameters: params})
				return err
			}
			nfsParams := map[string]string{"backend": "nfs"}
			// images counts the volumes in pool (an image and its record
			// each).
			images := func(pool string) int {
				entries, _ := os.ReadDir(filepath.Join(work, pool, "volumes"))
				ids := map[string]bool{}
				for _, e := range entries {
					id, _, _ := strings.Cut(e.Name(), ".")
					ids[id] = true
				}
				return len(ids)
			}

			first := controller(0)
			untilActing(t, first)
			second := controller(1)
			for _, kind := range []struct {
				name   string
				params map[string]string
			}{{"block", nil}, {"nfs", nfsParams}} {
				if err := create(second, "through-the-second-"+kind.name, kind.params); err != nil {
					t.Fatalf("%s CreateVolume through the second controller: %v", kind.name, err)
				}
				if !strings.Contains(testenv.ReadFile(first.log), "through-the-second-"+kind.name) {
					t.Errorf("the acting controller's log does not show the forwarded %s CreateVolume", kind.name)
				}
			}
			if n := images(tc.pools[0]); n != 1 {
				t.Errorf("the acting controller's pool holds %d volumes, want the one made through the second", n)
			}
			if !tc.oneActor {
				if n := images(tc.pools[1]); n != 0 {
					t.Errorf("the standby's own pool holds %d volumes while the first acts", n)
				}
			}

			_ = first.cmd.Process.Signal(syscall.SIGKILL)
			<-first.done
			var err error
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
				if err = create(second, "after-the-first-died", nfsParams); status.Code(err) != codes.Unavailable {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the second controller did not take over within 30 s: %v", err)
				}
			}
			if err != nil {
				t.Fatalf("NFS CreateVolume through the controller that took over: %v", err)
			}
			if err := create(second, "block-after-the-first-died", nil); err != nil {
				t.Fatalf("block CreateVolume through the controller that took over: %v", err)
			}
			if n := images(tc.pools[1]); (tc.oneActor && n != 2) || (!tc.oneActor && n != 1) {
				t.Errorf("the second controller's pool holds %d volumes after it took over", n)
			}
		})
	}
}

package vmtest

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
)

// NodeClient connects to the node plugin in the VM (StartPlugin) through
// the cluster's network namespace. The connection closes at the end of the
// test, and a failed test gets the plugin's log.
//
// Tests kill and restart the plugin, which under emulation on a busy
// machine takes half a minute to listen again. gRPC's default reconnect
// backoff grows to two minutes meanwhile, so calls would go on failing
// fast long after the plugin listens (StartPlugin returns then): the
// backoff here stays at a second at most.
func (v *VM) NodeClient(t testing.TB) csi.NodeClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+v.NodeEndpoint(),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(v.c.Dialer()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 5 * time.Second,
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		if t.Failed() {
			if log, err := v.PluginLog(context.Background()); err == nil {
				t.Logf("node plugin log of %s:\n%s", v.Name, log)
			}
		}
	})
	return csi.NewNodeClient(conn)
}

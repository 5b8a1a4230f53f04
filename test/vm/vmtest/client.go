package vmtest

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// NodeClient connects to the node plugin in the VM (StartPlugin) through
// the cluster's network namespace. The connection closes at the end of the
// test, and a failed test gets the plugin's log.
func (v *VM) NodeClient(t testing.TB) csi.NodeClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+v.NodeEndpoint(),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(v.c.Dialer()))
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

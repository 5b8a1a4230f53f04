package registration

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// TestKubeletSeesThePlugin asks, as the kubelet does, what the socket in
// plugins_registry serves.
func TestKubeletSeesThePlugin(t *testing.T) {
	dir := t.TempDir()
	stop, err := Serve(dir, "modeguard.csi.dev", "/var/lib/kubelet/plugins/modeguard.csi.dev/csi.sock")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("unix://"+SocketPath(dir, "modeguard.csi.dev"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	info, err := c.GetInfo(context.Background(), &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != "modeguard.csi.dev" ||
		info.Endpoint != "/var/lib/kubelet/plugins/modeguard.csi.dev/csi.sock" || len(info.SupportedVersions) == 0 {
		t.Fatalf("GetInfo = %+v", info)
	}
	if _, err := c.NotifyRegistrationStatus(context.Background(), &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	stop()
	if _, err := os.Stat(filepath.Join(dir, "modeguard.csi.dev-reg.sock")); !os.IsNotExist(err) {
		t.Fatalf("the socket outlived stop: %v", err)
	}
}

func TestRelativeEndpointRefused(t *testing.T) {
	if _, err := Serve(t.TempDir(), "modeguard.csi.dev", "csi.sock"); err == nil {
		t.Fatal("a relative endpoint was accepted")
	}
}

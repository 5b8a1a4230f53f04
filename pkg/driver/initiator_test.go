package driver_test

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/nodeid"
)

// The node's iSCSI initiator name is part of what it reports about itself:
// NodeGetInfo's id carries it, so a ControllerPublishVolume knows the name
// to grant; a name that is not an IQN stops the node at start.
func TestNodeIDCarriesTheISCSIInitiator(t *testing.T) {
	pool := t.TempDir()
	nb, err := block.NewNode(map[string]string{"zone-a": pool})
	if err != nil {
		t.Fatal(err)
	}
	cfg := driver.Config{
		Version: "test", Roles: []driver.Role{driver.RoleNode}, NodeName: "worker-1", Zone: "zone-a",
		StateDir: t.TempDir(), MaxVolumesPerNode: 16, ISCSIInitiator: "iqn.1993-08.org.debian:01:56e0e55b7367",
		Nodes: map[accessmode.Backend]backend.Node{accessmode.BackendBlock: nb},
	}
	d, err := driver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The id NodeGetInfo reports, over the driver's own gRPC server.
	lis, err := net.Listen("unix", filepath.Join(t.TempDir(), "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	srv := d.NewGRPCServer()
	go srv.Serve(lis)
	defer srv.Stop()
	conn, err := grpc.NewClient("unix://"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	info, err := csi.NewNodeClient(conn).NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	n, err := nodeid.Parse(info.GetNodeId())
	if err != nil || n.Initiator != cfg.ISCSIInitiator || n.Name != "worker-1" || n.MaxVolumes != 16 {
		t.Fatalf("NodeGetInfo's id %q parses to %+v, %v", info.GetNodeId(), n, err)
	}

	cfg.ISCSIInitiator = "iqn.2026-11.io.example:worker@1"
	if _, err := driver.New(cfg); err == nil || !strings.Contains(err.Error(), "not an IQN") {
		t.Fatalf("New with initiator %q: %v, want a refusal", cfg.ISCSIInitiator, err)
	}
}

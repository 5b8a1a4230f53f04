// Package registration registers the node plugin with the kubelet, the job
// node-driver-registrar does in most deployments: it serves the kubelet's
// plugin registration API on a socket in the kubelet's plugins_registry
// directory, telling the kubelet the driver's name and where its CSI
// endpoint is. It exists so that the node plugin can run where that sidecar
// cannot be had.
package registration

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// supportedVersions are the CSI versions the kubelet may speak to us.
var supportedVersions = []string{"1.0.0"}

type server struct {
	registerapi.UnimplementedRegistrationServer
	driverName string
	endpoint   string
}

func (s *server) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.driverName,
		Endpoint:          s.endpoint,
		SupportedVersions: supportedVersions,
	}, nil
}

func (s *server) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if st.PluginRegistered {
		klog.InfoS("Registered with the kubelet", "driver", s.driverName, "endpoint", s.endpoint)
	} else {
		klog.ErrorS(nil, "The kubelet refused the registration", "driver", s.driverName, "error", st.Error)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// SocketPath is where the registration socket of driverName lives in dir.
func SocketPath(dir, driverName string) string {
	return filepath.Join(dir, driverName+"-reg.sock")
}

// Serve serves the registration API on SocketPath(dir, driverName) until
// stop is called. endpoint is the CSI socket's path as the kubelet sees it.
func Serve(dir, driverName, endpoint string) (stop func(), err error) {
	if !filepath.IsAbs(endpoint) {
		return nil, fmt.Errorf("kubelet registration: the CSI endpoint %q must be an absolute socket path", endpoint)
	}
	path := SocketPath(dir, driverName)
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("kubelet registration: removing stale socket %s: %w", path, err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("kubelet registration: %w", err)
	}
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, &server{driverName: driverName, endpoint: endpoint})
	go func() {
		if err := srv.Serve(lis); err != nil {
			klog.ErrorS(err, "Kubelet registration server stopped")
		}
	}()
	return func() {
		srv.Stop()
		_ = os.Remove(path)
	}, nil
}

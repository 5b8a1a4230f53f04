package driver

// The Identity service: the driver's name, its plugin capabilities, and a
// Probe that answers ready once every role can take calls.

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

type identityServer struct {
	csi.UnimplementedIdentityServer
	d *Driver
}

func (s *identityServer) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.d.cfg.DriverName, VendorVersion: s.d.cfg.Version}, nil
}

func (s *identityServer) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: s.d.pluginCapabilities()}, nil
}

// Probe answers ready once every role can take calls: a controller that
// waits for another controller's lock on its directories is not ready, so
// sidecars wait for it instead of sending it calls.
func (s *identityServer) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(s.d.Ready())}, nil
}

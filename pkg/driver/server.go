package driver

// The gRPC endpoint: the socket it listens on, and the server with the
// services this process's roles serve.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-addons/spec/lib/go/fence"
	"github.com/csi-addons/spec/lib/go/identity"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// Listen opens the endpoint: unix:///path/to/socket or tcp://host:port.
// A stale socket file is replaced; the socket is made 0660, so only root and
// the socket's group can reach the driver, whatever the process's umask.
func Listen(endpoint string) (net.Listener, error) { return ListenMode(endpoint, 0o660) }

// ListenMode is Listen with the unix socket made mode instead of 0660.
func ListenMode(endpoint string, mode os.FileMode) (net.Listener, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	switch u.Scheme {
	case "unix":
		path := u.Path
		if u.Host != "" {
			path = filepath.Join(u.Host, u.Path) // unix://relative/path
		}
		if path == "" {
			return nil, fmt.Errorf("endpoint %q names no socket path", endpoint)
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
			return nil, err
		}
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			return nil, fmt.Errorf("removing stale socket %s: %w", path, err)
		}
		// bind(2) creates the socket with 0777 less the umask, and until
		// the chmod below it would take connections from every user the
		// umask lets in (all of them under umask 0); a connection made in
		// that moment stays open. A umask of 077 while binding makes the
		// socket 0700 from its first instant. The umask is the process's,
		// so anything created meanwhile can only come out more private.
		old := syscall.Umask(0o077)
		l, err := net.Listen("unix", path)
		syscall.Umask(old)
		if err != nil {
			return nil, err
		}
		if err := os.Chmod(path, mode); err != nil {
			l.Close()
			return nil, err
		}
		return l, nil
	case "tcp":
		if u.Host == "" {
			return nil, fmt.Errorf("endpoint %q names no host:port", endpoint)
		}
		return net.Listen("tcp", u.Host)
	}
	return nil, fmt.Errorf("endpoint %q: scheme must be unix:// or tcp://", endpoint)
}

// NewGRPCServer registers the services this driver's roles call for.
func (d *Driver) NewGRPCServer(opts ...grpc.ServerOption) *grpc.Server {
	interceptors := []grpc.UnaryServerInterceptor{logCalls, d.controllerGate}
	if d.cfg.Metrics != nil {
		// Outermost, so the duration covers everything the driver does.
		interceptors = append([]grpc.UnaryServerInterceptor{d.cfg.Metrics.UnaryServerInterceptor()}, interceptors...)
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(interceptors...), grpc.ChainStreamInterceptor(logStreams, d.controllerStreamGate)}, opts...)...)
	csi.RegisterIdentityServer(srv, &identityServer{d: d})
	if d.HasRole(RoleController) {
		csi.RegisterControllerServer(srv, &controllerServer{d: d})
		csi.RegisterGroupControllerServer(srv, &groupControllerServer{d: d})
		csi.RegisterSnapshotMetadataServer(srv, &snapshotMetadataServer{d: d})
		// csi-addons: its sidecar dials the same endpoint.
		identity.RegisterIdentityServer(srv, &addonsIdentityServer{d: d})
		fence.RegisterFenceControllerServer(srv, &fenceServer{d: d})
	}
	if d.HasRole(RoleNode) {
		csi.RegisterNodeServer(srv, &nodeServer{d: d})
	}
	return srv
}

// controllerGate answers every Controller call UNAVAILABLE (the CO retries)
// until the controller's backends are there: the state they read is not
// this process's to act on before it holds the controller lock. An elected
// controller serves them only during a term, under the term's context.
// Meanwhile a controller with peers forwards them to the acting one.
func (d *Driver) controllerGate(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !controllerCall(info.FullMethod) || localControllerCall(info.FullMethod) {
		return handler(ctx, req)
	}
	if !d.cfg.Elected {
		if err := d.refuseBeforeControllers(); err != nil {
			return d.forwardUnary(ctx, info.FullMethod, req, err)
		}
		markTaken(ctx)
		return handler(ctx, req)
	}
	tctx, leave, err := d.enterTerm(ctx)
	if err != nil {
		return d.forwardUnary(ctx, info.FullMethod, req, err)
	}
	defer leave()
	markTaken(ctx)
	resp, err := handler(tctx, req)
	return resp, termEnded(tctx, err)
}

// controllerStreamGate is controllerGate for the streaming calls (the
// SnapshotMetadata service's).
func (d *Driver) controllerStreamGate(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if !controllerCall(info.FullMethod) {
		return handler(srv, ss)
	}
	if !d.cfg.Elected {
		if err := d.refuseBeforeControllers(); err != nil {
			return d.forwardStream(ss, info.FullMethod, err)
		}
		markTaken(ss.Context())
		return handler(srv, ss)
	}
	ctx, leave, err := d.enterTerm(ss.Context())
	if err != nil {
		return d.forwardStream(ss, info.FullMethod, err)
	}
	defer leave()
	markTaken(ss.Context())
	return termEnded(ctx, handler(srv, &termStream{ServerStream: ss, ctx: ctx}))
}

// termStream is a server stream running under a term's context.
type termStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *termStream) Context() context.Context { return s.ctx }

// controllerCall reports whether method is of a controller-side service.
func controllerCall(method string) bool {
	return strings.HasPrefix(method, "/csi.v1.Controller/") || strings.HasPrefix(method, "/csi.v1.GroupController/") ||
		strings.HasPrefix(method, "/csi.v1.SnapshotMetadata/") || strings.HasPrefix(method, "/fence.FenceController/")
}

// refuseBeforeControllers is UNAVAILABLE while the controller's backends
// are not there yet, nil otherwise.
func (d *Driver) refuseBeforeControllers() error {
	if !d.controllersReady.Load() {
		why := "the controller is starting"
		if w := d.waitingFor.Load(); w != nil {
			why = *w
		}
		return status.Errorf(codes.Unavailable, "not serving controller calls yet: %s", why)
	}
	return nil
}

// termEnded turns the error of a call its term's end cancelled into
// UNAVAILABLE: the call stopped because this controller stopped acting,
// and the CO calls again (the successor, or this controller's next term).
func termEnded(ctx context.Context, err error) error {
	var ended errTermEnded
	if err == nil || !errors.As(context.Cause(ctx), &ended) {
		return err
	}
	return status.Errorf(codes.Unavailable, "%v while the call ran, and it was cancelled (%v); call again", ended, status.Convert(err).Message())
}

// logCalls logs every request and response with secrets stripped, so that
// nothing a CO passes as a secret reaches the log, and every failed call as
// an error, at any verbosity.
func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	klog.V(4).InfoS("Call", "method", info.FullMethod, "request", protosanitizer.StripSecrets(req))
	resp, err := handler(ctx, req)
	if err != nil {
		klog.ErrorS(err, "Call failed", "method", info.FullMethod, "code", status.Code(err), "duration", time.Since(start))
	} else {
		klog.V(4).InfoS("Call done", "method", info.FullMethod, "response", protosanitizer.StripSecrets(resp),
			"duration", time.Since(start))
	}
	return resp, err
}

// logStreams is logCalls for the streaming calls: the request as it came,
// and the outcome once the stream ends.
func logStreams(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	start := time.Now()
	klog.V(4).InfoS("Stream", "method", info.FullMethod)
	err := handler(srv, ss)
	if err != nil {
		klog.ErrorS(err, "Stream failed", "method", info.FullMethod, "code", status.Code(err), "duration", time.Since(start))
	} else {
		klog.V(4).InfoS("Stream done", "method", info.FullMethod, "duration", time.Since(start))
	}
	return err
}

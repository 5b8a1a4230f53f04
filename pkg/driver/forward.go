package driver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// A standby controller forwards the Controller calls it receives to the
// acting one (see package peer for why every replica takes calls): the
// request goes on unchanged, under the caller's deadline, and the answer,
// error code included, comes back unchanged. A forwarded call is marked,
// and a controller that receives a marked call while it does not act
// refuses it, saying so in the call's trailer: a call is never forwarded
// twice, and a standby that does not know which peer acts tries the next.

// Peers finds the acting controller.
type Peers interface {
	// Acting answers connections to the controllers that may be acting,
	// to try in order, or why none can be reached.
	Acting(ctx context.Context) ([]grpc.ClientConnInterface, error)
}

// forwardedKey marks a forwarded call's metadata. notActingKey marks the
// trailer of a forwarded call refused because its receiver does not act,
// which therefore did nothing with it; takenKey that of a forwarded call
// its receiver took, whose answer, failure or not, is the call's.
const (
	forwardedKey = "modeguard-forwarded"
	notActingKey = "modeguard-not-acting"
	takenKey     = "modeguard-taken"
)

// SetPeers lets this controller forward the calls it receives as a
// standby to the acting controller that p finds.
func (d *Driver) SetPeers(p Peers) { d.peers.Store(&p) }

// forwarded reports whether ctx is of a call another controller forwarded.
func forwarded(ctx context.Context) bool {
	return len(metadata.ValueFromIncomingContext(ctx, forwardedKey)) > 0
}

// passedOn reports whether a forwarded call that failed with err and
// trailer is for the next peer to take: its receiver refused it for not
// acting, or it never reached a controller that took it (a peer that is
// gone, a listed address where none runs).
func passedOn(err error, trailer metadata.MD) bool {
	if len(trailer.Get(notActingKey)) > 0 {
		return true
	}
	return len(trailer.Get(takenKey)) == 0 && status.Code(err) == codes.Unavailable
}

// markTaken marks the trailer of a forwarded call this controller takes.
func markTaken(ctx context.Context) {
	if forwarded(ctx) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(takenKey, "1"))
	}
}

// acting finds where to forward a call this controller cannot serve
// (refused says why it cannot).
func (d *Driver) acting(ctx context.Context, refused error) ([]grpc.ClientConnInterface, context.Context, error) {
	if forwarded(ctx) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(notActingKey, "1"))
		return nil, nil, status.Errorf(codes.Unavailable, "forwarded to a controller that is not acting (%s); the caller retries",
			status.Convert(refused).Message())
	}
	p := d.peers.Load()
	if p == nil {
		return nil, nil, refused
	}
	conns, err := (*p).Acting(ctx)
	if err != nil {
		return nil, nil, status.Errorf(codes.Unavailable, "%s, and the call cannot be forwarded: %v", status.Convert(refused).Message(), err)
	}
	// Only the mark goes on, under the caller's deadline and
	// cancellation: the caller's metadata is its transport's, not the
	// call's (a CSI call carries what it needs, secrets included, in its
	// request).
	return conns, metadata.NewOutgoingContext(ctx, metadata.Pairs(forwardedKey, "1")), nil
}

// noneActs is the answer when every peer tried passed the call on.
func noneActs(refused, last error) error {
	return status.Errorf(codes.Unavailable, "%s, and no other controller acts (%v); the caller retries",
		status.Convert(refused).Message(), status.Convert(last).Message())
}

// forwardUnary sends a unary call on to the acting controller.
func (d *Driver) forwardUnary(ctx context.Context, method string, req any, refused error) (any, error) {
	conns, fctx, err := d.acting(ctx, refused)
	if err != nil {
		return nil, err
	}
	for _, conn := range conns {
		resp, err := newMessage(method, false)
		if err != nil {
			return nil, err
		}
		var trailer metadata.MD
		err = conn.Invoke(fctx, method, req, resp, grpc.Trailer(&trailer))
		if err != nil && passedOn(err, trailer) {
			refused = noneActs(refused, err)
			continue
		}
		d.cfg.Metrics.Forwarded(method, status.Code(err))
		if err != nil {
			return nil, err
		}
		return resp, nil
	}
	return nil, refused
}

// forwardStream sends a server-streaming call on to the acting controller,
// and its messages back as they come.
func (d *Driver) forwardStream(ss grpc.ServerStream, method string, refused error) error {
	conns, fctx, err := d.acting(ss.Context(), refused)
	if err != nil {
		return err
	}
	req, err := newMessage(method, true)
	if err != nil {
		return err
	}
	if err := ss.RecvMsg(req); err != nil {
		return err
	}
	for _, conn := range conns {
		err := d.forwardStreamTo(ss, conn, fctx, method, req)
		if errors.Is(err, errNotActing) {
			refused = noneActs(refused, err)
			continue
		}
		d.cfg.Metrics.Forwarded(method, status.Code(err))
		return err
	}
	return refused
}

// errNotActing is a forwarded stream a peer passed on (see passedOn)
// before any message came back.
var errNotActing = errors.New("the peer does not act")

// forwardStreamTo forwards the stream to conn; errNotActing when it is for
// the next peer, nothing having come back.
func (d *Driver) forwardStreamTo(ss grpc.ServerStream, conn grpc.ClientConnInterface, fctx context.Context, method string, req proto.Message) error {
	fctx, cancel := context.WithCancel(fctx)
	defer cancel()
	cs, err := conn.NewStream(fctx, &grpc.StreamDesc{ServerStreams: true}, method)
	if err == nil {
		err = cs.SendMsg(req)
	}
	if err == nil {
		err = cs.CloseSend()
	}
	for first := true; err == nil; first = false {
		var m proto.Message
		if m, err = newMessage(method, false); err != nil {
			break
		}
		if err = cs.RecvMsg(m); err == nil {
			err = ss.SendMsg(m)
		} else if first && !errors.Is(err, io.EOF) && passedOn(err, cs.Trailer()) {
			return fmt.Errorf("%w: %v", errNotActing, err)
		}
	}
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return err
}

// newMessage makes an empty request (input) or answer of method, from the
// descriptors the services' generated code registers.
func newMessage(method string, input bool) (proto.Message, error) {
	service, name, ok := strings.Cut(strings.TrimPrefix(method, "/"), "/")
	if !ok {
		return nil, status.Errorf(codes.Internal, "method %q is not /service/method", method)
	}
	desc, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "forwarding %s: %v", method, err)
	}
	sd, ok := desc.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil, status.Errorf(codes.Internal, "forwarding %s: %s is not a service", method, service)
	}
	md := sd.Methods().ByName(protoreflect.Name(name))
	if md == nil {
		return nil, status.Errorf(codes.Unimplemented, "forwarding %s: no such method", method)
	}
	msg := md.Output()
	if input {
		msg = md.Input()
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(msg.FullName())
	if err != nil {
		return nil, status.Errorf(codes.Internal, "forwarding %s: %v", method, err)
	}
	return mt.New().Interface(), nil
}

// NewPeerServer serves the calls other controllers forward to this one,
// with creds (mutual TLS): the controller-side services and Identity only,
// whatever other roles this process has.
func (d *Driver) NewPeerServer(creds credentials.TransportCredentials) (*grpc.Server, error) {
	if !d.HasRole(RoleController) {
		return nil, fmt.Errorf("only a controller takes forwarded calls")
	}
	only := func(method string) error {
		if controllerCall(method) || strings.HasPrefix(method, "/csi.v1.Identity/") {
			return nil
		}
		return status.Errorf(codes.PermissionDenied, "%s is not served to other controllers", method)
	}
	return d.NewGRPCServer(grpc.Creds(creds),
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if err := only(info.FullMethod); err != nil {
				return nil, err
			}
			return handler(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			if err := only(info.FullMethod); err != nil {
				return err
			}
			return handler(srv, ss)
		})), nil
}

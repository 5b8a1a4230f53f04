package remote

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// Client is a backend.Controller served by a storage target.
type Client struct {
	name string // what errors call the target: its address
	base string // URL the methods hang under
	http *http.Client
	info infoResponse
	// holder is this controller's lease name once Hold took the lease,
	// epoch its term; stopRenewal ends the renewals and gives the lease
	// back.
	holder      string
	epoch       atomic.Uint64
	stopRenewal func()
	// termEpoch, set by Elected, answers the epoch a call is sent under,
	// or why this controller may not act on the target now.
	termEpoch func(target string) (uint64, error)
	// peer is where this controller takes forwarded calls (Elected).
	peer string
}

var _ backend.Controller = (*Client)(nil)

// Target says how to reach a storage target: Address is host:port (TLS
// required) or unix:///path/to/socket.
type Target struct {
	Address string
	// TLS is the controller's client certificate and the CA that signs
	// targets; unused for a unix socket.
	TLS TLSFiles
	// Dial makes the connections (TCP: before TLS); nil dials from this
	// process's network. Tests reach targets in other network namespaces
	// with it.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// Dial connects to a target and asks what it serves (its backend, zones
// and smallest volume), which the driver needs before the first call.
func Dial(ctx context.Context, t Target) (*Client, error) {
	c := &Client{name: t.Address}
	dial := t.Dial
	if dial == nil {
		var d net.Dialer
		dial = d.DialContext
	}
	transport := &http.Transport{
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
	}
	if path, ok := strings.CutPrefix(t.Address, "unix://"); ok {
		if !strings.HasPrefix(path, "/") {
			return nil, fmt.Errorf("storage target %q: a unix socket needs an absolute path (unix:///path)", t.Address)
		}
		transport.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx, "unix", path)
		}
		c.base = "http://target"
	} else {
		host, _, err := net.SplitHostPort(t.Address)
		if err != nil {
			return nil, fmt.Errorf("storage target %q is neither host:port nor unix:///path: %v", t.Address, err)
		}
		if err := t.TLS.check(); err != nil {
			return nil, fmt.Errorf("storage target %s: %w", t.Address, err)
		}
		files := t.TLS
		transport.DialTLSContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			return files.DialTLS(ctx, dial, network, addr, host, nil)
		}
		c.base = "https://" + t.Address
	}
	c.http = &http.Client{Transport: transport}
	info, err := call[infoResponse](ctx, c, "Info", empty{})
	if err != nil {
		return nil, err
	}
	c.info = info
	return c, nil
}

// Close gives the lease back (when Hold took it) and drops the client's
// idle connections.
func (c *Client) Close() {
	if c.stopRenewal != nil {
		c.stopRenewal()
		c.stopRenewal = nil
	}
	c.http.CloseIdleConnections()
}

func (c *Client) Backend() accessmode.Backend { return c.info.Backend }
func (c *Client) Zones() []string             { return append([]string(nil), c.info.Zones...) }
func (c *Client) MinimumSize() int64          { return c.info.MinimumSize }

// nodeExpansionWait bounds the one call that the interface gives no
// context: asking whether a node must act after an expansion.
const nodeExpansionWait = 30 * time.Second

// NodeExpansionRequired asks the target. When it cannot answer, the node
// is asked to act: a NodeExpandVolume with nothing to do is harmless, a
// skipped one leaves the workload on the old size.
func (c *Client) NodeExpansionRequired(v *backend.Volume) bool {
	ctx, cancel := context.WithTimeout(context.Background(), nodeExpansionWait)
	defer cancel()
	need, err := call[bool](ctx, c, "NodeExpansionRequired", v)
	return err != nil || need
}

func (c *Client) Capacity(ctx context.Context, zone string) (int64, error) {
	return call[int64](ctx, c, "Capacity", zoneRequest{Zone: zone})
}

func (c *Client) Pools(ctx context.Context) ([]backend.PoolStats, error) {
	return call[[]backend.PoolStats](ctx, c, "Pools", empty{})
}

func (c *Client) CreateVolume(ctx context.Context, spec backend.VolumeSpec) (*backend.Volume, error) {
	return call[*backend.Volume](ctx, c, "CreateVolume", spec)
}

// Creating asks the target. A target older than this client does not serve
// the method, which call turns into UNAVAILABLE: not knowing whether a
// creation goes on there must not read as "no", or a retry of it would
// make a second volume in another zone.
func (c *Client) Creating(ctx context.Context, id volumeid.ID) (bool, error) {
	return call[bool](ctx, c, "Creating", idRequest{ID: id})
}

// ZonesFillableFrom asks the target: it copies only the images it holds,
// between its own pools.
func (c *Client) ZonesFillableFrom(ctx context.Context, sourceZone string) ([]string, error) {
	return call[[]string](ctx, c, "ZonesFillableFrom", zoneRequest{Zone: sourceZone})
}

// SnapshotBlocks asks the target for one page of ranges: the driver streams
// the pages it gets, so no call carries more than a page.
func (c *Client) SnapshotBlocks(ctx context.Context, req backend.BlockRangesRequest) (*backend.BlockRanges, error) {
	return call[*backend.BlockRanges](ctx, c, "SnapshotBlocks", req)
}

func (c *Client) Volume(ctx context.Context, id volumeid.ID) (*backend.Volume, error) {
	return call[*backend.Volume](ctx, c, "Volume", idRequest{ID: id})
}

func (c *Client) DeleteVolume(ctx context.Context, id volumeid.ID) error {
	_, err := call[empty](ctx, c, "DeleteVolume", idRequest{ID: id})
	return err
}

func (c *Client) SetAttachments(ctx context.Context, id volumeid.ID, attachments []accessmode.Attachment) (*backend.Volume, error) {
	return call[*backend.Volume](ctx, c, "SetAttachments", attachmentsRequest{ID: id, Attachments: attachments})
}

func (c *Client) ExpandVolume(ctx context.Context, id volumeid.ID, bytes int64) (*backend.Volume, error) {
	return call[*backend.Volume](ctx, c, "ExpandVolume", expandRequest{ID: id, Bytes: bytes})
}

func (c *Client) ModifyVolume(ctx context.Context, id volumeid.ID, mutable map[string]string) (*backend.Volume, error) {
	return call[*backend.Volume](ctx, c, "ModifyVolume", modifyRequest{ID: id, Mutable: mutable})
}

func (c *Client) ListVolumes(ctx context.Context) ([]*backend.Volume, error) {
	return call[[]*backend.Volume](ctx, c, "ListVolumes", empty{})
}

func (c *Client) VolumesOn(ctx context.Context, node string) ([]*backend.Volume, error) {
	return call[[]*backend.Volume](ctx, c, "VolumesOn", nodeRequest{Node: node})
}

func (c *Client) VolumeHealth(ctx context.Context, id volumeid.ID) (backend.Health, error) {
	return call[backend.Health](ctx, c, "VolumeHealth", idRequest{ID: id})
}

func (c *Client) CreateSnapshot(ctx context.Context, id volumeid.ID, name string, source volumeid.ID) (*backend.Snapshot, error) {
	return fromWireSnapshot(call[*wireSnapshot](ctx, c, "CreateSnapshot", snapshotRequest{ID: id, Name: name, Source: source}))
}

// CreateSnapshotGroup asks the target, whose storage takes the group. A
// target older than this client does not serve the method (UNAVAILABLE):
// its members are not taken one at a time here instead, since only the
// target knows whether it could have taken them at one instant.
func (c *Client) CreateSnapshotGroup(ctx context.Context, members []backend.GroupMember) ([]*backend.Snapshot, error) {
	wire, err := call[[]*wireSnapshot](ctx, c, "CreateSnapshotGroup", members)
	if err != nil {
		return nil, err
	}
	out := make([]*backend.Snapshot, len(wire))
	for i, w := range wire {
		out[i], _ = fromWireSnapshot(w, nil)
	}
	return out, nil
}

func (c *Client) Snapshot(ctx context.Context, id volumeid.ID) (*backend.Snapshot, error) {
	return fromWireSnapshot(call[*wireSnapshot](ctx, c, "Snapshot", idRequest{ID: id}))
}

func (c *Client) DeleteSnapshot(ctx context.Context, id volumeid.ID) error {
	_, err := call[empty](ctx, c, "DeleteSnapshot", idRequest{ID: id})
	return err
}

func (c *Client) ListSnapshots(ctx context.Context) ([]*backend.Snapshot, error) {
	list, err := call[[]*wireSnapshot](ctx, c, "ListSnapshots", empty{})
	if err != nil {
		return nil, err
	}
	out := make([]*backend.Snapshot, len(list))
	for i, w := range list {
		out[i], _ = fromWireSnapshot(w, nil)
	}
	return out, nil
}

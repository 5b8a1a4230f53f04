package driver_test

import (
	"context"
	"errors"
	"io"
	"path/filepath"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/testenv"
)

// metadataResponse is what the responses of both SnapshotMetadata calls
// carry.
type metadataResponse interface {
	GetBlockMetadataType() csi.BlockMetadataType
	GetVolumeCapacityBytes() int64
	GetBlockMetadata() []*csi.BlockMetadata
}

// streamAll makes a streaming call and reads its stream to the end,
// holding every response to the spec: one type and capacity throughout,
// at most maxResults ranges each (when given), ranges ascending and apart.
func streamAll[Q any, R metadataResponse, S interface{ Recv() (R, error) }](t *testing.T,
	call func(context.Context, Q, ...grpc.CallOption) (S, error), req Q, maxResults int32) ([]backend.BlockRange, int64, error) {
	t.Helper()
	stream, err := call(ctx(t), req)
	if err != nil {
		return nil, 0, err
	}
	var out []backend.BlockRange
	var capacity int64
	for i := 0; ; i++ {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out, capacity, nil
		}
		if err != nil {
			return out, capacity, err
		}
		if resp.GetBlockMetadataType() != csi.BlockMetadataType_VARIABLE_LENGTH {
			t.Errorf("response %d: type %v, want VARIABLE_LENGTH", i, resp.GetBlockMetadataType())
		}
		if i > 0 && resp.GetVolumeCapacityBytes() != capacity {
			t.Errorf("response %d: capacity %d, the first said %d", i, resp.GetVolumeCapacityBytes(), capacity)
		}
		capacity = resp.GetVolumeCapacityBytes()
		if maxResults > 0 && len(resp.GetBlockMetadata()) > int(maxResults) {
			t.Errorf("response %d: %d ranges, max_results %d", i, len(resp.GetBlockMetadata()), maxResults)
		}
		for _, m := range resp.GetBlockMetadata() {
			r := backend.BlockRange{Offset: m.GetByteOffset(), Length: m.GetSizeBytes()}
			if r.Length <= 0 || len(out) > 0 && r.Offset <= out[len(out)-1].End() {
				t.Errorf("range %v after %v: empty, overlapping or touching", r, out)
			}
			out = append(out, r)
		}
	}
}

// TestSnapshotMetadataStreams: through the driver's gRPC server, on a pool
// with reflinks, the allocated ranges of a raw block volume's snapshot are
// the blocks written before it, the delta to a later snapshot is the
// blocks written between them, streamed one range a response when asked
// so, from a starting offset inside a range; and the refusals carry the
// spec's codes.
func TestSnapshotMetadataStreams(t *testing.T) {
	e := newEnv(t, 0, onReflinkPool(t))
	volID := e.createVolume(t, "tracked", blockCap(accessmode.SingleNodeWriter))
	id, err := volumeid.Parse(volID)
	if err != nil {
		t.Fatal(err)
	}
	image := filepath.Join(e.pool, "volumes", id.FileName()+".img")
	snapshot := func(name string) string {
		t.Helper()
		resp, err := e.ctrl.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: volID})
		if err != nil {
			t.Fatal(err)
		}
		snapID := resp.GetSnapshot().GetSnapshotId()
		t.Cleanup(func() {
			if _, err := e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: snapID}); err != nil {
				t.Errorf("cleanup: DeleteSnapshot %s: %v", snapID, err)
			}
		})
		return snapID
	}
	const kib = 1024
	span := func(offset, length int64) backend.BlockRange {
		return backend.BlockRange{Offset: offset, Length: length}
	}
	testenv.WriteRanges(t, image, 0x11, span(0, 16*kib), span(2*mib, 64*kib))
	base := snapshot("base")
	testenv.WriteRanges(t, image, 0x22, span(2*mib+8*kib, 8*kib), span(8*mib, 4*kib))
	target := snapshot("target")

	identity, err := csi.NewIdentityClient(e.conn).GetPluginCapabilities(ctx(t), &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(identity.GetCapabilities(), func(c *csi.PluginCapability) bool {
		return c.GetService().GetType() == csi.PluginCapability_Service_SNAPSHOT_METADATA_SERVICE
	}) {
		t.Errorf("plugin capabilities %v lack SNAPSHOT_METADATA_SERVICE", identity.GetCapabilities())
	}

	other := e.createVolume(t, "other", blockCap(accessmode.SingleNodeWriter))
	resp, err := e.ctrl.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "of-other", SourceVolumeId: other})
	if err != nil {
		t.Fatal(err)
	}
	ofOther := resp.GetSnapshot().GetSnapshotId()
	t.Cleanup(func() { e.ctrl.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: ofOther}) })
	unknown := volumeid.ID{Backend: id.Backend, Zone: id.Zone, Kind: volumeid.Snapshot, Key: volumeid.KeyFor("test", volumeid.Snapshot, "never")}.String()
	// The same through a standby controller, which forwards the streams
	// to the acting one: the same pages, the same errors.
	for _, via := range []struct {
		name string
		conn *grpc.ClientConn
	}{{"direct", e.conn}, {"forwarded by a standby", forwardingStandby(t, e.d)}} {
		t.Run(via.name, func(t *testing.T) {
			sm := csi.NewSnapshotMetadataClient(via.conn)
			allocated := func(req *csi.GetMetadataAllocatedRequest) ([]backend.BlockRange, int64, error) {
				t.Helper()
				return streamAll(t, sm.GetMetadataAllocated, req, req.GetMaxResults())
			}
			delta := func(req *csi.GetMetadataDeltaRequest) ([]backend.BlockRange, int64, error) {
				t.Helper()
				return streamAll(t, sm.GetMetadataDelta, req, req.GetMaxResults())
			}

			got, capacity, err := allocated(&csi.GetMetadataAllocatedRequest{SnapshotId: base})
			if want := []backend.BlockRange{span(0, 16*kib), span(2*mib, 64*kib)}; err != nil || !slices.Equal(got, want) || capacity != volumeSize {
				t.Errorf("allocated in base: %v, capacity %d, %v; want %v, %d", got, capacity, err, want, volumeSize)
			}
			got, _, err = allocated(&csi.GetMetadataAllocatedRequest{SnapshotId: target, MaxResults: 1, StartingOffset: 2*mib + 4*kib})
			if want := []backend.BlockRange{span(2*mib+4*kib, 60*kib), span(8*mib, 4*kib)}; err != nil || !slices.Equal(got, want) {
				t.Errorf("allocated in target from 2 MiB + 4 KiB, a range a response: %v, %v; want %v", got, err, want)
			}
			got, _, err = delta(&csi.GetMetadataDeltaRequest{BaseSnapshotId: base, TargetSnapshotId: target, MaxResults: 1})
			if want := []backend.BlockRange{span(2*mib+8*kib, 8*kib), span(8*mib, 4*kib)}; err != nil || !slices.Equal(got, want) {
				t.Errorf("delta, a range a response: %v, %v; want exactly what was written between, %v", got, err, want)
			}
			got, capacity, err = delta(&csi.GetMetadataDeltaRequest{BaseSnapshotId: base, TargetSnapshotId: target, StartingOffset: volumeSize})
			if err != nil || len(got) != 0 || capacity != volumeSize {
				t.Errorf("delta from the end: %v, capacity %d, %v; want nothing, and the capacity", got, capacity, err)
			}

			for _, tc := range []struct {
				name string
				req  *csi.GetMetadataAllocatedRequest
				want codes.Code
			}{
				{"no snapshot id", &csi.GetMetadataAllocatedRequest{}, codes.InvalidArgument},
				{"an unknown snapshot", &csi.GetMetadataAllocatedRequest{SnapshotId: unknown}, codes.NotFound},
				{"not a snapshot id", &csi.GetMetadataAllocatedRequest{SnapshotId: volID}, codes.NotFound},
				{"a negative offset", &csi.GetMetadataAllocatedRequest{SnapshotId: base, StartingOffset: -1}, codes.OutOfRange},
				{"an offset past the end", &csi.GetMetadataAllocatedRequest{SnapshotId: base, StartingOffset: volumeSize + 1}, codes.OutOfRange},
				{"negative max_results", &csi.GetMetadataAllocatedRequest{SnapshotId: base, MaxResults: -1}, codes.InvalidArgument},
			} {
				_, _, err := allocated(tc.req)
				wantCode(t, "allocated: "+tc.name, err, tc.want)
			}
			for _, tc := range []struct {
				name string
				req  *csi.GetMetadataDeltaRequest
				want codes.Code
			}{
				{"no base", &csi.GetMetadataDeltaRequest{TargetSnapshotId: target}, codes.InvalidArgument},
				{"no target", &csi.GetMetadataDeltaRequest{BaseSnapshotId: base}, codes.InvalidArgument},
				{"an unknown base", &csi.GetMetadataDeltaRequest{BaseSnapshotId: unknown, TargetSnapshotId: target}, codes.NotFound},
				{"snapshots of two volumes", &csi.GetMetadataDeltaRequest{BaseSnapshotId: ofOther, TargetSnapshotId: target}, codes.InvalidArgument},
				{"one snapshot twice", &csi.GetMetadataDeltaRequest{BaseSnapshotId: target, TargetSnapshotId: target}, codes.InvalidArgument},
				{"an offset past the end", &csi.GetMetadataDeltaRequest{BaseSnapshotId: base, TargetSnapshotId: target, StartingOffset: volumeSize + 1},
					codes.OutOfRange},
			} {
				_, _, err := delta(tc.req)
				wantCode(t, "delta: "+tc.name, err, tc.want)
			}
		})
	}
}

// TestSnapshotMetadataWaitsForTheController: the streaming calls are
// controller calls, refused UNAVAILABLE until the controller's backends
// are there, as the unary ones are; a backend that keeps no block metadata
// then says so.
func TestSnapshotMetadataWaitsForTheController(t *testing.T) {
	d, err := driver.New(driver.Config{Version: "test", Roles: []driver.Role{driver.RoleController}, ControllersLater: true})
	if err != nil {
		t.Fatal(err)
	}
	conn := serveDriver(t, d)
	sm := csi.NewSnapshotMetadataClient(conn)
	snapID := volumeid.ID{Backend: accessmode.BackendBlock, Zone: testZone, Kind: volumeid.Snapshot,
		Key: volumeid.KeyFor("test", volumeid.Snapshot, "any")}.String()
	req := &csi.GetMetadataAllocatedRequest{SnapshotId: snapID}

	_, _, err = streamAll(t, sm.GetMetadataAllocated, req, 0)
	wantCode(t, "before the controller's backends", err, codes.Unavailable)

	ctrl, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: testZone, SizeBytes: 1 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetControllers(map[accessmode.Backend]backend.Controller{accessmode.BackendBlock: ctrl}); err != nil {
		t.Fatal(err)
	}
	_, _, err = streamAll(t, sm.GetMetadataAllocated, req, 0)
	wantCode(t, "a backend that keeps no data", err, codes.Unimplemented)
	_, _, err = streamAll(t, sm.GetMetadataAllocated, &csi.GetMetadataAllocatedRequest{}, 0)
	wantCode(t, "no snapshot id", err, codes.InvalidArgument)
}

package memory_test

// The memory backend against the contract every backend shares, shaped
// as each real one (zoned block, zoneless NFS), and its faults.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/backendtest"
	"github.com/modeguard/modeguard/pkg/backend/memory"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// asBlock is a memory controller shaped as a block backend of two zones,
// listed out of alphabetical order so that order is seen to be kept.
func asBlock(t *testing.T) *memory.Controller {
	c, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-b", SizeBytes: 1 << 30}, {Zone: "zone-a", SizeBytes: 1 << 30}}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func asNFS(t *testing.T) *memory.Controller {
	c, err := memory.New(memory.Config{Backend: accessmode.BackendNFS, Pools: []memory.Pool{{SizeBytes: 1 << 30}}, MinimumSize: 4096, MountOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

var (
	blockProps = backendtest.BlockProperties
	nfsProps   = backendtest.NFSProperties
)

func TestControllerContractAsBlock(t *testing.T) {
	backendtest.RunControllerContract(t, blockProps, func(t *testing.T) backend.Controller { return asBlock(t) })
}

func TestControllerContractAsNFS(t *testing.T) {
	backendtest.RunControllerContract(t, nfsProps, func(t *testing.T) backend.Controller { return asNFS(t) })
}

func TestNodeContractBlock(t *testing.T) {
	backendtest.RunNodeContract(t, blockProps, func(t *testing.T) (backend.Controller, backend.Node) {
		c := asBlock(t)
		return c, memory.NewNode(c)
	})
}

func TestNodeContractMount(t *testing.T) {
	backendtest.RunNodeContract(t, nfsProps, func(t *testing.T) (backend.Controller, backend.Node) {
		c := asNFS(t)
		return c, memory.NewNode(c)
	})
}

// With a mount table and device files, as the driver's tests run it.
func TestNodeContractWithMounts(t *testing.T) {
	for name, props := range map[string]backendtest.Properties{"block": blockProps, "mount": nfsProps} {
		t.Run(name, func(t *testing.T) {
			backendtest.RunNodeContract(t, props, func(t *testing.T) (backend.Controller, backend.Node) {
				c := asBlock(t)
				if name == "mount" {
					c = asNFS(t)
				}
				return c, memory.NewNode(c, memory.WithMounts(mounts.NewMemory(), t.TempDir()))
			})
		})
	}
}

func volume(t *testing.T, c *memory.Controller, name string) volumeid.ID {
	t.Helper()
	id, err := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, name))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateVolume(t.Context(), backend.VolumeSpec{ID: id, Name: name, CapacityBytes: 1 << 20,
		AccessType: accessmode.Block, Modes: []accessmode.Mode{accessmode.SingleNodeWriter}}); err != nil {
		t.Fatal(err)
	}
	return id
}

func TestFailNextFailsOnceEach(t *testing.T) {
	c := asBlock(t)
	id := volume(t, c, "v")
	first, second := status.Error(codes.Unavailable, "first"), status.Error(codes.Internal, "second")
	c.FailNext("Volume", first)
	c.FailNext("Volume", second)
	for _, want := range []error{first, second, nil} {
		if _, err := c.Volume(t.Context(), id); !errors.Is(err, want) {
			t.Fatalf("Volume = %v, want %v", err, want)
		}
	}
	if got := c.Calls("Volume"); got != 3 {
		t.Fatalf("Calls(Volume) = %d, want 3", got)
	}
}

func TestFaultOfAnUnknownMethodPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("FailNext of a method the interface lacks did not panic")
		}
	}()
	asBlock(t).FailNext("CreateVolumes", errors.New("x"))
}

func TestDelayEndsWithTheContext(t *testing.T) {
	c := asBlock(t)
	c.Delay("ListVolumes", time.Hour)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	_, err := c.ListVolumes(ctx)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a delayed call whose deadline passed answered %v", err)
	}
	c.Delay("ListVolumes", 0)
	if _, err := c.ListVolumes(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// A hook holds a call where a test wants it, without holding the backend:
// other calls go on meanwhile.
func TestHookHoldsOneCallOnly(t *testing.T) {
	c := asBlock(t)
	id := volume(t, c, "v")
	entered, release := make(chan struct{}), make(chan struct{})
	c.Hook("ExpandVolume", func(context.Context) error { close(entered); <-release; return nil })
	done := make(chan error)
	go func() { _, err := c.ExpandVolume(context.Background(), id, 2<<20); done <- err }()
	<-entered
	if v, err := c.Volume(t.Context(), id); err != nil || v.CapacityBytes != 1<<20 {
		t.Fatalf("Volume while an expansion is held = %+v, %v", v, err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v, _ := c.Volume(t.Context(), id); v.CapacityBytes != 2<<20 {
		t.Fatalf("capacity after the released expansion: %d", v.CapacityBytes)
	}
}

// Concurrent creations never promise the same bytes twice.
func TestConcurrentCreationsShareThePool(t *testing.T) {
	c, err := memory.New(memory.Config{Pools: []memory.Pool{{Zone: "zone-a", SizeBytes: 10 << 20}}})
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		created int
	)
	for i := range 32 {
		wg.Go(func() {
			id, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, string(rune('a'+i))))
			_, err := c.CreateVolume(context.Background(), backend.VolumeSpec{ID: id, Name: id.Key, CapacityBytes: 1 << 20, AccessType: accessmode.Block})
			switch status.Code(err) {
			case codes.OK:
				mu.Lock()
				created++
				mu.Unlock()
			case codes.ResourceExhausted:
			default:
				t.Errorf("CreateVolume: %v", err)
			}
		})
	}
	wg.Wait()
	if created != 10 {
		t.Fatalf("%d volumes of 1 MiB were created in a pool of 10 MiB", created)
	}
}

func TestReturnedVolumesAreCopies(t *testing.T) {
	c := asBlock(t)
	id := volume(t, c, "v")
	v, _ := c.SetAttachments(t.Context(), id, []accessmode.Attachment{{Node: nodeid.MustParse("n@zone-a"), Mode: accessmode.SingleNodeWriter}})
	v.Attachments[0].Node.Name = "changed"
	v.Modes[0] = accessmode.MultiNodeMultiWriter
	again, _ := c.Volume(t.Context(), id)
	if again.Attachments[0].Node.String() != "n@zone-a" || again.Modes[0] != accessmode.SingleNodeWriter {
		t.Fatalf("a returned volume aliases the record: %+v", again)
	}
}

func TestRestoreWaitsForACuttingSnapshot(t *testing.T) {
	c := asBlock(t)
	source := volume(t, c, "v")
	snap, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, "s"))
	if _, err := c.CreateSnapshot(t.Context(), snap, "s", source); err != nil {
		t.Fatal(err)
	}
	if err := c.SetCutting(snap, true); err != nil {
		t.Fatal(err)
	}
	restore, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, volumeid.KeyFor("test", volumeid.Volume, "r"))
	spec := backend.VolumeSpec{ID: restore, Name: "r", CapacityBytes: 1 << 20, AccessType: accessmode.Block,
		Source: &backend.Source{SnapshotID: snap.String()}}
	if _, err := c.CreateVolume(t.Context(), spec); status.Code(err) != codes.Unavailable {
		t.Fatalf("a restore from a snapshot still cut answered %v", err)
	}
	if s, _ := c.Snapshot(t.Context(), snap); !s.Cutting {
		t.Fatal("Snapshot of a snapshot still cut says it is ready")
	}
	c.SetCutting(snap, false)
	if _, err := c.CreateVolume(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
}

func TestSetHealth(t *testing.T) {
	c := asBlock(t)
	id := volume(t, c, "v")
	lost := backend.Health{Abnormal: true, Condition: backend.DataLoss, Reason: "Lost"}
	c.SetHealth(id, lost)
	if h, err := c.VolumeHealth(t.Context(), id); err != nil || h != lost {
		t.Fatalf("VolumeHealth = %+v, %v; want %+v", h, err, lost)
	}
}

// Lose is a reboot: every stage is gone, and Check says so.
func TestNodeLoseForgetsTheStages(t *testing.T) {
	c := asBlock(t)
	id := volume(t, c, "v")
	if _, err := c.SetAttachments(t.Context(), id, []accessmode.Attachment{{Node: nodeid.MustParse("n@zone-a"), Mode: accessmode.SingleNodeWriter}}); err != nil {
		t.Fatal(err)
	}
	n := memory.NewNode(c)
	staged, err := n.Stage(t.Context(), backend.StageRequest{VolumeID: id, Node: nodeid.MustParse("n@zone-a"), StagingPath: t.TempDir(), AccessType: accessmode.Block})
	if err != nil {
		t.Fatal(err)
	}
	n.Lose()
	if got, _ := n.Check(t.Context(), staged); got.State != backend.StageGone {
		t.Fatalf("Check after Lose = %+v", got)
	}
	if got := n.Calls("Stage"); got != 1 {
		t.Fatalf("the node counted %d stages, want 1", got)
	}
}

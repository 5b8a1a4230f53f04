// Package stories walks a running modeguard deployment through the
// situations that surprise storage users, calling CSI exactly as a CO would
// and checking that each access mode holds: one node for ReadWriteOnce, one
// workload for ReadWriteOncePod, read-only where the mode says so, volumes
// placed in and kept to their zone.
//
// The same stories back `modeguard demo`, which prints every step, and the
// multi-process integration tests, which fail on any step that does not go
// as the story says.
package stories

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/driver"
)

// Node is one node plugin of the deployment.
type Node struct {
	Name   string
	Zone   string
	Client csi.NodeClient
	// Restart kills the node plugin with SIGKILL and starts it again,
	// returning once it answers; nil when the deployment cannot do that.
	Restart func(ctx context.Context) error
	id      string
}

// Cluster is what a story runs against.
type Cluster struct {
	Controller csi.ControllerClient
	Nodes      []*Node
	// WorkDir is where the stories create staging and target paths.
	WorkDir string
	// Out receives the narration.
	Out io.Writer
}

// Story is one situation, told as steps.
type Story struct {
	Name    string
	Summary string
	Run     func(ctx context.Context, e *Env) error
}

// Env gives a story its cluster and the helpers that narrate and check.
type Env struct {
	*Cluster
	story string
	seq   int
}

func (e *Env) node(name string) *Node {
	for _, n := range e.Nodes {
		if n.Name == name {
			return n
		}
	}
	panic("story names unknown node " + name)
}

func (e *Env) say(format string, a ...any) {
	fmt.Fprintf(e.Out, "    "+format+"\n", a...)
}

// expect narrates one step and checks its outcome against the story.
func (e *Env) expect(what string, err error, want codes.Code) error {
	got := status.Code(err)
	switch {
	case got == want && err == nil:
		e.say("✓ %s: OK", what)
		return nil
	case got == want:
		e.say("✓ %s: refused, %s", what, got)
		e.say("    %s", status.Convert(err).Message())
		return nil
	case err == nil:
		e.say("✗ %s: OK, but the story expects %s", what, want)
	default:
		e.say("✗ %s: %s (%s), but the story expects %s", what, got, status.Convert(err).Message(), want)
	}
	return fmt.Errorf("%s: %s: got %s, want %s: %v", e.story, what, got, want, err)
}

func capability(mode accessmode.Mode, accessType accessmode.AccessType) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if accessType == accessmode.Block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}}
	}
	return c
}

// Volume is a volume a story created, with what it takes to use it.
type Volume struct {
	ID         string
	Mode       accessmode.Mode
	AccessType accessmode.AccessType
	Zone       string
	Context    map[string]string
	published  map[string]map[string]string // node name -> publish context
}

func (e *Env) createVolume(ctx context.Context, name string, mode accessmode.Mode, at accessmode.AccessType, zone string, params map[string]string) (*Volume, error) {
	req := &csi.CreateVolumeRequest{
		Name:               e.story + "-" + name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{capability(mode, at)},
		Parameters:         params,
	}
	if zone != "" {
		seg := &csi.Topology{Segments: map[string]string{driver.TopologyZoneKey: zone}}
		req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{seg}, Preferred: []*csi.Topology{seg}}
	}
	resp, err := e.Controller.CreateVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	v := resp.GetVolume()
	vol := &Volume{ID: v.GetVolumeId(), Mode: mode, AccessType: at, Context: v.GetVolumeContext(),
		published: map[string]map[string]string{}}
	for _, t := range v.GetAccessibleTopology() {
		vol.Zone = t.GetSegments()[driver.TopologyZoneKey]
	}
	return vol, nil
}

// attach is ControllerPublishVolume of vol to node.
func (e *Env) attach(ctx context.Context, vol *Volume, node string, readOnly bool) error {
	n := e.node(node)
	resp, err := e.Controller.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: vol.ID, NodeId: n.id, VolumeCapability: capability(vol.Mode, vol.AccessType), Readonly: readOnly,
	})
	if err == nil {
		vol.published[node] = resp.GetPublishContext()
	}
	return err
}

func (e *Env) detach(ctx context.Context, vol *Volume, node string) error {
	_, err := e.Controller.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{
		VolumeId: vol.ID, NodeId: e.node(node).id,
	})
	delete(vol.published, node)
	return err
}

func (e *Env) stagingPath(vol *Volume, node string) string {
	return filepath.Join(e.WorkDir, node, "staging", sanitize(vol.ID))
}

// TargetPath is where a pod's mount of vol on node lives.
func (e *Env) targetPath(vol *Volume, node, pod string) string {
	return filepath.Join(e.WorkDir, node, "pods", pod, sanitize(vol.ID))
}

func sanitize(s string) string { return strings.NewReplacer(":", "_", "/", "_").Replace(s) }

func (e *Env) stage(ctx context.Context, vol *Volume, node string) error {
	_, err := e.node(node).Client.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: vol.ID, StagingTargetPath: e.stagingPath(vol, node),
		VolumeCapability: capability(vol.Mode, vol.AccessType), PublishContext: vol.published[node],
		VolumeContext: vol.Context,
	})
	return err
}

func (e *Env) unstage(ctx context.Context, vol *Volume, node string) error {
	_, err := e.node(node).Client.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{
		VolumeId: vol.ID, StagingTargetPath: e.stagingPath(vol, node),
	})
	return err
}

// mountPod is NodePublishVolume for one pod, with the pod info Kubernetes
// passes when the CSIDriver has podInfoOnMount.
func (e *Env) mountPod(ctx context.Context, vol *Volume, node, pod string, readOnly bool) error {
	volCtx := map[string]string{
		"csi.storage.k8s.io/pod.name":      pod,
		"csi.storage.k8s.io/pod.namespace": "default",
		"csi.storage.k8s.io/pod.uid":       "uid-" + pod,
	}
	for k, v := range vol.Context {
		volCtx[k] = v
	}
	target := e.targetPath(vol, node, pod)
	if vol.AccessType == accessmode.Mount {
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return err
		}
	}
	_, err := e.node(node).Client.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: vol.ID, StagingTargetPath: e.stagingPath(vol, node), TargetPath: target,
		VolumeCapability: capability(vol.Mode, vol.AccessType), Readonly: readOnly,
		PublishContext: vol.published[node], VolumeContext: volCtx,
	})
	return err
}

func (e *Env) unmountPod(ctx context.Context, vol *Volume, node, pod string) error {
	_, err := e.node(node).Client.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{
		VolumeId: vol.ID, TargetPath: e.targetPath(vol, node, pod),
	})
	return err
}

// start attaches, stages and mounts for one pod, the way a CO starts a pod.
func (e *Env) start(ctx context.Context, vol *Volume, node, pod string, readOnly bool) error {
	if _, attached := vol.published[node]; !attached {
		if err := e.attach(ctx, vol, node, readOnly); err != nil {
			return err
		}
		if err := e.stage(ctx, vol, node); err != nil {
			return err
		}
	}
	return e.mountPod(ctx, vol, node, pod, readOnly)
}

// stop unmounts a pod and, when it was the node's last, unstages and
// detaches, the way a CO cleans up after a pod.
func (e *Env) stop(ctx context.Context, vol *Volume, node string, pods ...string) error {
	for _, pod := range pods {
		if err := e.unmountPod(ctx, vol, node, pod); err != nil {
			return err
		}
	}
	if err := e.unstage(ctx, vol, node); err != nil {
		return err
	}
	return e.detach(ctx, vol, node)
}

func (e *Env) deleteVolume(ctx context.Context, vol *Volume) error {
	_, err := e.Controller.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.ID})
	return err
}

// write tries to write through a pod's mount: a file for a filesystem, the
// first block for a raw device.
func (e *Env) write(vol *Volume, node, pod, content string) error {
	target := e.targetPath(vol, node, pod)
	if vol.AccessType == accessmode.Block {
		f, err := os.OpenFile(target, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		buf := make([]byte, 4096)
		copy(buf, content)
		if _, err := f.WriteAt(buf, 0); err != nil {
			return err
		}
		return f.Sync()
	}
	f, err := os.Create(filepath.Join(target, "data.txt"))
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.WriteString(content); err != nil {
		return err
	}
	return f.Sync()
}

func (e *Env) read(vol *Volume, node, pod string) (string, error) {
	target := e.targetPath(vol, node, pod)
	if vol.AccessType == accessmode.Block {
		f, err := os.Open(target)
		if err != nil {
			return "", err
		}
		defer f.Close()
		buf := make([]byte, 4096)
		if _, err := f.ReadAt(buf, 0); err != nil {
			return "", err
		}
		return strings.TrimRight(string(buf), "\x00"), nil
	}
	data, err := os.ReadFile(filepath.Join(target, "data.txt"))
	return string(data), err
}

// expectWrite narrates a write and checks whether it succeeded or was
// refused by a read-only mount, as the story says.
func (e *Env) expectWrite(vol *Volume, node, pod, content string, allowed bool) error {
	err := e.write(vol, node, pod, content)
	what := fmt.Sprintf("%s on %s writes %q", pod, node, content)
	switch {
	case allowed && err == nil:
		e.say("✓ %s: written", what)
		return nil
	case !allowed && isReadOnlyError(err):
		e.say("✓ %s: refused by the kernel (%v)", what, err)
		return nil
	case allowed:
		e.say("✗ %s: %v", what, err)
		return fmt.Errorf("%s: %s: %w", e.story, what, err)
	default:
		e.say("✗ %s: the write went through on a read-only mount", what)
		return fmt.Errorf("%s: %s: write went through, want EROFS (err=%v)", e.story, what, err)
	}
}

// isReadOnlyError tells a write refused by a read-only mount (EROFS) or, for
// a raw device, by the read-only loop device itself (EPERM) from any other
// failure. A read-only bind mount does not stop writes to a device node: the
// device must be read-only too, and the stories check that it is.
func isReadOnlyError(err error) bool {
	return errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EACCES)
}

func (e *Env) expectRead(vol *Volume, node, pod, want string) error {
	got, err := e.read(vol, node, pod)
	what := fmt.Sprintf("%s on %s reads the data", pod, node)
	if err != nil || got != want {
		e.say("✗ %s: got %q, %v; want %q", what, got, err, want)
		return fmt.Errorf("%s: %s: got %q (%v), want %q", e.story, what, got, err, want)
	}
	e.say("✓ %s: %q", what, got)
	return nil
}

// Run tells every story against c, stopping at the first that fails.
func Run(ctx context.Context, c *Cluster, only ...string) error {
	if err := c.resolveNodeIDs(ctx); err != nil {
		return err
	}
	for _, s := range All() {
		if len(only) > 0 && !contains(only, s.Name) {
			continue
		}
		fmt.Fprintf(c.Out, "\n== %s\n   %s\n", s.Name, s.Summary)
		e := &Env{Cluster: c, story: s.Name}
		if err := s.Run(ctx, e); err != nil {
			return err
		}
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// resolveNodeIDs asks every node plugin for its CSI node id, as a CO does.
func (c *Cluster) resolveNodeIDs(ctx context.Context) error {
	for _, n := range c.Nodes {
		info, err := n.Client.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil {
			return fmt.Errorf("NodeGetInfo on %s: %w", n.Name, err)
		}
		n.id = info.GetNodeId()
	}
	return nil
}

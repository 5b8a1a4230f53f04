package nfs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/fsutil"
	"github.com/modeguard/modeguard/pkg/mounts"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// DefaultMountOptions are used unless the volume capability's mount flags
// set the same option: NFSv4.2 over TCP, hard mounts (a server restart stalls
// I/O rather than failing it), the kernel's usual timeouts, and nosharecache.
//
// nosharecache gives each volume's mount a superblock of its own. The
// volumes of one server lie on one filesystem there (one fsid), so the
// kernel would otherwise put every export of that server mounted on a node
// on one superblock, with one device number; the kubelet then takes the
// staging mount of each volume for a reference to the other's and never
// unstages either while both are staged (GetDeviceMountRefs). The mount
// flag "sharecache" is refused for this reason (checkNoSharedCache).
var DefaultMountOptions = []string{"vers=4.2", "proto=tcp", "hard", "timeo=600", "retrans=2", "nosharecache"}

// checkNoSharedCache refuses mount flags that would make volumes share a
// superblock (see DefaultMountOptions).
func checkNoSharedCache(flags []string) error {
	for _, f := range flags {
		for _, o := range backend.SplitMountOptions(f) {
			if o == "sharecache" {
				return status.Error(codes.InvalidArgument,
					`mount flag "sharecache" is not possible for NFS volumes: every volume's mount needs a superblock of its own (nosharecache, the default), or the kubelet cannot unstage volumes of one server staged on one node; remove it from the StorageClass's mountOptions`)
			}
		}
	}
	return nil
}

// healthTimeout bounds how long a health check waits for a server that does
// not answer: a hung statfs means the mount is unusable.
const healthTimeout = 5 * time.Second

var sharePattern = regexp.MustCompile(`^/[A-Za-z0-9_.:-]+$`)

// Node implements backend.Node for NFS: one kernel NFS mount per volume
// per node at the staging path; workloads get bind mounts of it.
type Node struct {
	mounter mount.Interface
	table   MountTable
}

var _ backend.Node = (*Node)(nil)

// MountTable is where the node reads what is mounted at a path.
type MountTable interface {
	At(path string) (*mounts.Mount, error)
}

// NewNode returns the NFS node backend. mounter and table are the kernel's
// (mount.New(""), mounts.Table{}) when nil; tests that cannot mount NFS
// inject a mounter and a table that agree with each other.
func NewNode(mounter mount.Interface, table MountTable) *Node {
	if mounter == nil {
		mounter = mount.New("")
	}
	if table == nil {
		table = mounts.Table{}
	}
	return &Node{mounter: mounter, table: table}
}

// isNFS tells an NFS mount from the mount table.
func isNFS(m *mounts.Mount) bool { return m.FSType == "nfs4" || m.FSType == "nfs" }

// exportSuffix is the end of the source an NFS mount of volume id names, whatever the
// server: the export's pseudo path is the volume's file name.
func exportSuffix(id string) (string, error) {
	vid, err := volumeid.ParseKind(id, volumeid.Volume)
	if err != nil {
		return "", status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	return ":/" + vid.FileName(), nil
}

func (n *Node) Backend() accessmode.Backend { return accessmode.BackendNFS }

// ReadOnlyDevices is nil: NFS volumes are filesystems only, and the
// kernel honours the read-only flag of a bind mount of one.
func (n *Node) ReadOnlyDevices() backend.ReadOnlyDevices { return nil }

// source reads the server and export path from the volume context the
// controller produced, refusing anything that is not plainly an address and
// an export path.
func source(volCtx map[string]string) (string, int, error) {
	server, share := volCtx[ContextServer], volCtx[ContextShare]
	addr, err := netip.ParseAddr(server)
	if err != nil || addr.Zone() != "" {
		return "", 0, status.Errorf(codes.InvalidArgument,
			"volume context %s=%q is not an IP address; the volume context must come from this driver's CreateVolume", ContextServer, server)
	}
	if !sharePattern.MatchString(share) {
		return "", 0, status.Errorf(codes.InvalidArgument, "volume context %s=%q is not an export path", ContextShare, share)
	}
	port := 2049
	if p, ok := volCtx[ContextPort]; ok {
		if port, err = strconv.Atoi(p); err != nil || port < 1 || port > 65535 {
			return "", 0, status.Errorf(codes.InvalidArgument, "volume context %s=%q is not a port", ContextPort, p)
		}
	}
	host := server
	if addr.Is6() {
		host = "[" + server + "]"
	}
	return host + ":" + share, port, nil
}

// mountOptions puts the CO's flags first and adds each default whose option
// the CO did not set; read-only stages get "ro" whatever the flags say.
// addr= (the server) and clientaddr= (this node) are always given: the
// kernel needs them when no mount.nfs helper is installed to work them out
// (minimal hosts, busybox), and the helper accepts them.
func mountOptions(flags []string, port int, readOnly bool, server, client string) []string {
	opts := []string{}
	set := map[string]bool{}
	for _, f := range flags {
		for _, o := range backend.SplitMountOptions(f) {
			if o == "" || o == "rw" {
				continue
			}
			opts = append(opts, o)
			key, _, _ := strings.Cut(o, "=")
			set[key] = true
			if key == "nfsvers" {
				set["vers"] = true
			}
		}
	}
	for _, d := range DefaultMountOptions {
		key, _, _ := strings.Cut(d, "=")
		if !set[key] {
			opts = append(opts, d)
		}
	}
	if port != 2049 && !set["port"] {
		opts = append(opts, "port="+strconv.Itoa(port))
	}
	if server != "" && !set["addr"] {
		opts = append(opts, "addr="+server)
	}
	if client != "" && !set["clientaddr"] {
		opts = append(opts, "clientaddr="+client)
	}
	// Last, always: mount(8) reads options left to right, and a CO flag
	// such as "defaults" after the CO's own "ro" would make it read/write.
	if readOnly {
		opts = append(opts, "ro")
	}
	return opts
}

func (n *Node) Stage(ctx context.Context, req backend.StageRequest) (*backend.Staged, error) {
	if req.AccessType != accessmode.Mount {
		return nil, status.Error(codes.InvalidArgument, "backend nfs serves filesystems only; access type block is not possible")
	}
	src, port, err := source(req.VolumeContext)
	if err != nil {
		return nil, err
	}
	if err := checkNoSharedCache(req.MountFlags); err != nil {
		return nil, err
	}
	// The export is the volume's own: a volume context naming another
	// volume's share would mount that volume under this one's id, past
	// the access-mode rules (and the records) of both.
	if share := req.VolumeContext[ContextShare]; share != pseudo(req.VolumeID) {
		return nil, status.Errorf(codes.InvalidArgument,
			"volume context %s=%q is not the export of volume %s (%s); the volume context must come from this driver's CreateVolume for this volume",
			ContextShare, share, req.VolumeID, pseudo(req.VolumeID))
	}
	staged := &backend.Staged{
		VolumeID: req.VolumeID.String(), StagingPath: req.StagingPath, AccessType: accessmode.Mount,
		ReadOnly: req.ReadOnly, Source: src,
	}
	if err := os.MkdirAll(req.StagingPath, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "creating the staging path: %v", err)
	}
	m, err := n.table.At(req.StagingPath)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspecting staging path %s: %v", req.StagingPath, err)
	}
	if m != nil {
		// A retry after a crash between mount and record: the mount is ours
		// only if it is this export.
		if isNFS(m) && m.Source == src {
			return staged, nil
		}
		return nil, status.Errorf(codes.AlreadyExists, "staging path %s already holds another mount (%s, %s)", req.StagingPath, m.Source, m.FSType)
	}
	opts := mountOptions(req.MountFlags, port, req.ReadOnly, req.VolumeContext[ContextServer], req.Node.Address)
	if err := n.mounter.Mount(src, req.StagingPath, "nfs4", opts); err != nil {
		if refusedByServer(err) {
			return nil, status.Errorf(codes.FailedPrecondition,
				"the NFS server refused %s to this node: the export is open only to the nodes the volume is published to (ControllerPublishVolume must succeed for this node first): %v", src, err)
		}
		return nil, status.Errorf(codes.Internal, "mounting %s at %s: %v", src, req.StagingPath, err)
	}
	return staged, nil
}

func (n *Node) Unstage(ctx context.Context, staged *backend.Staged) error {
	m, err := n.table.At(staged.StagingPath)
	if err != nil {
		return status.Errorf(codes.Internal, "inspecting staging path %s: %v", staged.StagingPath, err)
	}
	if m == nil {
		return nil
	}
	id, err := volumeid.ParseKind(staged.VolumeID, volumeid.Volume)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "staged volume id: %v", err)
	}
	if ours, err := n.Owns(ctx, id, m); err != nil {
		return err
	} else if !ours {
		return nil // not this volume's mount: not ours to remove
	}
	if err := n.mounter.Unmount(staged.StagingPath); err != nil {
		return status.Errorf(codes.Internal, "unmounting %s: %v", staged.StagingPath, err)
	}
	return nil
}

// Check compares a stage record with the mount table: the staging path
// must hold an NFS mount of this volume's export.
func (n *Node) Check(ctx context.Context, staged *backend.Staged) (backend.StageCheck, error) {
	suffix, err := exportSuffix(staged.VolumeID)
	if err != nil {
		return backend.StageCheck{}, err
	}
	m, err := n.table.At(staged.StagingPath)
	if err != nil {
		return backend.StageCheck{}, status.Errorf(codes.Internal, "inspecting staging path %s: %v", staged.StagingPath, err)
	}
	if m == nil {
		return backend.StageCheck{State: backend.StageGone, Detail: fmt.Sprintf("nothing is mounted at %s", staged.StagingPath)}, nil
	}
	want := staged.Source
	if isNFS(m) && (m.Source == want || want == "" && strings.HasSuffix(m.Source, suffix)) {
		return backend.StageCheck{State: backend.StageIntact}, nil
	}
	return backend.StageCheck{State: backend.StageBroken,
		Detail: fmt.Sprintf("%s holds %s (%s), not the volume's export %s", staged.StagingPath, m.Source, m.FSType, want)}, nil
}

// Owns reports whether m is an NFS mount of volume id's export (the
// staging mount, or a bind mount of it, which the table shows alike).
func (n *Node) Owns(ctx context.Context, id volumeid.ID, m *mounts.Mount) (bool, error) {
	suffix, err := exportSuffix(id.String())
	if err != nil {
		return false, err
	}
	return isNFS(m) && strings.HasSuffix(m.Source, suffix), nil
}

// Expand has nothing to do and nothing exact to report: the server's new
// limit is what clients see at once, and statfs on the client shows the
// filesystem's size less its own overhead, never the volume's capacity. It
// returns 0 ("not known here"), which NodeExpandVolume leaves out of its answer.
func (n *Node) Expand(ctx context.Context, staged *backend.Staged) (int64, error) {
	if _, err := fsutil.StatfsWithin(staged.StagingPath, healthTimeout); err != nil {
		return 0, status.Errorf(codes.FailedPrecondition, "the NFS mount at %s does not answer: %v", staged.StagingPath, err)
	}
	return 0, nil
}

func (n *Node) Health(ctx context.Context, staged *backend.Staged) backend.Health {
	m, err := n.table.At(staged.StagingPath)
	if err != nil {
		return backend.Health{Abnormal: true, Reason: "MountTableUnreadable", Message: err.Error()}
	}
	if m == nil {
		return backend.Health{Abnormal: true, Reason: "NotMounted",
			Message: fmt.Sprintf("the NFS export is no longer mounted at %s", staged.StagingPath)}
	}
	if _, err := fsutil.StatfsWithin(staged.StagingPath, healthTimeout); err != nil {
		reason := "Unreachable"
		if errors.Is(err, unix.ESTALE) {
			reason = "StaleMount"
		}
		return backend.Health{Abnormal: true, Reason: reason,
			Message: fmt.Sprintf("the NFS mount at %s does not answer: %v", staged.StagingPath, err)}
	}
	return backend.Health{}
}

// refusedByServer tells a mount the server refused (a client not in the
// export's list sees the export as absent, or access denied) from other
// failures.
func refusedByServer(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "access denied by server") ||
		strings.Contains(msg, "reason given by server: No such file or directory") ||
		strings.Contains(msg, "Permission denied")
}

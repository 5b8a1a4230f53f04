// Command modeguard is a CSI driver whose access modes hold: it serves the
// CSI Identity, Controller and Node services over one endpoint.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	logsapi "k8s.io/component-base/logs/api/v1"
	_ "k8s.io/component-base/logs/json/register" // --logging-format=json
	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/served"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/controllerlock"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/election"
	"github.com/modeguard/modeguard/pkg/metrics"
	"github.com/modeguard/modeguard/pkg/netfence"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/peer"
	"github.com/modeguard/modeguard/pkg/registration"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// poolFlag collects repeated --block-pool ZONE=DIR flags.
type poolFlag map[string]string

func (p poolFlag) String() string { return zoneValues(p) }

// zoneValues renders a ZONE=VALUE map as its flags would be written.
func zoneValues(m map[string]string) string {
	var parts []string
	for z, d := range m {
		parts = append(parts, z+"="+d)
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

func (p poolFlag) Set(v string) error {
	return setZoneValue(p, v, "DIR", "pools", func(dir string) error {
		if !strings.HasPrefix(dir, "/") {
			return fmt.Errorf("pool directory %q must be an absolute path", dir)
		}
		return nil
	})
}

// setZoneValue reads ZONE=VALUE into m: what is VALUE's name in the
// message, plural what a zone may not have two of; check checks VALUE.
func setZoneValue(m map[string]string, v, what, plural string, check func(string) error) error {
	zone, value, ok := strings.Cut(v, "=")
	if !ok || value == "" {
		return fmt.Errorf("want ZONE=%s, got %q", what, v)
	}
	if !volumeid.ValidZone(zone) {
		return fmt.Errorf("zone %q is not a valid zone name (letters, digits, '-', '_', '.')", zone)
	}
	if _, dup := m[zone]; dup {
		return fmt.Errorf("zone %q has two %s", zone, plural)
	}
	if err := check(value); err != nil {
		return err
	}
	m[zone] = value
	return nil
}

type options struct {
	endpoint    string
	roles       string
	nodeID      string
	zone        string
	nodeAddress string
	stateDir    string
	driverName  string
	maxVolumes  int64
	pools       poolFlag
	// poolFilesystem is --block-pool-filesystem; roots are the pool roots
	// it gave each zone's --block-pool directory (block.KeepPools).
	poolFilesystem string
	roots          map[string]string
	metricsAddr    string
	showVersion    bool
	logging        *logsapi.LoggingConfiguration
	nfs            nfs.Options
	// fenceFile is where the controller keeps its network fences.
	fenceFile string

	// iscsiInitiatorFile is where the node reads its iSCSI initiator name;
	// iscsiSecretFile holds its CHAP secret; iscsiReplacement bounds how
	// long I/O waits for a lost session before it fails.
	iscsiInitiatorFile, iscsiSecretFile string
	iscsiReplacement                    time.Duration

	// Storage targets: the zones the controller reaches through one
	// (--block-target), where a target serves (--target-endpoint), and
	// this side's certificate for the API between them.
	targets targetFlag
	// nfsTarget is --nfs-target: the storage target that serves the NFS
	// volumes, so that the controller keeps none of their state.
	nfsTarget      string
	targetEndpoint string
	targetStateDir string
	tls            remote.TLSFiles
	// controllerPeerListen is where a controller takes the calls its
	// standbys forward (tcp://HOST:PORT), and peerAddress the HOST:PORT
	// it advertises of it.
	controllerPeerListen, peerAddress string
	// controllerPeers are the other controllers' peer addresses
	// (--controller-peers), where a standby that reads no lease looks for
	// the acting one.
	controllerPeers []string
	// iSCSI, for a target that serves its volumes to the nodes over it.
	iscsiPortal, iscsiPrefix, iscsiCHAPDir string

	// Registration with the kubelet, for nodes without node-driver-registrar.
	kubeletRegistrationDir  string
	kubeletRegistrationPath string
}

// rolesOf spells roles as the flag does.
func rolesOf(roles []driver.Role) []string {
	out := make([]string, len(roles))
	for i, r := range roles {
		out[i] = string(r)
	}
	return out
}

// byteSize is a flag holding bytes, written plainly or with a binary suffix
// (Ki, Mi, Gi, Ti).
type byteSize struct{ v *int64 }

func (b byteSize) String() string {
	if b.v == nil {
		return "0"
	}
	return strconv.FormatInt(*b.v, 10)
}

func (b byteSize) Set(s string) error {
	mult := int64(1)
	for suffix, m := range map[string]int64{"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40} {
		if strings.HasSuffix(s, suffix) {
			mult, s = m, strings.TrimSuffix(s, suffix)
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n > (1<<62)/mult {
		return fmt.Errorf("want a positive number of bytes, optionally with Ki, Mi, Gi or Ti")
	}
	*b.v = n * mult
	return nil
}

func parseFlags(args []string) (*options, error) {
	o := &options{pools: poolFlag{}, targets: targetFlag{}}
	fs := flagSet(o)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	return o, nil
}

// flagSet is the command line of modeguard serving CSI, filling o; the
// reference's flag table is checked against it (docs_test.go).
func flagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("modeguard", flag.ContinueOnError)
	fs.StringVar(&o.endpoint, "endpoint", "unix:///run/modeguard/csi.sock",
		"where to serve CSI: unix:///path/to/socket or tcp://host:port")
	fs.StringVar(&o.roles, "roles", "controller,node",
		"services to serve besides Identity: controller, node, or controller,node; or target alone (a storage target serving its --block-pool, or the NFS volumes of its --nfs-export-root, to controllers; no CSI)")
	fs.StringVar(&o.nodeID, "node-id", "", "this node's name (node role): a Kubernetes node name, up to 253 characters, kept in the CSI node id (a stable 63-character form of a longer name); the CSI node id is <name>@<zone>[@<node-address>[@<max-volumes-per-node>[@<iSCSI initiator name>]]]")
	fs.StringVar(&o.zone, "zone", "", "this node's topology zone (node role), reported as "+driver.TopologyZoneKey)
	fs.StringVar(&o.nodeAddress, "node-address", "", "IP address this node mounts NFS exports from (node role, optional)")
	fs.StringVar(&o.iscsiInitiatorFile, "iscsi-initiator-name-file", "",
		"node: open-iscsi's initiator name file (usually "+iscsi.InitiatorNameFile+"); the name in it goes into the node id, for the iSCSI transport's access lists (empty: this node does not reach volumes over iSCSI)")
	fs.StringVar(&o.iscsiSecretFile, "iscsi-chap-secret-file", "",
		"node: this node's CHAP secret for the storage targets (its key of the targets' CHAP Secret); needed with --iscsi-initiator-name-file")
	fs.DurationVar(&o.iscsiReplacement, "iscsi-replacement-timeout", 30*time.Second,
		"node: how long I/O on an iSCSI session that lost its target waits for it before failing (a target restart must fit in it; a fenced node's writes fail after it at the latest)")
	fs.StringVar(&o.stateDir, "state-dir", "/var/lib/modeguard", "directory for this node plugin's lock files and stage records")
	fs.StringVar(&o.driverName, "driver-name", driver.DefaultDriverName, "CSI driver name")
	fs.Int64Var(&o.maxVolumes, "max-volumes-per-node", 128, "node: volumes this node may hold at once, reported in NodeGetInfo and in its node id; the controller refuses an attach beyond it (0: no limit)")
	fs.Var(o.pools, "block-pool", "ZONE=DIR: a block pool this process may place or find volumes in (repeatable)")
	fs.StringVar(&o.poolFilesystem, "block-pool-filesystem", block.PoolFilesystemAuto,
		"how a --block-pool directory holds volumes. Where its filesystem has no reflinks (ext4, tmpfs), the driver keeps a sparse filesystem with reflinks in it, "+
			"so that snapshots and clones of volumes in use are instant clones; a directory with reflinks, with volumes of an earlier pool, or under 300 MiB is used as it is. "+
			"auto: a btrfs where this machine has mkfs.btrfs and btrfs in its kernel (group snapshots of volumes being written are then of one instant), else an xfs with reflinks; "+
			"a kept image is mounted as whichever it holds. btrfs: always a btrfs (a directory on btrfs is used as it is). xfs: always an xfs with reflinks. "+
			"direct: always as it is (snapshots and clones of volumes attached read-write are refused without reflinks). Every process of a zone must agree")
	fs.Var(o.targets, "block-target", "controller: ZONE=HOST:PORT or ZONE=unix:///PATH: the storage target (--roles target) that serves zone ZONE's block pool (repeatable)")
	fs.Func("nfs-target", "controller: HOST:PORT or unix:///PATH: the storage target (--roles target with --nfs-export-root) that serves the NFS volumes, "+
		"their data, ganesha and its recovery records; the controller then keeps nothing of NFS on its host (not with --nfs-export-root)", func(v string) error {
		if err := checkTargetAddress(v); err != nil {
			return err
		}
		o.nfsTarget = v
		return nil
	})
	fs.StringVar(&o.targetEndpoint, "target-endpoint", "unix:///run/modeguard/target.sock",
		"target: where to serve the storage target's API: unix:///path (0600) or tcp://host:port (mutual TLS: --tls-cert, --tls-key, --tls-ca)")
	fs.StringVar(&o.targetStateDir, "target-state-dir", "",
		"target: a directory on the target's own disk for its lease record (which controller holds it, at which epoch) and the network fence list, kept across restarts; "+
			"empty: the first --block-pool's directory in zone order, or --nfs-export-root")
	fs.StringVar(&o.controllerPeerListen, "controller-peer-listen", "",
		"controller: tcp://HOST:PORT where this controller, when acting, takes the calls the standby controllers forward to it (mutual TLS: --tls-cert, "+
			"--tls-key, --tls-ca; the certificate names "+peer.ServerName+"), and which it records in the storage targets' leases for them; HOST is the address the others reach it at "+
			"(in a pod, $(POD_IP)). Empty: a standby refuses the calls it receives (UNAVAILABLE) rather than forward them")
	fs.Func("controller-peers", "controller with --controller-peer-listen: HOST:PORT[,HOST:PORT...] of the other controllers' peer listeners, a HOST that is a name standing for every address "+
		"it resolves to (a headless Service); a standby that reads no storage target's lease (lock files arbitrate its pools, or it is cut off from the targets) "+
		"forwards each call to them in turn, and the acting one takes it", func(v string) error {
		for _, entry := range strings.Split(v, ",") {
			host, port, err := net.SplitHostPort(strings.TrimSpace(entry))
			if err != nil || host == "" || port == "" {
				return fmt.Errorf("controller peer %q: give HOST:PORT", entry)
			}
			o.controllerPeers = append(o.controllerPeers, strings.TrimSpace(entry))
		}
		return nil
	})
	fs.StringVar(&o.iscsiPortal, "iscsi-portal", "", "target: ADDR:PORT to serve the volumes to the nodes over iSCSI from (the kernel's LIO target; empty: no iSCSI)")
	fs.StringVar(&o.iscsiPrefix, "iscsi-iqn-prefix", served.DefaultPrefix, "target: the IQN the volumes' iSCSI targets are named under (<prefix>:<volume>)")
	fs.StringVar(&o.iscsiCHAPDir, "iscsi-chap-dir", "", "target: a directory with one file per node key holding that node's CHAP secret (a mounted Secret)")
	fs.StringVar(&o.tls.Cert, "tls-cert", "", "target and controller: this side's certificate (PEM) for the storage target's API")
	fs.StringVar(&o.tls.Key, "tls-key", "", "target and controller: the key of --tls-cert (PEM)")
	fs.StringVar(&o.tls.CA, "tls-ca", "", "target and controller: the CA (PEM) that signs the other side's certificate")
	fs.StringVar(&o.nfs.ExportRoot, "nfs-export-root", "",
		"controller or NFS target: enables the NFS backend (served by this process); where volume data lives on the server (a prjquota xfs mount point, or a directory where the driver keeps and mounts a pool image)")
	o.nfs.PoolImageSize = 100 << 30
	fs.Var(byteSize{&o.nfs.PoolImageSize}, "nfs-pool-size", "controller or NFS target: size of the sparse pool image made under --nfs-export-root when it is not a prjquota xfs mount (e.g. 100Gi)")
	fs.StringVar(&o.nfs.Storage, "nfs-storage", "auto",
		"controller or NFS target: how NFS volume sizes are limited: quota (xfs project quotas), images (one loop-mounted image per volume), auto (quota where the kernel's xfs supports it)")
	fs.StringVar(&o.nfs.ImageFilesystem, "nfs-image-filesystem", "xfs",
		"controller or NFS target: what the image storage formats new NFS volumes with: xfs (300 MiB minimum, grows without CAP_SYS_RESOURCE) or ext4 (16 MiB minimum, a few hundred KiB written per volume; growing needs CAP_SYS_RESOURCE); existing volumes keep theirs")
	fs.StringVar(&o.nfs.Server, "nfs-server", "", "controller or NFS target: the IP address nodes mount NFS exports from")
	fs.IntVar(&o.nfs.Port, "nfs-port", 2049, "controller or NFS target: the NFS port ganesha serves")
	fs.StringVar(&o.nfs.ListenAddress, "nfs-listen-address", "", "controller or NFS target: the address the driver's own ganesha binds to (default: every address)")
	fs.StringVar(&o.nfs.GaneshaDir, "nfs-ganesha-dir", "/var/lib/modeguard/ganesha",
		"controller or NFS target: runtime directory of the ganesha the driver runs (config, private D-Bus socket, recovery, logs, export files)")
	fs.StringVar(&o.nfs.GaneshaDBus, "nfs-ganesha-dbus", "",
		"controller or NFS target: D-Bus address of a ganesha run by someone else (e.g. unix:path=/run/ganesha/bus.sock); the driver then starts none")
	fs.StringVar(&o.nfs.ExportConfigDir, "nfs-export-config-dir", "",
		"controller or NFS target: where export files go; required with --nfs-ganesha-dbus (that ganesha must include it with %dir), default <nfs-ganesha-dir>/exports")
	fs.DurationVar(&o.nfs.PauseBudget, "nfs-pause-budget", nfs.DefaultPauseBudget,
		"controller or NFS target: the longest the driver's own ganesha is held still (every NFS client's calls waiting) to snapshot or clone a volume attached read-write on the quota storage; "+
			"a copy that takes longer is abandoned (UNAVAILABLE); must stay below the NFSv4 lease (20s)")
	fs.StringVar(&o.fenceFile, "fence-file", "",
		"controller: the file it keeps its network fences in (csi-addons NetworkFence), an absolute path on storage that outlives the controller; its directory is locked like the pools; off when empty: the NetworkFence calls are refused")
	fs.StringVar(&o.metricsAddr, "metrics-address", "",
		"where to serve Prometheus metrics over HTTP at "+metrics.Path+", host:port (e.g. 127.0.0.1:9808 or :9808); off when empty")
	fs.StringVar(&o.kubeletRegistrationDir, "kubelet-registration-dir", "",
		"node: register with the kubelet by serving its plugin registration API in this directory (its plugins_registry, e.g. /var/lib/kubelet/plugins_registry); off by default, for nodes without node-driver-registrar")
	fs.StringVar(&o.kubeletRegistrationPath, "kubelet-registration-path", "",
		"node: the CSI socket's path as the kubelet sees it (default: the --endpoint socket path)")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	// Kubernetes' logging options: -v (0: state changes, refusals and
	// failed calls; 4: every call, secrets stripped), --vmodule, and
	// --logging-format=json for one JSON object per line.
	o.logging = logsapi.NewLoggingConfiguration()
	logsapi.AddGoFlags(o.logging, fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: modeguard [flags]\n       modeguard demo [--help]\n       modeguard inspect [--help]\n\nA CSI driver whose access modes hold. Flags:\n")
		fs.PrintDefaults()
	}
	return fs
}

func parseRoles(s string) ([]driver.Role, error) {
	var roles []driver.Role
	for _, r := range strings.Split(s, ",") {
		switch driver.Role(strings.TrimSpace(r)) {
		case driver.RoleController:
			roles = append(roles, driver.RoleController)
		case driver.RoleNode:
			roles = append(roles, driver.RoleNode)
		default:
			return nil, fmt.Errorf("--roles: %q is not one of controller, node (or target, alone)", r)
		}
	}
	return roles, nil
}

func run(o *options) error {
	if strings.TrimSpace(o.roles) == roleTarget {
		return runTarget(o)
	}
	roles, err := parseRoles(o.roles)
	if err != nil {
		return err
	}
	isController := slices.Contains(roles, driver.RoleController)
	cfg := driver.Config{
		DriverName: o.driverName, Version: version, Roles: roles,
		NodeName: o.nodeID, Zone: o.zone, NodeAddress: o.nodeAddress, StateDir: o.stateDir,
		MaxVolumesPerNode: o.maxVolumes,
		// Tests of a reboot name a file of their own to change the boot id.
		BootIDFile: os.Getenv("MODEGUARD_BOOT_ID_FILE"),
		Nodes:      map[accessmode.Backend]backend.Node{},
		// The controller's backends read their directories only once
		// this process holds the controller lock on them.
		ControllersLater: isController,
		// A controller reaching storage targets acts only while it holds
		// all their leases, which an election among controllers decides.
		Elected: isController && (len(o.targets) > 0 || o.nfsTarget != ""),
	}
	if o.fenceFile != "" {
		if !isController {
			return fmt.Errorf("--fence-file is for the controller role")
		}
		if !filepath.IsAbs(o.fenceFile) || filepath.Clean(o.fenceFile) != o.fenceFile || filepath.Base(o.fenceFile) == controllerlock.FileName {
			return fmt.Errorf("--fence-file %q: give a clean absolute path of a file", o.fenceFile)
		}
		if err := os.MkdirAll(filepath.Dir(o.fenceFile), 0o700); err != nil {
			return fmt.Errorf("--fence-file: %w", err)
		}
		cfg.FenceFile = o.fenceFile
	}
	if o.iscsiInitiatorFile != "" && slices.Contains(roles, driver.RoleNode) {
		if cfg.ISCSIInitiator, err = iscsi.ReadInitiatorName(o.iscsiInitiatorFile); err != nil {
			return err
		}
		if o.iscsiSecretFile == "" {
			return fmt.Errorf("--iscsi-initiator-name-file needs --iscsi-chap-secret-file: the storage targets let a node in only with its CHAP secret")
		}
	}
	if isController && len(o.pools) == 0 && len(o.targets) == 0 && o.nfs.ExportRoot == "" && o.nfsTarget == "" {
		return fmt.Errorf("the controller role needs at least one backend (e.g. --block-pool ZONE=DIR)")
	}
	if o.nfsTarget != "" && o.nfs.ExportRoot != "" {
		return fmt.Errorf("--nfs-target and --nfs-export-root both name where the NFS volumes are served: give one (--nfs-export-root is then the target's)")
	}
	if o.controllerPeerListen != "" {
		if !cfg.Elected && len(o.controllerPeers) == 0 {
			return fmt.Errorf("--controller-peer-listen without --block-target or --nfs-target needs --controller-peers: a standby finds the acting controller in the storage targets' leases, or among the listed peers")
		}
		if o.peerAddress, err = peer.Address(o.controllerPeerListen); err != nil {
			return err
		}
	} else if len(o.controllerPeers) > 0 {
		return fmt.Errorf("--controller-peers needs --controller-peer-listen: every controller that forwards to its peers must also take their forwarded calls")
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if o.metricsAddr != "" {
		cfg.Metrics = metrics.New(version, rolesOf(roles))
		o.nfs.ControlFailed = cfg.Metrics.NFSControlFailed
		o.nfs.Paused = cfg.Metrics.NFSPaused
	}
	if len(o.pools) > 0 {
		// Once, for every role of this process, before any of them looks
		// into a pool: the controller and the node plugin must find the
		// same volumes.
		kept, err := block.KeepPools(ctx, o.pools, o.poolFilesystem)
		if err != nil {
			return err
		}
		defer func() {
			if err := kept.Release(); err != nil {
				klog.ErrorS(err, "Releasing the kept block pools")
			}
		}()
		o.roots = kept.Roots
	}
	if slices.Contains(roles, driver.RoleNode) {
		cfg.Nodes[accessmode.BackendNFS] = nfs.NewNode(nil, nil)
		switch {
		case cfg.ISCSIInitiator != "":
			n, err := block.NewNetworkNode(o.roots, block.ISCSI{
				Initiator: iscsi.Initiator{ReplacementTimeout: o.iscsiReplacement},
				User:      nodeid.Key(o.nodeID), SecretFile: o.iscsiSecretFile,
			})
			if err != nil {
				return fmt.Errorf("block volumes over iSCSI: %w", err)
			}
			cfg.Nodes[accessmode.BackendBlock] = n
		case len(o.pools) > 0:
			n, err := block.NewNode(o.roots)
			if err != nil {
				return fmt.Errorf("block pools: %w", err)
			}
			cfg.Nodes[accessmode.BackendBlock] = n
		}
	}
	d, err := driver.New(cfg)
	if err != nil {
		return err
	}
	if err := d.Reconcile(ctx); err != nil {
		return fmt.Errorf("reconciling lock files: %w", err)
	}
	lis, err := driver.Listen(o.endpoint)
	if err != nil {
		return err
	}
	if d.HasRole(driver.RoleNode) && o.kubeletRegistrationDir != "" {
		path := o.kubeletRegistrationPath
		if path == "" {
			path = strings.TrimPrefix(o.endpoint, "unix://")
		}
		stopRegistration, err := registration.Serve(o.kubeletRegistrationDir, o.driverName, path)
		if err != nil {
			lis.Close()
			return err
		}
		defer stopRegistration()
	}
	srv := d.NewGRPCServer()
	if cfg.Metrics != nil {
		ms, err := cfg.Metrics.Start(o.metricsAddr)
		if err != nil {
			lis.Close()
			return fmt.Errorf("--metrics-address: %w", err)
		}
		klog.InfoS("Serving metrics", "url", ms.URL())
		// Stops with the gRPC server, however that ends.
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := ms.Shutdown(sctx); err != nil {
				klog.ErrorS(err, "Stopping the metrics server")
			}
		}()
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	go func() {
		<-ctx.Done()
		klog.InfoS("Stopping: waiting for calls in flight")
		srv.GracefulStop()
	}()
	klog.InfoS("Serving CSI", "driver", o.driverName, "version", version, "endpoint", o.endpoint,
		"roles", o.roles, "nodeID", d.NodeID(), "pools", o.pools.String())
	if isController {
		// The election, once there is one: where a standby finds the
		// acting controller first.
		var elected atomic.Pointer[election.Elector]
		if o.peerAddress != "" {
			// Before the lock: a standby waiting for it forwards too.
			stopPeers, err := servePeers(ctx, o, d, func() (string, error) {
				if el := elected.Load(); el != nil {
					return el.ActingPeer()
				}
				return "", errors.New("this controller reads no storage target's lease")
			})
			if err != nil {
				srv.Stop()
				return err
			}
			defer stopPeers()
		}
		// Until the backends are set, Probe answers not ready (but for a
		// standby that forwards) and Controller calls UNAVAILABLE (or are
		// forwarded); the deferred
		// stops run before the lock's release, so the next controller
		// finds everything stopped.
		lock, err := lockControllerDirs(ctx, o, d)
		if err != nil {
			srv.Stop()
			return err
		}
		defer lock.Release()
		var el *election.Elector
		hooks := election.Config{
			Active: func() { go startTerm(ctx, d, el) },
			Standby: func(why string) {
				if !d.EndTerm(why) {
					// Its leases are not given back: they run out,
					// and the next controller waits for that.
					klog.ErrorS(nil, "Exiting: calls of the ended term still run, and must not run beside another controller's")
					klog.Flush()
					os.Exit(1)
				}
			},
			Waiting: func(why string) { d.StandBy(why, el.OtherActs()) },
			Retaken: func(target string) { go d.FollowFencesAgain("storage target " + target + " answers again") },
		}
		setup, err := setupControllers(ctx, o, d.WaitingFor, hooks)
		if err != nil {
			srv.Stop()
			return err
		}
		defer setup.stop()
		if setup.fences != nil {
			d.SetFenceStore(setup.fences)
		}
		if err := d.SetControllers(setup.ctrls); err != nil {
			srv.Stop()
			return err
		}
		klog.InfoS("Controller ready", "backends", len(setup.ctrls), "elected", setup.elector != nil)
		if setup.elector != nil {
			el = setup.elector
			elected.Store(el)
			running := make(chan struct{})
			go func() { defer close(running); el.Run(ctx) }()
			// Stopping: the election steps down (ending the term and
			// giving the leases back) before the backends close.
			defer func() { <-running }()
		}
	}
	return <-served
}

// servePeers listens on --controller-peer-listen for the calls standbys
// forward while this controller acts, until ctx ends, and lets it forward
// the calls it receives while it stands by: to the controller the leases
// name (find), else to the --controller-peers.
func servePeers(ctx context.Context, o *options, d *driver.Driver, find func() (string, error)) (stop func(), err error) {
	creds, err := peer.ServerCredentials(o.tls)
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", o.peerAddress)
	if err != nil {
		return nil, fmt.Errorf("--controller-peer-listen: %w", err)
	}
	srv, err := d.NewPeerServer(creds)
	if err != nil {
		lis.Close()
		return nil, err
	}
	go srv.Serve(lis)
	// Stopped with the CSI server, before the backends and the lock go:
	// no forwarded call runs on what this controller let go of.
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	dialer := peer.NewDialer(o.tls, peer.DialerConfig{Find: find, Peers: o.controllerPeers, Self: o.peerAddress})
	d.SetPeers(dialer)
	klog.InfoS("Serving other controllers' forwarded calls", "address", o.peerAddress)
	return func() {
		srv.Stop()
		dialer.Close()
	}, nil
}

// startTerm begins the driver's term once the election made this
// controller the acting one; a term that cannot start gives the leases
// back.
func startTerm(ctx context.Context, d *driver.Driver, el *election.Elector) {
	switch err := d.StartTerm(ctx); {
	case errors.Is(err, driver.ErrTermEndedWhileStarting):
	case err != nil:
		klog.ErrorS(err, "Could not start acting; stepping down")
		el.StepDown(err.Error())
	}
}

// controllerDirs are the directories a controller keeps its state in: every
// block pool, the NFS export root, the directory of the ganesha it runs and
// that of its network fences.
func controllerDirs(o *options) []string {
	var dirs []string
	for _, dir := range controllerPools(o) {
		dirs = append(dirs, dir)
	}
	if o.nfs.ExportRoot != "" {
		dirs = append(dirs, o.nfs.ExportRoot)
		if o.nfs.GaneshaDBus == "" {
			dirs = append(dirs, o.nfs.GaneshaDir)
		}
	}
	if o.fenceFile != "" {
		dirs = append(dirs, filepath.Dir(o.fenceFile))
	}
	return dirs
}

// controllerPools are the block pools the controller acts on itself: a
// zone with a --block-target is its target's, and a --block-pool of that
// zone is there for the node role only (the loop transport on a host that
// sees the target's pool).
func controllerPools(o *options) map[string]string {
	pools := map[string]string{}
	for zone, dir := range o.pools {
		if _, remote := o.targets[zone]; !remote {
			pools[zone] = dir
		}
	}
	return pools
}

// lockControllerDirs takes the controller lock on every directory the
// controller keeps state in, waiting (and saying so) while another
// controller holds one.
func lockControllerDirs(ctx context.Context, o *options, d *driver.Driver) (*controllerlock.Lock, error) {
	lock, err := controllerlock.Acquire(ctx, controllerDirs(o), time.Second, time.Minute, func(b controllerlock.Busy) {
		klog.InfoS("Waiting for another controller to stop: one controller acts on a pool at a time; meanwhile calls are forwarded to it (with --controller-peer-listen) or refused",
			"dir", b.Dir, "holder", b.Holder)
		// Another process acts on the pool: a standby that forwards to it
		// serves every call, and is ready.
		d.StandBy(b.Error(), o.peerAddress != "")
	})
	if err != nil {
		return nil, err
	}
	d.WaitingFor("the controller's backends are being set up")
	return lock, nil
}

// controllerSetup is what the controller role runs on.
type controllerSetup struct {
	ctrls map[accessmode.Backend]backend.Controller
	// elector is the election among controllers, with storage targets;
	// fences then keeps the network fence list on them.
	elector *election.Elector
	fences  netfence.Store
	// stop undoes what the backends started (the NFS server, the
	// targets' connections).
	stop func()
}

// setupControllers opens the controller's backends.
func setupControllers(ctx context.Context, o *options, waiting func(string), hooks election.Config) (*controllerSetup, error) {
	setup := &controllerSetup{ctrls: map[accessmode.Backend]backend.Controller{}, stop: func() {}}
	if o.nfs.ExportRoot != "" {
		c, stopNFS, err := nfs.Setup(ctx, o.nfs)
		if err != nil {
			return nil, err
		}
		setup.ctrls[accessmode.BackendNFS] = c
		setup.stop = stopNFS
	}
	var local backend.Controller
	if pools := controllerPools(o); len(pools) > 0 {
		for zone := range pools {
			if root, ok := o.roots[zone]; ok {
				pools[zone] = root
			}
		}
		c, err := block.NewController(pools)
		if err != nil {
			setup.stop()
			return nil, fmt.Errorf("block pools: %w", err)
		}
		local = c
	}
	if len(o.targets) > 0 || o.nfsTarget != "" {
		t, err := dialTargets(ctx, o, local, waiting, hooks)
		if err != nil {
			setup.stop()
			return nil, err
		}
		local, setup.elector = t.block, t.elector
		if t.nfs != nil {
			setup.ctrls[accessmode.BackendNFS] = t.nfs
		}
		// The fence list lives on the targets, where every controller
		// finds it; a --fence-file of an earlier setup is moved there
		// once.
		setup.fences = remote.FenceStore(t.clients)
		if o.fenceFile != "" {
			setup.fences = netfence.Importing(netfence.FileStore(o.fenceFile), setup.fences)
		}
		stopNFS := setup.stop
		setup.stop = func() { t.close(); stopNFS() }
	}
	if local != nil {
		setup.ctrls[accessmode.BackendBlock] = local
	}
	return setup, nil
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "inspect" {
		if err := runInspect(os.Args[2:]); err != nil && !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "modeguard inspect:", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) > 1 && os.Args[1] == "demo" {
		if err := runDemo(os.Args[2:]); err != nil && !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "modeguard demo:", err)
			os.Exit(1)
		}
		return
	}
	o, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "modeguard:", err)
		os.Exit(2)
	}
	if o.showVersion {
		fmt.Println(version)
		return
	}
	if err := logsapi.ValidateAndApply(o.logging, nil); err != nil {
		fmt.Fprintln(os.Stderr, "modeguard:", err)
		os.Exit(2)
	}
	if err := run(o); err != nil {
		klog.ErrorS(err, "modeguard failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

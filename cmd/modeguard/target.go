package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/backend/block/served"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/backend/zoned"
	"github.com/modeguard/modeguard/pkg/controllerlock"
	"github.com/modeguard/modeguard/pkg/driver"
	"github.com/modeguard/modeguard/pkg/election"
)

// roleTarget is the storage target: it owns its zones' block pools and
// serves them to the controller over the remote API. It is not a CSI
// role: the target serves no CSI calls.
const roleTarget = "target"

// targetFlag is --block-target ZONE=ADDRESS, repeatable: the zones whose
// block pools a storage target serves, and where.
type targetFlag map[string]string

func (f targetFlag) String() string { return zoneValues(f) }

func (f targetFlag) Set(v string) error {
	return setZoneValue(f, v, "HOST:PORT or ZONE=unix:///PATH", "targets", checkTargetAddress)
}

// checkTargetAddress accepts a storage target's address: HOST:PORT, or
// unix:///PATH on the controller's host.
func checkTargetAddress(addr string) error {
	if path, isUnix := strings.CutPrefix(addr, "unix://"); isUnix {
		if !strings.HasPrefix(path, "/") {
			return fmt.Errorf("target socket %q must be an absolute path (unix:///path)", addr)
		}
	} else if _, _, err := net.SplitHostPort(addr); err != nil {
		return fmt.Errorf("target address %q is neither HOST:PORT nor unix:///PATH", addr)
	}
	return nil
}

// runTarget serves its zone's block pools, or the NFS volumes, over the
// remote API until SIGTERM: on a unix socket only root may open, or on TCP
// with mutual TLS.
func runTarget(o *options) error {
	servesNFS := o.nfs.ExportRoot != ""
	switch {
	case len(o.pools) == 0 && !servesNFS:
		return fmt.Errorf("the target role serves its zone's block pool (--block-pool ZONE=DIR) or the NFS volumes (--nfs-export-root DIR --nfs-server IP)")
	case len(o.pools) > 0 && servesNFS:
		return fmt.Errorf("a target serves block pools or the NFS volumes, not both: run the NFS target as a process of its own, with its own --target-endpoint")
	case servesNFS && o.iscsiPortal != "":
		return fmt.Errorf("--iscsi-portal serves block volumes: an NFS target (--nfs-export-root) has none")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var dirs []string
	for _, dir := range o.pools {
		dirs = append(dirs, dir)
	}
	if servesNFS {
		dirs = append(dirs, o.nfs.ExportRoot)
		if o.nfs.GaneshaDBus == "" {
			dirs = append(dirs, o.nfs.GaneshaDir)
		}
	}
	stateDir := targetStateDir(o)
	if !slices.Contains(dirs, stateDir) {
		if err := os.MkdirAll(stateDir, 0o700); err != nil {
			return fmt.Errorf("--target-state-dir: %w", err)
		}
		dirs = append(dirs, stateDir)
	}
	// One process acts on a pool at a time, whichever role it has.
	lock, err := controllerlock.Acquire(ctx, dirs, time.Second, time.Minute, func(b controllerlock.Busy) {
		klog.InfoS("Waiting for another process to let go of the pool", "dir", b.Dir, "holder", b.Holder)
	})
	if err != nil {
		return err
	}
	defer lock.Release()
	var ctrl backend.Controller
	if servesNFS {
		// ganesha, its recovery records and the volumes' data stay with
		// the target: a controller may die and start elsewhere.
		c, stopNFS, err := nfs.Setup(ctx, o.nfs)
		if err != nil {
			return err
		}
		defer stopNFS()
		ctrl = c
	} else {
		c, release, err := targetBlockPools(ctx, o)
		if err != nil {
			return err
		}
		defer release()
		ctrl = c
	}
	lis, tlsConfig, err := listenTarget(o)
	if err != nil {
		return err
	}
	// ReadHeaderTimeout also bounds a connection's TLS handshake: as long
	// as the controller's longest try (dialTimeout), for a busy node.
	handler, err := remote.NewHandler(ctrl, remote.ServerConfig{StateDir: stateDir})
	if err != nil {
		lis.Close()
		return err
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 60 * time.Second, TLSConfig: tlsConfig}
	serving := make(chan error, 1)
	go func() {
		if tlsConfig == nil {
			serving <- srv.Serve(lis)
			return
		}
		serving <- srv.ServeTLS(lis, "", "")
	}()
	klog.InfoS("Serving the storage target", "endpoint", o.targetEndpoint, "backend", ctrl.Backend(), "pools", o.pools.String(), "nfsExportRoot", o.nfs.ExportRoot)
	select {
	case err := <-serving:
		return err
	case <-ctx.Done():
	}
	klog.InfoS("Stopping: waiting for calls in flight")
	sctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return err
	}
	if err := <-serving; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// targetBlockPools opens the target's block pools, served over iSCSI
// with --iscsi-portal; release lets go of them.
func targetBlockPools(ctx context.Context, o *options) (backend.Controller, func(), error) {
	kept, err := block.KeepPools(ctx, o.pools, o.poolFilesystem)
	if err != nil {
		return nil, nil, err
	}
	release := func() {
		if err := kept.Release(); err != nil {
			klog.ErrorS(err, "Releasing the kept block pools")
		}
	}
	pools, err := block.NewController(kept.Roots)
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("block pools: %w", err)
	}
	if o.iscsiPortal == "" {
		return pools, release, nil
	}
	portal, err := netip.ParseAddrPort(o.iscsiPortal)
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("--iscsi-portal: %w", err)
	}
	ctrl, err := served.New(ctx, pools, served.Config{
		LIO: lio.Config{Prefix: o.iscsiPrefix, Portal: portal}, CHAPDir: o.iscsiCHAPDir,
	})
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("serving the volumes over iSCSI: %w", err)
	}
	return ctrl, release, nil
}

// targetStateDir is where the target records its lease and the fence
// list: --target-state-dir, or the directory of its first pool in zone
// order, or its NFS export root, which is on the target's disk and locked
// by it already.
func targetStateDir(o *options) string {
	if o.targetStateDir != "" {
		return o.targetStateDir
	}
	if len(o.pools) == 0 {
		return o.nfs.ExportRoot
	}
	return o.pools[slices.Sorted(maps.Keys(o.pools))[0]]
}

// listenTarget opens --target-endpoint: a unix socket made 0600 (the
// controller on the same host runs as root), or TCP that only mutual TLS
// gets through.
func listenTarget(o *options) (net.Listener, *tls.Config, error) {
	var cfg *tls.Config
	if !strings.HasPrefix(o.targetEndpoint, "unix://") {
		var err error
		if cfg, err = o.tls.ServerConfig(); err != nil {
			return nil, nil, fmt.Errorf("the target on %s needs mutual TLS (--tls-cert, --tls-key, --tls-ca): %w", o.targetEndpoint, err)
		}
	}
	// Root only: bound under umask 077, then never opened wider.
	lis, err := driver.ListenMode(o.targetEndpoint, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("--target-endpoint: %w", err)
	}
	return lis, cfg, nil
}

// leaseHolder names this controller on the targets' leases: host, pid and
// a random part, so that a restarted container (pid 1 again, same host
// name) is not taken for the controller it replaces.
var leaseHolder = func() string {
	host, _ := os.Hostname()
	var r [4]byte
	rand.Read(r[:])
	return fmt.Sprintf("%s pid %d #%x", host, os.Getpid(), r)
}()

// dialTimeout bounds the attempt-th try (from 0) to reach a storage target:
// 10 s at first, doubled with each failure up to 60 s. A fixed bound fails
// forever where a busy machine needs longer than it for a TCP connection and
// a TLS handshake (seen on nodes under software emulation, each try starting
// the handshake over), while a target that is simply not up yet is still
// retried every few seconds at first.
func dialTimeout(attempt int) time.Duration {
	const first, most = 10 * time.Second, 60 * time.Second
	if attempt >= 3 {
		return most
	}
	return first << attempt
}

// targetSet is the controller's storage targets.
type targetSet struct {
	// block joins the block targets with the controller's own block
	// pools; nil when it has neither.
	block backend.Controller
	// nfs is the NFS target's client; nil without --nfs-target.
	nfs     backend.Controller
	clients []*remote.Client
	elector *election.Elector
	close   func()
}

// dialTargets connects to every --block-target and to the --nfs-target,
// and joins the block targets, with the block pools of this process, into
// the block backend. A target that cannot be reached yet is waited for
// (saying so): the controller serves no backend until every target is
// there, rather than answering for a zone it cannot see. The targets'
// clients act for the election it answers, which the caller runs once the
// driver has its backends.
func dialTargets(ctx context.Context, o *options, local backend.Controller, waiting func(string), hooks election.Config) (*targetSet, error) {
	var parts []backend.Controller
	if local != nil {
		parts = append(parts, local)
	}
	var clients []*remote.Client
	closeAll := func() {
		for _, c := range clients {
			c.Close()
		}
	}
	for _, zone := range slices.Sorted(maps.Keys(o.targets)) {
		addr := o.targets[zone]
		c, err := dialTarget(ctx, o, "zone "+zone, addr, waiting)
		if err != nil {
			closeAll()
			return nil, err
		}
		clients = append(clients, c)
		if got := c.Zones(); c.Backend() != accessmode.BackendBlock || len(got) != 1 || got[0] != zone {
			closeAll()
			return nil, fmt.Errorf("--block-target %s=%s: that target serves the %s backend in zones %v, not block volumes in %s", zone, addr, c.Backend(), got, zone)
		}
		parts = append(parts, c)
	}
	set := &targetSet{close: closeAll}
	if o.nfsTarget != "" {
		// After the zones: every controller takes the leases in one order.
		c, err := dialTarget(ctx, o, "NFS", o.nfsTarget, waiting)
		if err != nil {
			closeAll()
			return nil, err
		}
		clients = append(clients, c)
		if c.Backend() != accessmode.BackendNFS || len(c.Zones()) != 0 {
			closeAll()
			return nil, fmt.Errorf("--nfs-target %s: that target serves the %s backend in zones %v, not the NFS volumes", o.nfsTarget, c.Backend(), c.Zones())
		}
		set.nfs = c
	}
	// One controller acts at a time, as the pools' lock files make it
	// for pools of the controller's own: the one holding every target's
	// lease, taken in that order.
	targets := make([]election.Target, len(clients))
	for i, c := range clients {
		targets[i] = c
	}
	cfg := hooks
	cfg.Holder, cfg.Targets = leaseHolder, targets
	cfg.Waiting = func(why string) {
		klog.InfoS("Waiting for another controller to let go of a storage target", "why", why)
		if hooks.Waiting != nil {
			hooks.Waiting(why)
		}
	}
	el, err := election.New(cfg)
	if err != nil {
		closeAll()
		return nil, err
	}
	for _, c := range clients {
		c.Elected(leaseHolder, o.peerAddress, el.Epoch)
	}
	set.clients, set.elector = clients, el
	switch len(parts) {
	case 0:
	case 1:
		set.block = parts[0]
	default:
		if set.block, err = zoned.New(parts...); err != nil {
			closeAll()
			return nil, err
		}
	}
	return set, nil
}

// dialTarget connects to the storage target of what at addr, waiting
// (and saying so) while it cannot be reached.
func dialTarget(ctx context.Context, o *options, what, addr string, waiting func(string)) (*remote.Client, error) {
	for attempt := 0; ; attempt++ {
		try, cancel := context.WithTimeout(ctx, dialTimeout(attempt))
		c, err := remote.Dial(try, remote.Target{Address: addr, TLS: o.tls})
		cancel()
		if err == nil {
			return c, nil
		}
		klog.InfoS("Waiting for a storage target", "of", what, "address", addr, "err", err)
		waiting(fmt.Sprintf("the storage target of %s at %s: %v", what, addr, err))
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

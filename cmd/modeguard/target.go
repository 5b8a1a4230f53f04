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
	"sort"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/backend/block/served"
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
	return setZoneValue(f, v, "HOST:PORT or ZONE=unix:///PATH", "targets", func(addr string) error {
		if path, isUnix := strings.CutPrefix(addr, "unix://"); isUnix {
			if !strings.HasPrefix(path, "/") {
				return fmt.Errorf("target socket %q must be an absolute path (unix:///path)", addr)
			}
		} else if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("target address %q is neither HOST:PORT nor unix:///PATH", addr)
		}
		return nil
	})
}

// runTarget serves the block pools over the remote API until SIGTERM:
// on a unix socket only root may open, or on TCP with mutual TLS.
func runTarget(o *options) error {
	if len(o.pools) == 0 {
		return fmt.Errorf("the target role needs its zone's pool: --block-pool ZONE=DIR")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var dirs []string
	for _, dir := range o.pools {
		dirs = append(dirs, dir)
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
	kept, err := block.KeepPools(ctx, o.pools, o.poolFilesystem)
	if err != nil {
		return err
	}
	defer func() {
		if err := kept.Release(); err != nil {
			klog.ErrorS(err, "Releasing the kept block pools")
		}
	}()
	pools, err := block.NewController(kept.Roots)
	if err != nil {
		return fmt.Errorf("block pools: %w", err)
	}
	var ctrl backend.Controller = pools
	if o.iscsiPortal != "" {
		portal, err := netip.ParseAddrPort(o.iscsiPortal)
		if err != nil {
			return fmt.Errorf("--iscsi-portal: %w", err)
		}
		if ctrl, err = served.New(ctx, pools, served.Config{
			LIO: lio.Config{Prefix: o.iscsiPrefix, Portal: portal}, CHAPDir: o.iscsiCHAPDir,
		}); err != nil {
			return fmt.Errorf("serving the volumes over iSCSI: %w", err)
		}
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
	klog.InfoS("Serving the storage target", "endpoint", o.targetEndpoint, "pools", o.pools.String())
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

// targetStateDir is where the target records its lease: --target-state-dir,
// or the directory of its first pool in zone order, which is on the
// target's disk and locked by it already.
func targetStateDir(o *options) string {
	if o.targetStateDir != "" {
		return o.targetStateDir
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
	// backend joins them with the controller's own block pools.
	backend backend.Controller
	clients []*remote.Client
	elector *election.Elector
	close   func()
}

// dialTargets connects to every --block-target and joins them, with the
// block pools of this process, into the block backend. A target that
// cannot be reached yet is waited for (saying so): the controller serves
// no block zone until every one is there, rather than answering for a
// zone it cannot see. The targets' clients act for the election it
// answers, which the caller runs once the driver has its backends.
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
	zones := make([]string, 0, len(o.targets))
	for z := range o.targets {
		zones = append(zones, z)
	}
	sort.Strings(zones)
	for _, zone := range zones {
		addr := o.targets[zone]
		for attempt := 0; ; attempt++ {
			try, cancel := context.WithTimeout(ctx, dialTimeout(attempt))
			c, err := remote.Dial(try, remote.Target{Address: addr, TLS: o.tls})
			cancel()
			if err == nil {
				if got := c.Zones(); len(got) != 1 || got[0] != zone {
					c.Close()
					closeAll()
					return nil, fmt.Errorf("--block-target %s=%s: that target serves zones %v, not %s", zone, addr, got, zone)
				}
				clients = append(clients, c)
				parts = append(parts, c)
				break
			}
			why := fmt.Sprintf("the storage target of zone %s at %s: %v", zone, addr, err)
			klog.InfoS("Waiting for a storage target", "zone", zone, "address", addr, "err", err)
			waiting(why)
			select {
			case <-ctx.Done():
				closeAll()
				return nil, ctx.Err()
			case <-time.After(2 * time.Second):
			}
		}
	}
	// One controller acts at a time, as the pools' lock files make it
	// for pools of the controller's own: the one holding every target's
	// lease, taken in zone order.
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
	set := &targetSet{backend: parts[0], clients: clients, elector: el, close: closeAll}
	if len(parts) > 1 {
		if set.backend, err = zoned.New(parts...); err != nil {
			closeAll()
			return nil, err
		}
	}
	return set, nil
}

package ganesha

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// ServerConfig says how to run ganesha.
type ServerConfig struct {
	// Dir is the runtime directory (created 0700): ganesha.conf, bus.conf,
	// bus.sock, recovery/, logs and pid files.
	Dir string
	// ExportDir holds the export files and nothing else; ganesha.conf
	// includes it with %dir, so a (re)start serves every export in it.
	// Created 0700 when missing. Defaults to Dir/exports.
	ExportDir string
	// Port is the NFS port, 2049 when zero.
	Port int
	// ListenAddress, when set, is the only address ganesha listens on
	// (Bind_addr).
	ListenAddress string
	// GaneshaBinary and DBusBinary default to ganesha.nfsd and dbus-daemon,
	// looked up in PATH.
	GaneshaBinary, DBusBinary string
	// NetNSPath, when set (e.g. /run/netns/x), runs both processes in that
	// network namespace: they are started as
	// "nsenter --net=NetNSPath -- BINARY ...", which enters the namespace
	// and executes BINARY in place, so the PID is the daemon's own. Only the
	// network namespace changes; the mount namespace stays the caller's.
	NetNSPath string
	// NsenterBinary defaults to nsenter, looked up in PATH.
	NsenterBinary string
	// LogLevel is ganesha's -N, NIV_EVENT when empty.
	LogLevel string
	// ReadyTimeout bounds each start until ganesha answers on D-Bus (180 s
	// when zero: ganesha answers in a fraction of a second on an idle
	// machine, but took 81 s in a VM under emulation on a busy one, and a
	// controller that gives up then starts over, no faster: with 60 s the
	// VM cluster's controller restarted again and again and never served;
	// a ganesha that exits is reported at once, whatever the bound);
	// StopTimeout bounds how long Stop waits after SIGTERM
	// before SIGKILL (15 s when zero; ganesha takes a few seconds).
	ReadyTimeout, StopTimeout time.Duration
	// LeaseLifetime and GracePeriod are NFSv4's lease and grace period
	// (ganesha's Lease_Lifetime and Grace_Period), whole seconds;
	// DefaultLeaseLifetime and DefaultGracePeriod when zero. GracePeriod
	// may not be shorter than LeaseLifetime: a client learns of a restart
	// only when it next renews its lease.
	LeaseLifetime, GracePeriod time.Duration
	// Logf receives the supervisor's messages; klog.Infof when nil.
	Logf func(format string, args ...any)
}

// File names in ServerConfig.Dir.
const (
	GaneshaConfName = "ganesha.conf"
	BusConfName     = "bus.conf"
	BusSocketName   = "bus.sock"
	GaneshaLogName  = "ganesha.log"
	GaneshaOutName  = "ganesha.out" // ganesha's stdout and stderr
	GaneshaPIDName  = "ganesha.pid"
	BusOutName      = "dbus.out"
	BusPIDName      = "dbus.pid"
	RecoveryDirName = "recovery"
)

// What ganesha 4.3 does across a restart, as observed with its fs recovery
// backend (Debian's nfs-ganesha 4.3; see the tests of this package and the
// lock test in test/vm/nfs):
//
//   - It keeps one directory per client in RecoveryRoot/v4recov/node0, named
//     "<client address>-(<length>:<client owner>)", made when the client's id
//     is confirmed (SETCLIENTID_CONFIRM, CREATE_SESSION) and removed when
//     its lease expires or it destroys its id. The path does not depend on
//     the host name, so a controller in a new container (another host name)
//     on the same --nfs-ganesha-dir finds it. SIGKILL and SIGTERM both leave
//     it in place: a shutdown does not expire clients.
//   - At start it reads v4old/node0 (deleting what it read) and moves the
//     v4recov entries there, enters grace and counts them all ("check
//     grace:reclaim complete(0) clid count(N)" in its log); v4old is emptied
//     when grace ends. So a client that has not reclaimed yet is still known
//     after a second restart during grace, but not after a third: a client
//     that comes back is recorded in v4recov again, one that does not is
//     forgotten by a crash loop faster than it reconnects.
//   - With no entries it lifts grace during the start, before it registers
//     on D-Bus ("NFS Server Now NOT IN GRACE"): a ganesha that answers on the
//     bus after a start without known clients is out of grace.
//   - With entries, it lifts grace as soon as every client it knew sent
//     RECLAIM_COMPLETE (NFSv4.1 and later; only with Enable_NLM = false), as
//     checked by its reaper thread every 10 s (Lease_Lifetime/2 when the lease
//     is shorter than 20 s), and otherwise after Grace_Period. An NFSv4.0
//     client (libnfs) never sends RECLAIM_COMPLETE, so one that is known
//     keeps the full grace period.
//   - During grace OPEN and LOCK that reclaim nothing fail with
//     NFS4ERR_GRACE: the kernel client waits and retries them, libnfs gives
//     up. Reclaimed opens and locks are the client's again, and no other
//     client can take a lock meanwhile.
const (
	// DefaultLeaseLifetime: a client silent for longer loses its opens and
	// locks. Linux renews at two thirds of the lease, so every live client
	// talks to a restarted server within about 13 s and reclaims at once;
	// 20 s still rides out a short network interruption.
	DefaultLeaseLifetime = 20 * time.Second
	// DefaultGracePeriod is how long a restarted ganesha waits for clients
	// it knew that do not come back: a lease and 10 s more to reconnect.
	// When every known client reclaimed, grace ends early (within the
	// reaper's 10 s); with no known client there is none at all.
	DefaultGracePeriod = 30 * time.Second
	maxGracePeriod     = 180 * time.Second
)

const (
	minBackoff  = 200 * time.Millisecond
	maxBackoff  = 10 * time.Second
	stableAfter = 30 * time.Second
)

// proc is one child process and its end.
type proc struct {
	cmd     *exec.Cmd
	pid     int
	started time.Time
	done    chan struct{} // closed once Wait returned
	err     error         // Wait's result, valid after done
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Server runs and supervises a private dbus-daemon and ganesha.nfsd.
type Server struct {
	cfg     ServerConfig
	control *Control
	logf    func(string, ...any)

	mu       sync.Mutex
	ganesha  *proc
	bus      *proc
	restarts int

	// pauseSem is held from Pause until its resume: one pause at a time.
	pauseSem chan struct{}

	stopCh   chan struct{}
	supDone  chan struct{}
	stopOnce sync.Once
	stopErr  error
}

// StartServer starts the bus, then ganesha, and returns once ganesha
// answers on D-Bus. If ganesha exits or is not ready within
// cfg.ReadyTimeout, everything started is stopped and the error carries the
// tail of ganesha's log. Processes left behind by an earlier Server on the
// same Dir (found through its pid files) are stopped first.
func StartServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	for _, d := range []string{cfg.Dir, filepath.Join(cfg.Dir, RecoveryDirName), cfg.ExportDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("ganesha: %w", err)
		}
	}
	if err := os.Chmod(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("ganesha: %w", err)
	}
	s := &Server{cfg: cfg, stopCh: make(chan struct{}), supDone: make(chan struct{}), pauseSem: make(chan struct{}, 1)}
	s.logf = cfg.Logf
	if s.logf == nil {
		s.logf = klog.Infof
	}
	s.stopStale()
	if err := os.WriteFile(s.path(GaneshaConfName), cfg.ganeshaConf(), 0o600); err != nil {
		return nil, fmt.Errorf("ganesha: %w", err)
	}
	if err := os.WriteFile(s.path(BusConfName), cfg.busConf(), 0o600); err != nil {
		return nil, fmt.Errorf("ganesha: %w", err)
	}

	bus, err := s.startBus(ctx)
	if err != nil {
		return nil, err
	}
	s.bus = bus
	control, err := Dial(s.DBusAddress())
	if err != nil {
		s.terminate(bus)
		return nil, err
	}
	s.control = control
	g, err := s.startGanesha(ctx)
	if err != nil {
		control.Close()
		s.terminate(bus)
		return nil, err
	}
	s.ganesha = g
	go s.supervise()
	return s, nil
}

func (cfg ServerConfig) withDefaults() (ServerConfig, error) {
	if cfg.Dir == "" {
		return cfg, errors.New("ganesha: ServerConfig.Dir is required")
	}
	var err error
	if cfg.Dir, err = filepath.Abs(cfg.Dir); err != nil {
		return cfg, err
	}
	if cfg.ExportDir == "" {
		cfg.ExportDir = filepath.Join(cfg.Dir, "exports")
	}
	if cfg.ExportDir, err = filepath.Abs(cfg.ExportDir); err != nil {
		return cfg, err
	}
	// Both paths end up inside ganesha.conf or bus.conf.
	if err := checkPath("runtime directory", cfg.Dir); err != nil {
		return cfg, fmt.Errorf("ganesha: %w", err)
	}
	if err := checkPath("export directory", cfg.ExportDir); err != nil {
		return cfg, fmt.Errorf("ganesha: %w", err)
	}
	if len(filepath.Join(cfg.Dir, BusSocketName)) > 100 {
		return cfg, fmt.Errorf("ganesha: runtime directory %q is too long for a unix socket path", cfg.Dir)
	}
	if cfg.Port == 0 {
		cfg.Port = 2049
	}
	if cfg.Port < 1 || cfg.Port > 65535 {
		return cfg, fmt.Errorf("ganesha: port %d out of range", cfg.Port)
	}
	if cfg.ListenAddress != "" {
		a, err := netip.ParseAddr(cfg.ListenAddress)
		if err != nil || a.Zone() != "" {
			return cfg, fmt.Errorf("ganesha: listen address %q is not an IP address without zone", cfg.ListenAddress)
		}
		cfg.ListenAddress = a.String()
	}
	if cfg.LogLevel == "" {
		cfg.LogLevel = "NIV_EVENT"
	}
	if !regexpLogLevel(cfg.LogLevel) {
		return cfg, fmt.Errorf("ganesha: log level %q", cfg.LogLevel)
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 180 * time.Second
	}
	if cfg.StopTimeout <= 0 {
		cfg.StopTimeout = 15 * time.Second
	}
	if cfg.LeaseLifetime == 0 {
		cfg.LeaseLifetime = DefaultLeaseLifetime
	}
	if cfg.GracePeriod == 0 {
		cfg.GracePeriod = DefaultGracePeriod
	}
	if cfg.LeaseLifetime < time.Second || cfg.LeaseLifetime%time.Second != 0 ||
		cfg.GracePeriod%time.Second != 0 || cfg.GracePeriod < cfg.LeaseLifetime || cfg.GracePeriod > maxGracePeriod {
		return cfg, fmt.Errorf("ganesha: lease %v and grace period %v: want whole seconds, 1 s <= lease <= grace <= %v",
			cfg.LeaseLifetime, cfg.GracePeriod, maxGracePeriod)
	}
	if cfg.GaneshaBinary == "" {
		cfg.GaneshaBinary = "ganesha.nfsd"
	}
	if cfg.DBusBinary == "" {
		cfg.DBusBinary = "dbus-daemon"
	}
	if cfg.NsenterBinary == "" {
		cfg.NsenterBinary = "nsenter"
	}
	bins := []*string{&cfg.GaneshaBinary, &cfg.DBusBinary}
	if cfg.NetNSPath != "" {
		bins = append(bins, &cfg.NsenterBinary)
		if _, err := os.Stat(cfg.NetNSPath); err != nil {
			return cfg, fmt.Errorf("ganesha: network namespace: %w", err)
		}
	}
	for _, b := range bins {
		p, err := exec.LookPath(*b)
		if err != nil {
			return cfg, fmt.Errorf("ganesha: %w", err)
		}
		*b = p
	}
	return cfg, nil
}

func regexpLogLevel(s string) bool {
	if !strings.HasPrefix(s, "NIV_") || len(s) > 32 {
		return false
	}
	for _, r := range s[4:] {
		if r < 'A' || r > 'Z' {
			return false
		}
	}
	return true
}

// ganeshaConf renders the main configuration. Dir and ExportDir were
// checked with checkPath, so they cannot break out of their quotes.
func (cfg ServerConfig) ganeshaConf() []byte {
	var b bytes.Buffer
	b.WriteString("# Written by modeguard on every start; do not edit.\n")
	b.WriteString("NFS_CORE_PARAM {\n")
	b.WriteString("\tProtocols = 4;\n")
	b.WriteString("\tNFS_Port = " + strconv.Itoa(cfg.Port) + ";\n")
	if cfg.ListenAddress != "" {
		b.WriteString("\tBind_addr = " + cfg.ListenAddress + ";\n")
	}
	// NFSv4 only; without NLM, grace can also end as soon as every known
	// client reclaimed.
	b.WriteString("\tEnable_NLM = false;\n")
	b.WriteString("\tEnable_RQUOTA = false;\n")
	b.WriteString("\tMount_Path_Pseudo = true;\n")
	b.WriteString("}\n")
	// A grace period after every start with known clients, so that they
	// reclaim their opens and locks before anyone else may take them; the
	// recovery database is on disk in Dir (see DefaultGracePeriod).
	b.WriteString("NFSV4 {\n")
	b.WriteString("\tGraceless = false;\n")
	b.WriteString("\tLease_Lifetime = " + strconv.Itoa(int(cfg.LeaseLifetime/time.Second)) + ";\n")
	b.WriteString("\tGrace_Period = " + strconv.Itoa(int(cfg.GracePeriod/time.Second)) + ";\n")
	b.WriteString("\tRecoveryBackend = fs;\n")
	b.WriteString("\tRecoveryRoot = \"" + filepath.Join(cfg.Dir, RecoveryDirName) + "\";\n")
	b.WriteString("\tOnly_Numeric_Owners = true;\n")
	b.WriteString("}\n")
	b.WriteString("NFS_KRB5 {\n\tActive_krb5 = false;\n}\n")
	b.WriteString("%dir \"" + cfg.ExportDir + "\"\n")
	return b.Bytes()
}

// busConf is a system-type bus that only root may join, on which only root
// may own org.ganesha.nfsd and call it.
func (cfg ServerConfig) busConf() []byte {
	return []byte(`<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- Written by modeguard on every start; do not edit. -->
<busconfig>
  <type>system</type>
  <listen>unix:path=` + filepath.Join(cfg.Dir, BusSocketName) + `</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="root"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
  </policy>
  <policy user="root">
    <allow own="` + BusName + `"/>
    <allow send_destination="` + BusName + `"/>
  </policy>
</busconfig>
`)
}

func (s *Server) path(name string) string { return filepath.Join(s.cfg.Dir, name) }

// DBusAddress is the address of the private bus.
func (s *Server) DBusAddress() string { return "unix:path=" + s.path(BusSocketName) }

// Control is a Control on the private bus; it stays usable across restarts
// of ganesha and of the bus until Stop.
func (s *Server) Control() *Control { return s.control }

// Restarts counts how often the supervisor started ganesha again.
func (s *Server) Restarts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.restarts
}

// GaneshaPID is the PID of the current ganesha process (0 when none).
func (s *Server) GaneshaPID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ganesha == nil {
		return 0
	}
	return s.ganesha.pid
}

// BusPID is the PID of the current dbus-daemon (0 when none).
func (s *Server) BusPID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bus == nil {
		return 0
	}
	return s.bus.pid
}

// Config is the configuration in effect, defaults filled in.
func (s *Server) Config() ServerConfig { return s.cfg }

// KillGanesha sends SIGKILL to ganesha only, for tests of crash recovery.
func (s *Server) KillGanesha() error {
	s.mu.Lock()
	g := s.ganesha
	s.mu.Unlock()
	if g == nil || g.exited() {
		return errors.New("ganesha: not running")
	}
	return g.cmd.Process.Signal(syscall.SIGKILL)
}

// WaitReady waits until ganesha answers on D-Bus (after a start or a
// restart) or ctx ends.
func (s *Server) WaitReady(ctx context.Context) error {
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := s.control.Ping(pctx)
		cancel()
		if err == nil {
			return nil
		}
		if errors.Is(err, ErrClosed) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("ganesha: not ready: %w (last error: %v)", ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// WaitGraceEnded waits until ganesha is out of its grace period (see
// Control.WaitGraceEnded) or ctx ends.
func (s *Server) WaitGraceEnded(ctx context.Context) error {
	return s.control.WaitGraceEnded(ctx)
}

// command builds the command for binary args, inside the network namespace
// when one is configured, in a process group of its own, and killed when
// the thread that starts it exits (see spawner: the thread lives as long as
// this process). nsenter with --net only enters the namespace and executes
// binary in place; the parent-death signal survives that execve (neither
// binary is set-user-ID or has file capabilities), and ganesha changes
// credentials only on its worker threads, not on the main thread that
// carries the signal.
//
// SIGKILL rather than SIGTERM: everything ganesha must keep (export files,
// the recovery database) is on disk before it is needed, so nothing is lost,
// and a daemon whose supervisor is gone must not linger over a shutdown.
func (s *Server) command(binary string, args ...string) *exec.Cmd {
	var cmd *exec.Cmd
	if s.cfg.NetNSPath != "" {
		full := append([]string{"--net=" + s.cfg.NetNSPath, "--", binary}, args...)
		cmd = exec.Command(s.cfg.NsenterBinary, full...)
	} else {
		cmd = exec.Command(binary, args...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Dir = s.cfg.Dir
	return cmd
}

// spawn starts cmd with stdout and stderr appended to outName.
func (s *Server) spawn(cmd *exec.Cmd, outName string) (*proc, error) {
	out, err := os.OpenFile(s.path(outName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("ganesha: %w", err)
	}
	defer out.Close() // the child has its own copy
	cmd.Stdout, cmd.Stderr = out, out
	if err := startOnSpawnerThread(cmd); err != nil {
		return nil, fmt.Errorf("ganesha: starting %s: %w", cmd.Path, err)
	}
	p := &proc{cmd: cmd, pid: cmd.Process.Pid, started: time.Now(), done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// startBus starts dbus-daemon and waits until its socket accepts a client.
func (s *Server) startBus(ctx context.Context) (*proc, error) {
	sock := s.path(BusSocketName)
	if err := os.Remove(sock); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("ganesha: %w", err)
	}
	cmd := s.command(s.cfg.DBusBinary, "--config-file="+s.path(BusConfName), "--nofork", "--nopidfile", "--nosyslog")
	p, err := s.spawn(cmd, BusOutName)
	if err != nil {
		return nil, err
	}
	_ = os.WriteFile(s.path(BusPIDName), []byte(strconv.Itoa(p.pid)+"\n"), 0o600)
	deadline := time.NewTimer(s.cfg.ReadyTimeout)
	defer deadline.Stop()
	var lastErr error
	for {
		if _, err := os.Stat(sock); err == nil {
			conn, err := dial(s.DBusAddress())
			if err == nil {
				conn.Close()
				return p, nil
			}
			lastErr = err
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("ganesha: dbus-daemon exited (%v) before it was ready:\n%s", p.err, tail(s.path(BusOutName), 20))
		case <-ctx.Done():
			s.terminate(p)
			return nil, fmt.Errorf("ganesha: waiting for dbus-daemon: %w", ctx.Err())
		case <-deadline.C:
			s.terminate(p)
			return nil, fmt.Errorf("ganesha: dbus-daemon not ready after %v (%v):\n%s", s.cfg.ReadyTimeout, lastErr, tail(s.path(BusOutName), 20))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// startGanesha removes temporary export files, starts ganesha and waits
// until it answers on D-Bus. It also gives up when s is stopped.
func (s *Server) startGanesha(ctx context.Context) (*proc, error) {
	s.removeTempExportFiles()
	cmd := s.command(s.cfg.GaneshaBinary,
		"-F",
		"-f", s.path(GaneshaConfName),
		"-L", s.path(GaneshaLogName),
		"-p", s.path(GaneshaPIDName),
		"-N", s.cfg.LogLevel,
	)
	// BLKID_FILE=/dev/null: ganesha tells filesystems apart by the UUID
	// libblkid reports for their device, and libblkid's cache file
	// (/run/blkid/blkid.tab) is shared by every process on the machine,
	// with entries up to 200 seconds old believed without probing. Without
	// a cache file each ganesha starts from what the devices hold now.
	// Within its life ganesha keeps libblkid's cache in memory; that a
	// loop device bound to another image is probed again is
	// loop.markChanged's doing.
	cmd.Env = append(os.Environ(), "DBUS_SYSTEM_BUS_ADDRESS="+s.DBusAddress(), "BLKID_FILE=/dev/null")
	p, err := s.spawn(cmd, GaneshaOutName)
	if err != nil {
		return nil, err
	}
	deadline := time.NewTimer(s.cfg.ReadyTimeout)
	defer deadline.Stop()
	var lastErr error
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		lastErr = s.control.Ping(pctx)
		cancel()
		if lastErr == nil && !p.exited() {
			return p, nil
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("ganesha: ganesha.nfsd exited (%v) before it was ready; log:\n%s", p.err, s.ganeshaTail())
		case <-ctx.Done():
			s.terminate(p)
			return nil, fmt.Errorf("ganesha: waiting for ganesha.nfsd: %w", ctx.Err())
		case <-s.stopCh:
			s.terminate(p)
			return nil, errors.New("ganesha: stopped while starting")
		case <-deadline.C:
			s.terminate(p)
			return nil, fmt.Errorf("ganesha: ganesha.nfsd not ready after %v (%v); log:\n%s", s.cfg.ReadyTimeout, lastErr, s.ganeshaTail())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (s *Server) ganeshaTail() string {
	return tail(s.path(GaneshaLogName), 30) + tail(s.path(GaneshaOutName), 10)
}

// removeTempExportFiles deletes what an interrupted WriteExportFile left
// in the export directory: ganesha's %dir would read it.
func (s *Server) removeTempExportFiles() {
	entries, err := os.ReadDir(s.cfg.ExportDir)
	if err != nil {
		s.logf("ganesha: reading export directory: %v", err)
		return
	}
	for _, e := range entries {
		n := e.Name()
		if strings.HasPrefix(n, ".") && strings.Contains(n, ".tmp-") && e.Type().IsRegular() {
			if err := os.Remove(filepath.Join(s.cfg.ExportDir, n)); err == nil {
				s.logf("ganesha: removed leftover temporary export file %s", n)
			}
		}
	}
}

// supervise restarts ganesha (and the bus) when they exit while s runs.
func (s *Server) supervise() {
	defer close(s.supDone)
	backoff := minBackoff
	for {
		s.mu.Lock()
		g, bus := s.ganesha, s.bus
		s.mu.Unlock()
		if g == nil || bus == nil {
			// Gone, or a restart failed: try again after the backoff.
			select {
			case <-s.stopCh:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, maxBackoff)
			if err := s.restart(); err != nil {
				s.logf("ganesha: restart failed: %v", err)
			}
			continue
		}
		select {
		case <-s.stopCh:
			return
		case <-bus.done:
			s.logf("ganesha: dbus-daemon (pid %d) exited unexpectedly (%v); restarting it and ganesha", bus.pid, bus.err)
			// ganesha lost its bus; it must start again to register its name.
			s.terminate(g)
			s.mu.Lock()
			s.bus, s.ganesha = nil, nil
			s.mu.Unlock()
		case <-g.done:
			s.logf("ganesha: ganesha.nfsd (pid %d) exited unexpectedly (%v); log:\n%s", g.pid, g.err, s.ganeshaTail())
			if time.Since(g.started) > stableAfter {
				backoff = minBackoff
			}
			s.mu.Lock()
			s.ganesha = nil
			s.mu.Unlock()
		}
	}
}

// restart brings up the bus when it is gone and then ganesha.
func (s *Server) restart() error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-s.stopCh:
			cancel()
		case <-ctx.Done():
		}
	}()
	s.mu.Lock()
	bus := s.bus
	s.mu.Unlock()
	if bus == nil || bus.exited() {
		b, err := s.startBus(ctx)
		if err != nil {
			return err
		}
		s.mu.Lock()
		s.bus = b
		s.mu.Unlock()
	}
	g, err := s.startGanesha(ctx) // on error, nothing is left running
	s.mu.Lock()
	defer s.mu.Unlock()
	s.restarts++
	if err != nil {
		return err
	}
	s.ganesha = g
	s.logf("ganesha: ganesha.nfsd restarted (pid %d, restart %d)", g.pid, s.restarts)
	return nil
}

// Stop stops ganesha, then the bus: SIGTERM by PID, SIGKILL after
// StopTimeout, and waits for both. It is idempotent.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		close(s.stopCh)
		<-s.supDone
		s.mu.Lock()
		g, bus := s.ganesha, s.bus
		s.mu.Unlock()
		var errs []error
		if err := s.terminate(g); err != nil {
			errs = append(errs, err)
		}
		s.control.Close()
		if err := s.terminate(bus); err != nil {
			errs = append(errs, err)
		}
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}

// terminate sends SIGTERM to p, SIGKILL after StopTimeout, and waits for it.
func (s *Server) terminate(p *proc) error {
	if p == nil || p.exited() {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	// A process stopped by Pause acts on SIGTERM only once continued.
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	t := time.NewTimer(s.cfg.StopTimeout)
	defer t.Stop()
	select {
	case <-p.done:
		return nil
	case <-t.C:
	}
	name := filepath.Base(p.cmd.Path)
	s.logf("ganesha: %s (pid %d) ignored SIGTERM for %v; sending SIGKILL", name, p.pid, s.cfg.StopTimeout)
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	return fmt.Errorf("ganesha: %s (pid %d) had to be killed", name, p.pid)
}

// stopStale stops the ganesha and bus an earlier Server on the same Dir
// left running: its process died without Stop and without taking them
// along (a version without the parent-death signal, or one started in
// another way), or their pid files are gone (an interrupted start, a
// directory cleaned by hand). They are found by what they run: processes
// whose command line names this Dir's configuration file as an argument of
// its own (ganesha's -f, dbus-daemon's --config-file=), from the pid files
// and from a scan of /proc. Nothing else matches: another Server's Dir has
// other paths, and a recycled PID no longer names the file. Each is stopped
// by PID (SIGTERM, SIGKILL after StopTimeout), ganesha before its bus.
func (s *Server) stopStale() {
	for _, k := range []struct{ pidFile, arg string }{
		{GaneshaPIDName, s.path(GaneshaConfName)},
		{BusPIDName, "--config-file=" + s.path(BusConfName)},
	} {
		pids := leftovers(s.path(k.pidFile), k.arg)
		if len(pids) > 0 {
			s.logf("ganesha: stopping pids %v left behind by an earlier run on %s", pids, s.cfg.Dir)
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGTERM)
			}
			if !waitGone(pids, k.arg, s.cfg.StopTimeout) {
				for _, pid := range pids {
					if alive(pid, k.arg) {
						s.logf("ganesha: pid %d ignored SIGTERM for %v; sending SIGKILL", pid, s.cfg.StopTimeout)
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
				if !waitGone(pids, k.arg, 5*time.Second) {
					s.logf("ganesha: pids %v left behind still run after SIGKILL", pids)
				}
			}
		}
		os.Remove(s.path(k.pidFile))
	}
}

// leftovers lists the processes that run with arg as one of their
// arguments: the one in pidFile, if it still does, and every other one in
// /proc.
func leftovers(pidFile, arg string) []int {
	var pids []int
	if data, err := os.ReadFile(pidFile); err == nil {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && pid > 1 && alive(pid, arg) {
			pids = append(pids, pid)
		}
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return pids
	}
	self := os.Getpid()
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 1 || pid == self || slices.Contains(pids, pid) {
			continue
		}
		if alive(pid, arg) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// waitGone waits until none of pids runs with arg any more, at most d.
func waitGone(pids []int, arg string, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		if !slices.ContainsFunc(pids, func(pid int) bool { return alive(pid, arg) }) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// alive reports whether pid runs with arg as one of its arguments (a
// zombie has an empty command line, a recycled PID another one).
func alive(pid int, arg string) bool {
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	for a := range bytes.SplitSeq(cmdline, []byte{0}) {
		if string(a) == arg {
			return true
		}
	}
	return false
}

// tail returns the last n lines of a file, or a note that it is unreadable.
// logAboutBytes bounds how much of the end of ganesha's log LogAbout reads.
const logAboutBytes = 256 << 10

// LogAbout returns the last few lines of ganesha's log that name path and
// report a problem (CRIT, MAJ, WARN or an error), joined by " | ": why
// ganesha refused an export of path, which its D-Bus answer does not say.
func (s *Server) LogAbout(path string) string {
	f, err := os.Open(s.path(GaneshaLogName))
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > logAboutBytes {
		if _, err := f.Seek(-logAboutBytes, io.SeekEnd); err != nil {
			return ""
		}
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return ""
	}
	var found []string
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.Contains(line, path) {
			continue
		}
		if !strings.Contains(line, ":CRIT :") && !strings.Contains(line, ":MAJ :") && !strings.Contains(line, ":WARN :") &&
			!strings.Contains(line, "returned") && !strings.Contains(line, "rror") {
			continue
		}
		// Keep the part after the component and level: the time, epoch
		// and host before it say nothing here.
		if i := strings.Index(line, "] "); i >= 0 {
			line = line[i+2:]
		}
		found = append(found, strings.TrimSpace(line))
	}
	if len(found) > 3 {
		found = found[len(found)-3:]
	}
	return strings.Join(found, " | ")
}

func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)\n", err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n") + "\n"
}

package vmtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/test/vm/agentapi"
)

// call posts req to the agent's path and decodes its answer into resp. Its
// errors are transport errors (or a request the agent refused).
func (v *VM) call(ctx context.Context, path string, req, resp any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	url := "http://" + netip.AddrPortFrom(v.Addr, agentPort).String() + path
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	hreq.Header.Set("Content-Type", "application/json")
	hresp, err := v.c.client.Do(hreq)
	if err != nil {
		return fmt.Errorf("%s: agent %s: %w", v.Name, path, err)
	}
	defer hresp.Body.Close()
	if hresp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(hresp.Body, 4096))
		return fmt.Errorf("%s: agent %s: %s: %s", v.Name, path, hresp.Status, bytes.TrimSpace(msg))
	}
	if err := json.NewDecoder(hresp.Body).Decode(resp); err != nil {
		return fmt.Errorf("%s: agent %s: decoding the answer: %w", v.Name, path, err)
	}
	return nil
}

// NodeEndpoint is where the node plugin listens (TCP) once started:
// "<addr>:10000", reachable with Cluster.Dialer.
func (v *VM) NodeEndpoint() string {
	return netip.AddrPortFrom(v.Addr, pluginPort).String()
}

// NodeID is the CSI node id the plugin StartPlugin last started reports:
// "<Name>@zone-a@<Addr>@<limit>", the limit being its
// --max-volumes-per-node (128 unless the extra arguments say otherwise).
func (v *VM) NodeID() string {
	return nodeid.Node{Name: v.Name, Zone: "zone-a", Address: v.Addr.String(), MaxVolumes: v.maxVolumes}.String()
}

// pluginMaxVolumes is the --max-volumes-per-node the arguments give the
// plugin (the last one wins, as with the flag package), 128 by default.
func pluginMaxVolumes(args []string) int64 {
	limit := int64(128)
	for i, a := range args {
		val, ok := "", false
		switch {
		case (a == "--max-volumes-per-node" || a == "-max-volumes-per-node") && i+1 < len(args):
			val, ok = args[i+1], true
		case strings.HasPrefix(a, "--max-volumes-per-node="):
			val, ok = strings.TrimPrefix(a, "--max-volumes-per-node="), true
		}
		if n, err := strconv.ParseInt(val, 10, 64); ok && err == nil {
			limit = n
		}
	}
	return limit
}

// Path is a path on the VM-local tmpfs, or node disk (Options.NodeDiskMB),
// not 9p, e.g. for staging and target paths: mount points must be on
// VM-local storage. The directory exists on
// the host too (empty there), so the path is valid on both sides.
func (v *VM) Path(elem ...string) string {
	return filepath.Join(append([]string{v.local}, elem...)...)
}

func (v *VM) pluginLogPath() string { return filepath.Join(v.dir, "plugin.log") }

// StartPlugin starts (or restarts: a running plugin gets SIGTERM, then
// SIGKILL after 10 s) inside the VM:
//
//	<Binary> --roles node --endpoint tcp://0.0.0.0:10000 --node-id <Name>
//	  --zone zone-a --node-address <Addr> --state-dir <Path("state")> -v 2 <extra...>
//
// and returns when the endpoint accepts connections, or an error with the
// plugin's log tail. Without a deadline in ctx it waits at most 2 minutes.
func (v *VM) StartPlugin(ctx context.Context, extra ...string) error {
	return v.StartPluginEnv(ctx, nil, extra...)
}

// StartPluginEnv is StartPlugin with env added to the plugin's environment
// (a fault point to die at, say).
func (v *VM) StartPluginEnv(ctx context.Context, env []string, extra ...string) error {
	if v.c.opts.Binary == "" {
		return fmt.Errorf("%s: no plugin binary: set Options.Binary", v.Name)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
	}
	args := []string{"--roles", "node", "--endpoint", "tcp://0.0.0.0:" + strconv.Itoa(pluginPort),
		"--node-id", v.Name, "--zone", "zone-a", "--node-address", v.Addr.String(),
		"--state-dir", v.Path("state"), "-v", "2"}
	args = append(args, extra...)
	v.maxVolumes = pluginMaxVolumes(args)
	var resp agentapi.PluginResponse
	err := v.call(ctx, agentapi.PathPluginStart, agentapi.PluginRequest{
		Path: v.c.opts.Binary, Args: args, Log: v.pluginLogPath(),
		Probe: "127.0.0.1:" + strconv.Itoa(pluginPort), Env: env,
	}, &resp)
	if err != nil {
		return fmt.Errorf("starting the node plugin: %w", err)
	}
	if resp.Error != "" {
		return fmt.Errorf("%s: starting the node plugin: %s", v.Name, resp.Error)
	}
	return nil
}

// PluginStatus tells whether the plugin runs and, if it ended, how.
func (v *VM) PluginStatus(ctx context.Context) (agentapi.PluginResponse, error) {
	var resp agentapi.PluginResponse
	err := v.call(ctx, agentapi.PathPluginStatus, struct{}{}, &resp)
	return resp, err
}

// KillPlugin sends SIGKILL to the plugin process and waits until it is gone.
// A plugin that is not running is no error.
func (v *VM) KillPlugin(ctx context.Context) error {
	var resp agentapi.PluginResponse
	if err := v.call(ctx, agentapi.PathPluginKill, struct{}{}, &resp); err != nil {
		return err
	}
	if resp.Error != "" {
		return fmt.Errorf("%s: killing the node plugin: %s", v.Name, resp.Error)
	}
	return nil
}

// PluginLog returns everything the plugins started on this VM wrote, with
// a line from the agent at each start and exit. The log is a host file
// (WorkDir/<Name>/plugin.log, written through 9p), so it can be read even
// when the VM no longer answers.
func (v *VM) PluginLog(ctx context.Context) (string, error) {
	data, err := os.ReadFile(v.pluginLogPath())
	if err != nil {
		return "", fmt.Errorf("%s: %w", v.Name, err)
	}
	return string(data), nil
}

// ConsoleTail returns the last n lines of the VM's serial console.
func (v *VM) ConsoleTail(n int) string { return readTail(v.console, n) }

// Run runs a command inside the VM (in the chroot of the host root, so host
// binaries work) and returns its combined output and exit code (127 when it
// cannot be started, 128+N when killed by signal N); err is for transport
// failures only. Canceling ctx kills the command.
func (v *VM) Run(ctx context.Context, name string, args ...string) (out string, exitCode int, err error) {
	var resp agentapi.RunResponse
	if err := v.call(ctx, agentapi.PathRun, agentapi.RunRequest{Name: name, Args: args}, &resp); err != nil {
		return "", -1, err
	}
	return string(resp.Output), resp.ExitCode, nil
}

// FileError is a failed WriteFile or ReadFile inside a VM. Its text is the
// VM's (e.g. "open /x/f: read-only file system") and it unwraps to the
// errno, so errors.Is(err, syscall.EROFS) and errors.Is(err, fs.ErrNotExist)
// work.
type FileError struct {
	VM    string
	Msg   string
	Errno syscall.Errno // 0 when the failure had no errno
}

func (e *FileError) Error() string { return e.VM + ": " + e.Msg }

func (e *FileError) Unwrap() error {
	if e.Errno == 0 {
		return nil
	}
	return e.Errno
}

// WriteFile writes data to path inside the VM (created 0644 or truncated,
// then fsynced, so that NFS write errors show). Its error includes the
// errno text, e.g. "read-only file system" or "permission denied".
func (v *VM) WriteFile(ctx context.Context, path string, data []byte) error {
	var resp agentapi.FileResponse
	if err := v.call(ctx, agentapi.PathWrite, agentapi.FileRequest{Path: path, Data: data}, &resp); err != nil {
		return err
	}
	if resp.Error != "" {
		return &FileError{VM: v.Name, Msg: resp.Error, Errno: syscall.Errno(resp.Errno)}
	}
	return nil
}

// ReadFile reads the file at path inside the VM.
func (v *VM) ReadFile(ctx context.Context, path string) ([]byte, error) {
	var resp agentapi.FileResponse
	if err := v.call(ctx, agentapi.PathRead, agentapi.FileRequest{Path: path}, &resp); err != nil {
		return nil, err
	}
	if resp.Error != "" {
		return nil, &FileError{VM: v.Name, Msg: resp.Error, Errno: syscall.Errno(resp.Errno)}
	}
	if resp.Data == nil {
		resp.Data = []byte{}
	}
	return resp.Data, nil
}

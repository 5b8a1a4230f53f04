// Package agentapi is the protocol between the test harness (test/vm/vmtest)
// and the agent in each test VM (test/vm/agent): JSON bodies POSTed to the
// paths below. Both sides import it, so they cannot drift apart.
package agentapi

// Paths the agent serves.
const (
	PathPing         = "/ping"
	PathRun          = "/run"
	PathWrite        = "/write"
	PathRead         = "/read"
	PathPluginStart  = "/plugin/start"
	PathPluginKill   = "/plugin/kill"
	PathPluginStatus = "/plugin/status"
)

// RunRequest runs a command inside the VM.
type RunRequest struct {
	Name string   `json:"name"`
	Args []string `json:"args"`
	Dir  string   `json:"dir,omitempty"`
	Env  []string `json:"env,omitempty"` // added to the agent's environment
}

// RunResponse is the command's combined output and exit code (127: could
// not start; 128+N: killed by signal N).
type RunResponse struct {
	Output   []byte `json:"output"`
	ExitCode int    `json:"exit_code"`
}

// FileRequest reads or writes a file inside the VM.
type FileRequest struct {
	Path string `json:"path"`
	Data []byte `json:"data,omitempty"`
	Perm uint32 `json:"perm,omitempty"`
}

// FileResponse carries the data read, or the error with its errno.
type FileResponse struct {
	Data  []byte `json:"data,omitempty"`
	Error string `json:"error,omitempty"`
	Errno int    `json:"errno,omitempty"`
}

// PluginRequest starts (or restarts) the node plugin.
type PluginRequest struct {
	Path  string   `json:"path"`
	Args  []string `json:"args"`
	Log   string   `json:"log"`           // file the plugin's output is appended to
	Probe string   `json:"probe"`         // host:port that accepts connections once the plugin serves
	Env   []string `json:"env,omitempty"` // added to the agent's environment (fault points)
}

// PluginResponse tells the plugin's state.
type PluginResponse struct {
	Error   string `json:"error,omitempty"`
	PID     int    `json:"pid,omitempty"`
	Running bool   `json:"running,omitempty"`
	Exit    string `json:"exit,omitempty"`
}

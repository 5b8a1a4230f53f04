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

// Paths for POSIX record locks (fcntl F_SETLK, F_SETLKW, F_GETLK), each
// taken by a process of its own: POSIX locks belong to a process, never
// conflict with another lock of the same process, and go when the process
// closes any descriptor of the file.
const (
	PathLockHold    = "/lock/hold"    // LockRequest -> HoldResponse
	PathLockWrite   = "/lock/write"   // HolderWriteRequest -> FileResponse
	PathLockRelease = "/lock/release" // HolderRequest -> HoldResponse
	PathLockTry     = "/lock/try"     // LockRequest -> TryLockResponse
)

// LockRequest names a write lock (or, with Read, a read lock) on Len bytes of the file at Path from
// Start (Len 0: to the end of the file and beyond, so Start 0 and Len 0
// lock the whole file). /lock/hold opens the file (creating it) in a new
// process that takes the lock, waiting for it (F_SETLKW) when Wait is set,
// and keeps it with the file open until released. /lock/try tries it
// (F_SETLK) in a process that lets it go at once, giving up after
// TimeoutMS (5 s when zero): the kernel NFS client keeps retrying while
// the server answers NFS4ERR_GRACE.
type LockRequest struct {
	Path      string `json:"path"`
	Start     int64  `json:"start,omitempty"`
	Len       int64  `json:"len,omitempty"`
	Wait      bool   `json:"wait,omitempty"`
	TimeoutMS int64  `json:"timeout_ms,omitempty"`
	// Read makes /lock/try try a read lock, through a read-only
	// descriptor, as a reader of a read-only mount can.
	Read bool `json:"read,omitempty"`
}

// HoldResponse identifies the process holding a lock (ID for the other
// /lock calls, PID in the VM), or tells why it could not take it.
type HoldResponse struct {
	ID    int    `json:"id,omitempty"`
	PID   int    `json:"pid,omitempty"`
	Error string `json:"error,omitempty"`
	Errno int    `json:"errno,omitempty"`
}

// HolderRequest names a lock holder.
type HolderRequest struct {
	ID int `json:"id"`
}

// HolderWriteRequest writes Data at Offset through the holder's open file
// and fsyncs it.
type HolderWriteRequest struct {
	ID     int    `json:"id"`
	Offset int64  `json:"offset"`
	Data   []byte `json:"data"`
}

// Outcomes of /lock/try.
const (
	LockAcquired = "acquired" // the lock was free (and is let go again)
	LockDenied   = "denied"   // F_SETLK failed with EAGAIN or EACCES: someone holds a conflicting lock
	LockBlocked  = "blocked"  // no answer within the timeout (the attempt was killed)
	LockFailed   = "failed"   // another error; see Error and Errno
)

// TryLockResponse is the outcome of /lock/try; for LockDenied, Conflict is
// the conflicting lock F_GETLK reports.
type TryLockResponse struct {
	Outcome  string     `json:"outcome"`
	Conflict *LockRange `json:"conflict,omitempty"`
	Error    string     `json:"error,omitempty"`
	Errno    int        `json:"errno,omitempty"`
}

// LockRange is a lock as F_GETLK reports it. PID is the holder's on this
// machine; for a lock held through another NFS client it means nothing.
type LockRange struct {
	Type  string `json:"type"` // "write" or "read"
	Start int64  `json:"start"`
	Len   int64  `json:"len"`
	PID   int    `json:"pid"`
}

package vmtest

import (
	"github.com/modeguard/modeguard/test/vm/agentapi"

	"context"
	"fmt"
	"syscall"
	"time"
)

// LockHolder is a process inside a VM that holds a POSIX write lock
// (fcntl) on a file it keeps open, started by HoldLock.
type LockHolder struct {
	vm  *VM
	ID  int // the agent's handle
	PID int // the process in the VM
}

// HoldLock starts a process in the VM that opens path (creating it),
// takes a write lock on length bytes from start (0: to the end, so 0, 0 is
// the whole file), waiting for it (F_SETLKW), and holds it until Release.
// It returns once the lock is held; a lock that cannot be taken is a
// *FileError with the errno.
func (v *VM) HoldLock(ctx context.Context, path string, start, length int64) (*LockHolder, error) {
	var resp agentapi.HoldResponse
	if err := v.call(ctx, agentapi.PathLockHold, agentapi.LockRequest{Path: path, Start: start, Len: length, Wait: true}, &resp); err != nil {
		return nil, err
	}
	if resp.Error != "" {
		return nil, &FileError{VM: v.Name, Msg: "locking " + path + ": " + resp.Error, Errno: syscall.Errno(resp.Errno)}
	}
	return &LockHolder{vm: v, ID: resp.ID, PID: resp.PID}, nil
}

// Write writes data at offset through the holder's open file and fsyncs
// it; a failure is a *FileError with the errno (EIO after a lost lock).
func (h *LockHolder) Write(ctx context.Context, offset int64, data []byte) error {
	var resp agentapi.FileResponse
	if err := h.vm.call(ctx, agentapi.PathLockWrite, agentapi.HolderWriteRequest{ID: h.ID, Offset: offset, Data: data}, &resp); err != nil {
		return err
	}
	if resp.Error != "" {
		return &FileError{VM: h.vm.Name, Msg: resp.Error, Errno: syscall.Errno(resp.Errno)}
	}
	return nil
}

// Release unlocks, closes the file and ends the holder.
func (h *LockHolder) Release(ctx context.Context) error {
	var resp agentapi.HoldResponse
	if err := h.vm.call(ctx, agentapi.PathLockRelease, agentapi.HolderRequest{ID: h.ID}, &resp); err != nil {
		return err
	}
	if resp.Error != "" {
		return &FileError{VM: h.vm.Name, Msg: "releasing: " + resp.Error, Errno: syscall.Errno(resp.Errno)}
	}
	return nil
}

// TryLock tries, in a process of its own in the VM, to take a write lock
// on length bytes of path from start without waiting (F_SETLK) and lets
// it go at once. The outcome is agentapi.LockAcquired, LockDenied (with the
// conflicting lock F_GETLK reports), LockBlocked when the attempt had not
// returned after timeout (the kernel NFS client retries while the server
// is in grace) or LockFailed; err is for transport failures only.
func (v *VM) TryLock(ctx context.Context, path string, start, length int64, timeout time.Duration) (agentapi.TryLockResponse, error) {
	return v.tryLock(ctx, agentapi.LockRequest{Path: path, Start: start, Len: length, TimeoutMS: timeout.Milliseconds()})
}

// TryReadLock is TryLock for a read lock, through a read-only descriptor.
func (v *VM) TryReadLock(ctx context.Context, path string, start, length int64, timeout time.Duration) (agentapi.TryLockResponse, error) {
	return v.tryLock(ctx, agentapi.LockRequest{Path: path, Start: start, Len: length, TimeoutMS: timeout.Milliseconds(), Read: true})
}

func (v *VM) tryLock(ctx context.Context, req agentapi.LockRequest) (agentapi.TryLockResponse, error) {
	var resp agentapi.TryLockResponse
	err := v.call(ctx, agentapi.PathLockTry, req, &resp)
	if err == nil && resp.Outcome == "" {
		err = fmt.Errorf("%s: /lock/try gave no outcome", v.Name)
	}
	return resp, err
}

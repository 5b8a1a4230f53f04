package controllerlock

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestSecondHolderWaits: a second Acquire on the same directories waits,
// says who holds them, and gets them once the first lets go.
func TestSecondHolderWaits(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	first, err := Acquire(context.Background(), []string{a, b}, 10*time.Millisecond, time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []Busy
	got := make(chan *Lock)
	go func() {
		l, err := Acquire(context.Background(), []string{b, a}, 10*time.Millisecond, time.Hour, func(bz Busy) {
			mu.Lock()
			seen = append(seen, bz)
			mu.Unlock()
		})
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	select {
	case <-got:
		t.Fatal("a second controller got the locks while the first held them")
	case <-time.After(200 * time.Millisecond):
	}
	mu.Lock()
	if len(seen) != 1 || !strings.Contains(seen[0].Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Errorf("waiting reported %v, want one report naming this process", seen)
	}
	mu.Unlock()
	first.Release()
	select {
	case second := <-got:
		second.Release()
	case <-time.After(10 * time.Second):
		t.Fatal("the second controller did not get the locks after the first released them")
	}
}

// TestWaitEndsWithContext: a waiting Acquire gives up with its context and
// holds nothing afterwards.
func TestWaitEndsWithContext(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	first, err := Acquire(context.Background(), []string{b}, 10*time.Millisecond, time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if l, err := Acquire(ctx, []string{a, b}, 10*time.Millisecond, time.Hour, nil); err == nil {
		l.Release()
		t.Fatal("Acquire succeeded while another holder had a directory")
	}
	first.Release()
	// a must be free again: the failed Acquire let go of what it had.
	l, err := Acquire(context.Background(), []string{a, b}, 10*time.Millisecond, time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
}

// TestLockDiesWithItsProcess: the kernel drops the lock of a process killed
// with SIGKILL; nothing stale is left to clear by hand.
func TestLockDiesWithItsProcess(t *testing.T) {
	dir := t.TempDir()
	if _, err := exec.LookPath("flock"); err != nil {
		t.Skip("flock(1) is not installed")
	}
	if _, err := open(dir); err != nil {
		t.Fatal(err)
	}
	// --close: the lock stays with flock(1) alone, not with its child.
	cmd := exec.Command("flock", "--exclusive", "--close", filepath.Join(dir, FileName), "sleep", "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The sleep goes with its process group, by the group's id.
	defer func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait() }()
	// Wait until flock(1) holds it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		l, err := Acquire(ctx, []string{dir}, 5*time.Millisecond, time.Hour, nil)
		cancel()
		if err != nil {
			break
		}
		l.Release()
		if time.Now().After(deadline) {
			t.Fatal("flock(1) never took the lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := Acquire(ctx, []string{dir}, 5*time.Millisecond, time.Hour, nil)
	if err != nil {
		t.Fatalf("the lock of a killed process is still held: %v", err)
	}
	l.Release()
}

// TestLockFileIsNotFollowed: a symlink in place of the lock file is refused,
// so the lock never writes through to another file.
func TestLockFileIsNotFollowed(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, filepath.Join(dir, FileName)); err != nil {
		t.Fatal(err)
	}
	if l, err := Acquire(context.Background(), []string{dir}, time.Millisecond, time.Hour, nil); err == nil {
		l.Release()
		t.Fatal("Acquire followed a symlink planted as the lock file")
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Errorf("the symlink's target was changed to %q", b)
	}
}

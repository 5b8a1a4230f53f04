// Package faultpoint lets a test kill the driver at a named step, the way a
// crash would: each step that changes durable state (an image written, a
// record saved, a loop device attached, a mount made, ...) calls Hit with
// its name, and when MODEGUARD_FAULT_KILL_AT names that step the process
// sends itself SIGKILL there. No deferred function runs and no buffer is
// flushed; what a restart finds is exactly what a crash at that point
// leaves. With the variable unset, Hit is one atomic load.
package faultpoint

import (
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"
)

// EnvVar names the steps to die at, comma-separated.
const EnvVar = "MODEGUARD_FAULT_KILL_AT"

var (
	armed = parse(os.Getenv(EnvVar))

	mu    sync.Mutex
	names = map[string]bool{}
)

func parse(v string) map[string]bool {
	if v == "" {
		return nil
	}
	m := map[string]bool{}
	for _, n := range strings.Split(v, ",") {
		if n = strings.TrimSpace(n); n != "" {
			m[n] = true
		}
	}
	return m
}

// Point is a step a test can kill the process at.
type Point struct{ name string }

// New declares a point; declare each once, at package level, so that
// Names lists every point a binary has.
func New(name string) Point {
	mu.Lock()
	defer mu.Unlock()
	if names[name] {
		panic("faultpoint: " + name + " declared twice")
	}
	names[name] = true
	return Point{name: name}
}

// Name of the point.
func (p Point) Name() string { return p.name }

// Hit kills the process with SIGKILL if the environment names this point.
func (p Point) Hit() {
	if armed == nil || !armed[p.name] {
		return
	}
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL cannot be caught; nothing after this runs
}

// Names lists every declared point, sorted.
func Names() []string {
	mu.Lock()
	defer mu.Unlock()
	out := make([]string, 0, len(names))
	for n := range names {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Command bench measures the driver as a CO drives it: over its real gRPC
// sockets, with real loop devices, mkfs, mounts and a real nfs-ganesha, and
// prints one table. Every measurement is repeated; the table gives the
// median and the spread (p10..p90, or min..max for few samples). Needs root.
//
//	go run ./test/bench -binary bin/modeguard          (make bench)
//	go run ./test/bench -only lifecycle,concurrency    one or more measurements
//
// Results and how they compare with the targets: docs/benchmarks.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/modeguard/modeguard/pkg/localcluster"
)

// driverVerbosity is the -v every driver process gets.
var driverVerbosity = 1

type options struct {
	binary    string
	work      string
	runs      int
	only      map[string]bool
	blockVols int // controller start-up: block volumes recorded
	nfsVols   int // NFS volumes for start-up (at least the largest of nfsCounts)
	listVols  int // ListVolumes and controller memory
	nodeVols  int // node start-up and memory: published volumes
	nfsCounts []int
	// nfsImageFS formats the controller's NFS volumes; nfsPublished is
	// the share of them published to some node at its restarts.
	nfsImageFS   string
	nfsPublished float64
	// perCallCounts: volumes recorded when one more lifecycle's calls are
	// timed, ascending.
	perCallCounts []int
	fioSeconds    int
	keepWorkDir   bool
	// concurrent is how many creates (then deletes) are in flight at once
	// in the concurrency measurement.
	concurrent int
}

// row is one line of the table.
type row struct {
	name, value, spread, target, note string
}

var measurements = []struct {
	name string
	run  func(ctx context.Context, b *bench) ([]row, error)
}{
	{"lifecycle", lifecycle},
	{"target", throughTarget},
	{"concurrency", concurrency},
	{"snapshots", snapshotsInUse},
	{"percall", perCall},
	{"controller", controllerScale},
	{"node", nodeScale},
	{"fio", dataPath},
	{"sanity", sanityWallTime},
}

func main() {
	var o options
	var only, counts, perCallCounts string
	flag.StringVar(&o.binary, "binary", "bin/modeguard", "the driver binary (make build)")
	flag.StringVar(&o.work, "work", "/var/tmp/modeguard-bench", "work directory on the disk under test; emptied first, removed at the end")
	flag.IntVar(&o.runs, "runs", 5, "repetitions of each measurement (lifecycles: 10x this many)")
	flag.StringVar(&only, "only", "", "comma-separated measurements to run (default all): "+names())
	flag.IntVar(&o.blockVols, "block-volumes", 5000, "block volumes recorded for the controller start-up")
	flag.IntVar(&o.nfsVols, "nfs-volumes", 1000, "NFS volumes recorded for the controller start-up (at least the largest of -nfs-counts)")
	flag.StringVar(&o.nfsImageFS, "nfs-image-filesystem", "ext4", "what the controller formats NFS volumes with (--nfs-image-filesystem): ext4 lets 1,000 fit a small disk, xfs takes 300 MiB each and writes 64 MiB")
	flag.Float64Var(&o.nfsPublished, "nfs-published", 0.01, "share of the NFS volumes published to some node while the controller restarts")
	flag.StringVar(&counts, "nfs-counts", "100,1000", "NFS volume counts at which one more create+publish is timed")
	flag.StringVar(&perCallCounts, "percall-counts", "100,10000", "block volumes recorded when the calls of one more lifecycle are timed")
	flag.IntVar(&o.listVols, "list-volumes", 10000, "volumes for ListVolumes paging and controller memory")
	flag.IntVar(&o.nodeVols, "node-volumes", 200, "volumes published on the node for its start-up and memory")
	flag.IntVar(&o.fioSeconds, "fio-seconds", 10, "runtime of each fio job")
	flag.IntVar(&o.concurrent, "concurrent", 64, "creates and deletes in flight at once in the concurrency measurement")
	flag.BoolVar(&o.keepWorkDir, "keep", false, "keep the work directory (logs)")
	flag.IntVar(&driverVerbosity, "driver-v", 1, "-v of the driver processes")
	flag.Parse()
	if only != "" {
		o.only = map[string]bool{}
		for _, n := range strings.Split(only, ",") {
			o.only[strings.TrimSpace(n)] = true
		}
	}
	o.nfsCounts = positiveCounts("-nfs-counts", counts)
	o.perCallCounts = positiveCounts("-percall-counts", perCallCounts)
	if o.nfsVols < o.nfsCounts[len(o.nfsCounts)-1] {
		o.nfsVols = o.nfsCounts[len(o.nfsCounts)-1]
	}
	if os.Geteuid() != 0 {
		fail("needs root: loop devices, mkfs, mounts, ganesha")
	}
	bin, err := filepath.Abs(o.binary)
	if err != nil {
		fail("%v", err)
	}
	o.binary = bin
	if _, err := os.Stat(o.binary); err != nil {
		fail("driver binary: %v (make build)", err)
	}
	if err := os.RemoveAll(o.work); err != nil {
		fail("%v", err)
	}
	if err := os.MkdirAll(o.work, 0o700); err != nil {
		fail("%v", err)
	}

	b := &bench{opts: o}
	ctx := context.Background()
	var rows []row
	failed := false
	for _, m := range measurements {
		if o.only != nil && !o.only[m.name] {
			continue
		}
		fmt.Fprintf(os.Stderr, "[bench %s] %s\n", time.Now().Format("15:04:05"), m.name)
		r, err := m.run(ctx, b)
		rows = append(rows, r...)
		if err != nil {
			failed = true
			rows = append(rows, row{name: m.name, value: "FAILED", note: err.Error()})
			fmt.Fprintf(os.Stderr, "[bench] %s: %v\n", m.name, err)
		}
		b.cleanup()
	}
	printTable(rows)
	if !o.keepWorkDir {
		_ = os.RemoveAll(o.work)
	}
	if failed {
		os.Exit(1)
	}
}

// positiveCounts parses a comma-separated list of positive numbers, sorted.
func positiveCounts(flagName, list string) []int {
	var out []int
	for _, c := range strings.Split(list, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(c), &n); err != nil || n < 1 {
			fail("%s: %q is not a positive number", flagName, c)
		}
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func names() string {
	var n []string
	for _, m := range measurements {
		n = append(n, m.name)
	}
	return strings.Join(n, ",")
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
	os.Exit(2)
}

// bench holds what the measurements share: the options and the processes
// and directories to clean up after each.
type bench struct {
	opts    options
	plugins []*plugin
	dirs    []string
}

// dir makes a fresh directory below the work dir, cleaned up after the
// measurement.
func (b *bench) dir(name string) string {
	d := filepath.Join(b.opts.work, name)
	_ = os.RemoveAll(d)
	if err := os.MkdirAll(d, 0o700); err != nil {
		fail("%v", err)
	}
	b.dirs = append(b.dirs, d)
	return d
}

// plugin starts a driver process and registers it for cleanup.
func (b *bench) plugin(ctx context.Context, name, dir string, args ...string) (*plugin, error) {
	p, err := newPlugin(b.opts.binary, name, dir, args...)
	if err != nil {
		return nil, err
	}
	b.plugins = append(b.plugins, p)
	if _, err := p.start(ctx); err != nil {
		return nil, err
	}
	return p, nil
}

// cleanup stops every process by PID, unmounts and detaches whatever is left
// below the measurement's directories, and removes them.
func (b *bench) cleanup() {
	for _, p := range b.plugins {
		p.stop()
		if p.conn != nil {
			_ = p.conn.Close()
		}
	}
	b.plugins = nil
	for _, d := range b.dirs {
		for _, m := range localcluster.MountsUnder(d) {
			if err := unix.Unmount(m, 0); err != nil {
				_ = unix.Unmount(m, unix.MNT_DETACH)
			}
		}
		for _, l := range localcluster.LoopsUnder(d) {
			_ = exec.Command("losetup", "-d", l).Run()
		}
		if !b.opts.keepWorkDir {
			_ = os.RemoveAll(d)
		}
	}
	b.dirs = nil
}

func printTable(rows []row) {
	w := tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "measurement\tmedian\tspread\ttarget\tnote")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", r.name, r.value, r.spread, r.target, r.note)
	}
	_ = w.Flush()
}

// stats summarises samples: the median and the spread, p10..p90 from ten
// samples on, min..max below that.
func stats(samples []time.Duration) (median time.Duration, spread string) {
	s := slices.Clone(samples)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return 0, "-"
	}
	median = s[n/2]
	if n%2 == 0 {
		median = (s[n/2-1] + s[n/2]) / 2
	}
	lo, hi := s[0], s[n-1]
	if n >= 10 {
		lo, hi = s[n/10], s[n-1-n/10]
	}
	return median, fmt.Sprintf("%s..%s", ms(lo), ms(hi))
}

// p99 of the samples: the largest below a hundred samples.
func p99(samples []time.Duration) time.Duration {
	s := slices.Clone(samples)
	slices.Sort(s)
	i := (len(s)*99+99)/100 - 1
	return s[min(max(i, 0), len(s)-1)]
}

func ms(d time.Duration) string {
	switch {
	case d >= 10*time.Second:
		return fmt.Sprintf("%.1fs", d.Seconds())
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	default:
		return fmt.Sprintf("%.1fms", float64(d.Microseconds())/1000)
	}
}

// growthRow compares the p50 and p99 of the samples taken at a larger
// count (hi) with those at a smaller one (lo): a call whose cost does not
// grow with the count stays near 1x.
func growthRow(name string, lo, hi []time.Duration) row {
	medLo, _ := stats(lo)
	medHi, _ := stats(hi)
	return row{name: name,
		value:  fmt.Sprintf("p50 %.2fx", medHi.Seconds()/medLo.Seconds()),
		spread: fmt.Sprintf("p99 %.2fx", p99(hi).Seconds()/p99(lo).Seconds()),
		target: "<= 1.2x"}
}

func durationRow(name string, samples []time.Duration, target, note string) row {
	med, spread := stats(samples)
	return row{name: name, value: ms(med), spread: spread, target: target, note: note}
}

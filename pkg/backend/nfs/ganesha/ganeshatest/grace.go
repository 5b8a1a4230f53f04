package ganeshatest

import (
	"bufio"
	"bytes"
	"os"
	"regexp"
	"strconv"
	"time"
)

// Grace is one grace period of a ganesha as its log (NIV_EVENT) tells it:
//
//	... nfs_start_grace :STATE :EVENT :NFS Server Now IN GRACE, duration 30
//	... nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(1) clid count(2)
//	... nfs_lift_grace_locked :STATE :EVENT :NFS Server Now NOT IN GRACE
//
// ganesha checks at the start and then every reaper cycle; the line before
// the lift tells why grace ended.
type Grace struct {
	Start, End time.Time // to the second, local time; End is zero while in grace
	// Known is how many clients the recovery database held at the start
	// ("clid count"), Reclaimed how many of them had sent
	// RECLAIM_COMPLETE at the last check.
	Known, Reclaimed int
}

// Ended reports whether the log shows the end of this grace period.
func (g Grace) Ended() bool { return !g.End.IsZero() }

// EndedEarly reports whether grace ended because every known client had
// reclaimed (or none was known) rather than because its time ran out.
func (g Grace) EndedEarly() bool { return g.Ended() && g.Reclaimed == g.Known }

var (
	graceStartRe = regexp.MustCompile(`NFS Server Now IN GRACE`)
	graceCheckRe = regexp.MustCompile(`check grace:reclaim complete\((\d+)\) clid count\((\d+)\)`)
	graceEndRe   = regexp.MustCompile(`NFS Server Now NOT IN GRACE`)
)

// GracePeriods lists the grace periods in a ganesha log, oldest first
// (ganesha appends to its log across restarts).
func GracePeriods(log []byte) []Grace {
	var out []Grace
	sc := bufio.NewScanner(bytes.NewReader(log))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		switch {
		case graceStartRe.Match(line):
			out = append(out, Grace{Start: logTime(line)})
		case len(out) == 0:
		case graceCheckRe.Match(line):
			m := graceCheckRe.FindSubmatch(line)
			out[len(out)-1].Reclaimed, _ = strconv.Atoi(string(m[1]))
			out[len(out)-1].Known, _ = strconv.Atoi(string(m[2]))
		case graceEndRe.Match(line) && !out[len(out)-1].Ended():
			out[len(out)-1].End = logTime(line)
		}
	}
	return out
}

// ReadGracePeriods reads the ganesha log at path (ganesha.ServerConfig.Dir/
// ganesha.log) and returns GracePeriods of it.
func ReadGracePeriods(path string) ([]Grace, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return GracePeriods(data), nil
}

// logTime reads the "02/01/2006 15:04:05" a ganesha log line starts with.
func logTime(line []byte) time.Time {
	const layout = "02/01/2006 15:04:05"
	if len(line) < len(layout) {
		return time.Time{}
	}
	t, _ := time.ParseInLocation(layout, string(line[:len(layout)]), time.Local)
	return t
}

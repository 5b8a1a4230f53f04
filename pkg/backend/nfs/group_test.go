package nfs_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/nfs"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// TestGroupOfVolumesBeingWrittenIsOfOneInstant: on the quota storage, a
// group snapshot of two volumes that one writer writes in turn (record n
// to the log, acknowledged, then record n to the data) is taken under one
// hold of ganesha: no group's data holds a record its log lacks, and both
// hold every record acknowledged before the call. One pause per group.
func TestGroupOfVolumesBeingWrittenIsOfOneInstant(t *testing.T) {
	p := startPausedServer(t, 15*time.Second, pausedOptions{})
	ctx := context.Background()
	const filler = 200 // a walk that takes a while, so two walks are far apart
	log, logShare := p.writtenVolume(t, "log", 1, filler)
	data, dataShare := p.writtenVolume(t, "data", 1, filler)

	var mu sync.Mutex
	acked, stop, done := 0, make(chan struct{}), make(chan struct{})
	var werr error
	local := filepath.Join(t.TempDir(), "record")
	go func() {
		defer close(done)
		for n := 0; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := os.WriteFile(local, []byte(strconv.Itoa(n)+"\n"), 0o644); err != nil {
				werr = err
				return
			}
			for _, share := range []string{logShare, dataShare} {
				if err := p.node.NFSCopy(context.Background(), local, p.net.NFSURL(share, fmt.Sprintf("d0/r%d", n))); err != nil {
					mu.Lock()
					werr = fmt.Errorf("record %d: %w", n, err)
					mu.Unlock()
					return
				}
			}
			mu.Lock()
			acked = n + 1
			mu.Unlock()
		}
	}()
	halt := func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		<-done
	}
	t.Cleanup(halt)
	state := func() (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return acked, werr
	}
	waitPast := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
			a, err := state()
			if err != nil {
				t.Fatalf("the writer: %v", err)
			}
			if a > n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("no record acknowledged past %d within a minute", n)
			}
		}
	}
	waitPast(2)

	const groups = 3
	for i := range groups {
		before, _ := state()
		var members []backend.GroupMember
		for _, src := range []volumeid.ID{log, data} {
			name := fmt.Sprintf("g%d-%s", i, src.Key)
			id, err := volumeid.New(accessmode.BackendNFS, "", volumeid.Snapshot, volumeid.KeyFor("test", volumeid.Snapshot, name))
			if err != nil {
				t.Fatal(err)
			}
			members = append(members, backend.GroupMember{ID: id, Name: name, Source: src})
		}
		got, err := p.ctrl.CreateSnapshotGroup(ctx, members)
		if err != nil {
			t.Fatalf("group %d of two volumes being written: %v", i, err)
		}
		if len(got) != 2 {
			t.Fatalf("group %d has %d members, want 2", i, len(got))
		}
		inLog := checkRecords(t, fmt.Sprintf("group %d, log", i), filepath.Join(p.root, "snapshots", members[0].ID.FileName()), 1, before)
		inData := checkRecords(t, fmt.Sprintf("group %d, data", i), filepath.Join(p.root, "snapshots", members[1].ID.FileName()), 1, before)
		if inData > inLog {
			t.Errorf("group %d: the data holds records 0..%d, its log only 0..%d: the members are not of one instant", i, inData, inLog)
		}
		t.Logf("group %d: %d records acknowledged before, log 0..%d, data 0..%d", i, before, inLog, inData)
		waitPast(inLog + 1)
	}
	halt()
	if _, err := state(); err != nil {
		t.Errorf("the writer: %v", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.pauses) != groups {
		t.Errorf("%d pauses (%v), want one per group, %d", len(p.pauses), p.pauses, groups)
	}
	for i, o := range p.pauses {
		if o != nfs.PauseCopied {
			t.Errorf("pause %d: %s, want %s", i, o, nfs.PauseCopied)
		}
	}
	t.Logf("pauses: %v", p.took)
}

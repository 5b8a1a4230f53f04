package ganeshatest

import (
	"testing"
	"time"
)

// Lines as ganesha 4.3 writes them: a start without known clients, a
// restart whose grace ran out, and one that ended when both known clients
// had reclaimed.
const sampleLog = `24/11/2026 03:33:51 : epoch 6b05059f : vm : nfs-ganesha-4254[main] nfs_start_grace :STATE :EVENT :NFS Server Now IN GRACE, duration 20
24/11/2026 03:33:51 : epoch 6b05059f : vm : nfs-ganesha-4254[main] nfs_start_grace :STATE :EVENT :grace reload client info completed from backend
24/11/2026 03:33:51 : epoch 6b05059f : vm : nfs-ganesha-4254[main] nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(0) clid count(0)
24/11/2026 03:33:51 : epoch 6b05059f : vm : nfs-ganesha-4254[main] nfs_lift_grace_locked :STATE :EVENT :NFS Server Now NOT IN GRACE
24/11/2026 03:37:06 : epoch 6b0505a5 : vm : nfs-ganesha-4525[main] nfs_start_grace :STATE :EVENT :NFS Server Now IN GRACE, duration 20
24/11/2026 03:37:06 : epoch 6b0505a5 : vm : nfs-ganesha-4525[reaper] nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(0) clid count(3)
24/11/2026 03:37:21 : epoch 6b0505a5 : vm : nfs-ganesha-4525[reaper] nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(1) clid count(3)
24/11/2026 03:37:26 : epoch 6b0505a5 : vm : nfs-ganesha-4525[reaper] nfs_lift_grace_locked :STATE :EVENT :NFS Server Now NOT IN GRACE
24/11/2026 03:40:00 : epoch 6b0505b0 : vm : nfs-ganesha-4600[main] nfs_start_grace :STATE :EVENT :NFS Server Now IN GRACE, duration 20
24/11/2026 03:40:00 : epoch 6b0505b0 : vm : nfs-ganesha-4600[main] nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(0) clid count(2)
24/11/2026 03:40:10 : epoch 6b0505b0 : vm : nfs-ganesha-4600[reaper] nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(2) clid count(2)
24/11/2026 03:40:10 : epoch 6b0505b0 : vm : nfs-ganesha-4600[reaper] nfs_lift_grace_locked :STATE :EVENT :NFS Server Now NOT IN GRACE
24/11/2026 03:41:00 : epoch 6b0505c0 : vm : nfs-ganesha-4700[main] nfs_start_grace :STATE :EVENT :NFS Server Now IN GRACE, duration 20
24/11/2026 03:41:00 : epoch 6b0505c0 : vm : nfs-ganesha-4700[main] nfs_try_lift_grace :STATE :EVENT :check grace:reclaim complete(0) clid count(1)
`

func TestGracePeriods(t *testing.T) {
	at := func(hms string) time.Time {
		v, err := time.ParseInLocation("02/01/2006 15:04:05", "24/11/2026 "+hms, time.Local)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	got := GracePeriods([]byte(sampleLog))
	want := []struct {
		g            Grace
		ended, early bool
	}{
		{Grace{Start: at("03:33:51"), End: at("03:33:51")}, true, true},
		{Grace{Start: at("03:37:06"), End: at("03:37:26"), Known: 3, Reclaimed: 1}, true, false},
		{Grace{Start: at("03:40:00"), End: at("03:40:10"), Known: 2, Reclaimed: 2}, true, true},
		{Grace{Start: at("03:41:00"), Known: 1}, false, false},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d grace periods %+v, want %d", len(got), got, len(want))
	}
	for i, w := range want {
		g := got[i]
		if !g.Start.Equal(w.g.Start) || !g.End.Equal(w.g.End) || g.Known != w.g.Known || g.Reclaimed != w.g.Reclaimed ||
			g.Ended() != w.ended || g.EndedEarly() != w.early {
			t.Errorf("grace %d: %+v (ended %v, early %v), want %+v (ended %v, early %v)", i, g, g.Ended(), g.EndedEarly(), w.g, w.ended, w.early)
		}
	}
}

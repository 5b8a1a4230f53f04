package mounts

import "testing"

func TestTopAt(t *testing.T) {
	root := &Mount{ID: 1, Parent: 0, Mountpoint: "/"}
	first := &Mount{ID: 10, Parent: 1, Mountpoint: "/x", Source: "first"}
	over := &Mount{ID: 11, Parent: 10, Mountpoint: "/x", Source: "over"}
	other := &Mount{ID: 12, Parent: 1, Mountpoint: "/y", Source: "other"}
	tests := []struct {
		name string
		all  []*Mount
		path string
		want *Mount
	}{
		{"nothing there", []*Mount{root, other}, "/x", nil},
		{"one mount", []*Mount{root, first}, "/x", first},
		{"the one stacked on top", []*Mount{root, first, over, other}, "/x", over},
		{"listed before what it covers", []*Mount{over, first}, "/x", over},
		{"a prefix is not the path", []*Mount{root, first}, "/x/y", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := TopAt(tt.all, tt.path); got != tt.want {
				t.Fatalf("TopAt(%s) = %+v, want %+v", tt.path, got, tt.want)
			}
		})
	}
}

func TestSuperOptions(t *testing.T) {
	m := &Mount{Options: "rw,nodev", VFSOptions: "rw,nouuid,prjquota"}
	got := SuperOptions(m)
	if len(got) != 3 || got[1] != "nouuid" || got[2] != "prjquota" {
		t.Fatalf("SuperOptions = %q", got)
	}
}

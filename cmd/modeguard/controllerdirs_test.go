package main

import (
	"slices"
	"strings"
	"testing"
)

// TestControllerDirs: the controller lock covers every directory a
// controller keeps state in, and no directory of someone else's ganesha.
func TestControllerDirs(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"block pools", []string{"--roles", "controller", "--block-pool", "zone-a=/p/a", "--block-pool", "zone-b=/p/b"}, []string{"/p/a", "/p/b"}},
		{"nfs with its own ganesha", []string{"--roles", "controller", "--nfs-export-root", "/n", "--nfs-server", "10.0.0.1", "--nfs-ganesha-dir", "/g"}, []string{"/g", "/n"}},
		{"nfs with someone else's ganesha", []string{"--roles", "controller", "--nfs-export-root", "/n", "--nfs-server", "10.0.0.1",
			"--nfs-ganesha-dbus", "unix:path=/run/g.sock", "--nfs-export-config-dir", "/e"}, []string{"/n"}},
		{"a zone behind a storage target", []string{"--roles", "controller,node", "--block-pool", "zone-a=/p/a", "--block-pool", "zone-b=/p/b",
			"--block-target", "zone-a=unix:///run/target-a.sock"}, []string{"/p/b"}},
		{"a fence file", []string{"--roles", "controller", "--block-pool", "zone-a=/p/a", "--fence-file", "/c/fences.json"}, []string{"/c", "/p/a"}},
		{"both", []string{"--roles", "controller", "--block-pool", "zone-a=/p/a", "--nfs-export-root", "/n", "--nfs-server", "10.0.0.1", "--nfs-ganesha-dir", "/g"}, []string{"/g", "/n", "/p/a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parseFlags(tt.args)
			if err != nil {
				t.Fatal(err)
			}
			got := controllerDirs(o)
			slices.Sort(got)
			if !slices.Equal(got, tt.want) {
				t.Errorf("controllerDirs = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestFenceFileFlag: a fence file is the controller's, at a clean absolute
// path; anything else stops the process at start.
func TestFenceFileFlag(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"relative", []string{"--roles", "controller", "--block-pool", "zone-a=" + dir, "--fence-file", "fences.json"}},
		{"unclean", []string{"--roles", "controller", "--block-pool", "zone-a=" + dir, "--fence-file", dir + "/x/../fences.json"}},
		{"the lock file", []string{"--roles", "controller", "--block-pool", "zone-a=" + dir, "--fence-file", dir + "/.modeguard-controller.lock"}},
		{"node role", []string{"--roles", "node", "--node-id", "n1", "--zone", "zone-a", "--state-dir", dir + "/state", "--block-pool", "zone-a=" + dir, "--fence-file", dir + "/fences.json"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseFlags(tc.args)
			if err != nil {
				t.Fatal(err)
			}
			if err := run(o); err == nil || !strings.Contains(err.Error(), "--fence-file") {
				t.Fatalf("run = %v, want a refusal naming --fence-file", err)
			}
		})
	}
}

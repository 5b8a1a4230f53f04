package main

import (
	"slices"
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

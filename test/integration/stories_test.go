// Package integration runs modeguard as separate processes — one controller
// and three node plugins in two zones sharing per-zone pools, and storage
// targets owning the pools — and checks every story with real loop
// devices, mkfs and mounts.
package integration

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/stories"
	"github.com/modeguard/modeguard/test/certs"
	"github.com/modeguard/modeguard/test/testenv"
)

func TestStoriesAcrossProcesses(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := testenv.Tmpfs(t, "512m")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cluster, err := localcluster.Start(ctx, bin, work, localcluster.DefaultNodes, 2)
	if err != nil {
		t.Fatal(err)
	}
	runStories(ctx, t, cluster, work)
}

// TestStoriesThroughStorageTargets: every story again, with each zone's
// pool owned by a storage target process (--roles target) that the
// controller reaches over loopback TCP with mutual TLS, holding no pool
// itself. The nodes still see the pools (one machine, loop devices).
func TestStoriesThroughStorageTargets(t *testing.T) {
	testenv.RequireRoot(t)
	bin := testenv.BuildBinary(t)
	work := testenv.Tmpfs(t, "512m")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	authority := certs.NewCA(t, "modeguard")
	cluster, err := localcluster.StartWithTargets(ctx, bin, work, localcluster.DefaultNodes, 2, localcluster.Targets{
		TLS: &localcluster.TargetTLS{
			Target:     remote.TLSFiles(authority.Server("127.0.0.1")),
			Controller: remote.TLSFiles(authority.Client("controller")),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	runStories(ctx, t, cluster, work)
}

func runStories(ctx context.Context, t *testing.T, cluster *localcluster.Cluster, work string) {
	t.Cleanup(func() {
		if forced := cluster.Stop(); len(forced) > 0 {
			t.Errorf("the stories left things behind that had to be cleaned by force: %v", forced)
		}
		if t.Failed() {
			for name, path := range cluster.Logs() {
				data, _ := os.ReadFile(path)
				t.Logf("--- log of %s:\n%s", name, data)
			}
		}
	})
	for _, s := range stories.All() {
		t.Run(s.Name, func(t *testing.T) {
			var out bytes.Buffer
			cluster.Stories.Out = &out
			err := stories.Run(ctx, cluster.Stories, s.Name)
			t.Log("\n" + out.String())
			if err != nil {
				t.Fatal(err)
			}
		})
	}
	if loops := localcluster.LoopsUnder(work); len(loops) > 0 {
		t.Errorf("loop devices still attached after every story cleaned up: %v", loops)
	}
}

package remote_test

// The remote client against the contract every backend shares: a block
// controller with its pool on a tmpfs, served by Handler on a unix socket
// and reached through Client, as a controller reaches a storage target on
// its host.

import (
	"context"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/backendtest"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/remote"
	"github.com/modeguard/modeguard/test/testenv"
)

func TestControllerContract(t *testing.T) {
	props := backendtest.BlockProperties
	backendtest.RunControllerContract(t, props, func(t *testing.T) backend.Controller {
		testenv.RequireRoot(t)
		pools := testenv.Pools(t, "512m", "zone-b", "zone-a")
		target, err := block.NewController(pools)
		if err != nil {
			t.Fatal(err)
		}
		sock := filepath.Join(t.TempDir(), "target.sock")
		lis, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: remote.Handler(target)}
		served := make(chan error, 1)
		go func() { served <- srv.Serve(lis) }()
		t.Cleanup(func() {
			srv.Close()
			if err := <-served; !errors.Is(err, http.ErrServerClosed) {
				t.Errorf("serving the target: %v", err)
			}
		})
		c, err := remote.Dial(context.Background(), remote.Target{Address: "unix://" + sock})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		if err := c.Hold(context.Background(), "contract", func(string) {}); err != nil {
			t.Fatal(err)
		}
		return c
	})
}

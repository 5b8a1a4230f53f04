package block_test

// The block backend against the contract every backend shares: real
// images in pools on a tmpfs of their own (so that capacity is the
// tmpfs's, untouched by anything else), real loop devices on the node.

import (
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/backendtest"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/test/testenv"
)

var contractProps = backendtest.BlockProperties

func TestControllerContract(t *testing.T) {
	backendtest.RunControllerContract(t, contractProps, func(t *testing.T) backend.Controller {
		testenv.RequireRoot(t)
		c, err := block.NewController(testenv.Pools(t, "512m", "zone-b", "zone-a"))
		if err != nil {
			t.Fatal(err)
		}
		return c
	})
}

func TestNodeContract(t *testing.T) {
	backendtest.RunNodeContract(t, contractProps, func(t *testing.T) (backend.Controller, backend.Node) {
		testenv.RequireRoot(t)
		pools := testenv.Pools(t, "512m", "zone-a")
		c, err := block.NewController(pools)
		if err != nil {
			t.Fatal(err)
		}
		n, err := block.NewNode(pools)
		if err != nil {
			t.Fatal(err)
		}
		return c, n
	})
}

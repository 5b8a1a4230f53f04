package zoned_test

// The join of block controllers against the contract every backend
// shares: two zones, each a block controller of its own with its pool on
// a tmpfs, joined in an order that is not alphabetical.

import (
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/backendtest"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/backend/zoned"
	"github.com/modeguard/modeguard/test/testenv"
)

func TestControllerContract(t *testing.T) {
	props := backendtest.BlockProperties
	backendtest.RunControllerContract(t, props, func(t *testing.T) backend.Controller {
		testenv.RequireRoot(t)
		pools := testenv.Pools(t, "512m", "zone-b", "zone-a")
		var parts []backend.Controller
		for _, zone := range []string{"zone-b", "zone-a"} {
			part, err := block.NewController(map[string]string{zone: pools[zone]})
			if err != nil {
				t.Fatal(err)
			}
			parts = append(parts, part)
		}
		c, err := zoned.New(parts...)
		if err != nil {
			t.Fatal(err)
		}
		return c
	})
}

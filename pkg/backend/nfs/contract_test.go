package nfs_test

// The NFS controller against the contract every backend shares, as the
// driver runs it: its storage chosen and prepared by Setup, its own
// ganesha on loopback, on a free port.

import (
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/backendtest"
	"github.com/modeguard/modeguard/test/testenv"
)

func TestControllerContract(t *testing.T) {
	props := backendtest.NFSProperties
	backendtest.RunControllerContract(t, props, func(t *testing.T) backend.Controller {
		testenv.RequireRoot(t)
		return testenv.NFSController(t, t.TempDir(), 1<<30)
	})
}

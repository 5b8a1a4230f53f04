package nfs_test

// The NFS controller against the contract every backend shares, as the
// driver runs it: its storage chosen and prepared by Setup, its own
// ganesha on loopback, on a free port. Its export root is an ext4 of its
// own, as the machine's disk is: the contract checks that a new volume
// lowers the capacity, which is that filesystem's free space, and on a
// disk shared with other jobs their files come and go meanwhile.

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
		return testenv.NFSController(t, testenv.LoopFilesystem(t, 4<<30, "ext4", "-q"), 1<<30)
	})
}

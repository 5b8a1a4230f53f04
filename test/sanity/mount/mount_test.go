package mount

import (
	"testing"

	"github.com/modeguard/modeguard/test/sanity"
)

// TestSanityMount runs csi-sanity with filesystem (mount) volumes.
func TestSanityMount(t *testing.T) { sanity.Run(t, "mount") }

package target

import (
	"testing"

	"github.com/modeguard/modeguard/test/sanity"
)

// TestSanityThroughTarget runs csi-sanity with filesystem volumes whose
// pool a storage target owns, reached over its mutual-TLS API.
func TestSanityThroughTarget(t *testing.T) { sanity.RunThroughTarget(t, "mount") }

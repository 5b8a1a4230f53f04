package block

import (
	"testing"

	"github.com/modeguard/modeguard/test/sanity"
)

// TestSanityBlock runs csi-sanity with raw block volumes.
func TestSanityBlock(t *testing.T) { sanity.Run(t, "block") }

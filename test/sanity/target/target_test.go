package target

import (
	"testing"

	"github.com/modeguard/modeguard/test/sanity"
)

// TestSanityThroughTarget runs csi-sanity with filesystem volumes whose
// pool a storage target owns, reached over its mutual-TLS API.
func TestSanityThroughTarget(t *testing.T) { sanity.RunThroughTarget(t, "mount") }

// TestSanityNFSThroughTarget runs csi-sanity against the NFS backend
// served by a storage target (its ganesha, data and records there),
// reached over its mutual-TLS API; the node's kernel NFS mount is faked as
// in TestSanityNFSWithFakeKernelMount.
func TestSanityNFSThroughTarget(t *testing.T) { sanity.RunNFSThroughTarget(t) }

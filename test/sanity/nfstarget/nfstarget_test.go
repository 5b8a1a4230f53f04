// Package nfstarget runs csi-sanity against the NFS backend behind a
// storage target: a package of its own, since Ginkgo runs one suite per
// test binary.
package nfstarget

import (
	"testing"

	"github.com/modeguard/modeguard/test/sanity"
)

// TestSanityNFSThroughTarget runs csi-sanity against the NFS backend
// served by a storage target (its ganesha, data and records there),
// reached over its mutual-TLS API; the node's kernel NFS mount is faked as
// in TestSanityNFSWithFakeKernelMount.
func TestSanityNFSThroughTarget(t *testing.T) { sanity.RunNFSThroughTarget(t) }

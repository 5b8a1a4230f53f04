package nfs

import (
	"testing"

	"github.com/modeguard/modeguard/test/sanity"
)

// TestSanityNFSWithFakeKernelMount runs csi-sanity against the NFS backend:
// real ganesha, real storage, the node's kernel NFS mount faked (this
// kernel has no NFS client; test/vm mounts for real).
func TestSanityNFSWithFakeKernelMount(t *testing.T) { sanity.RunNFSWithFakeKernelMount(t) }

//go:build tools

// Package tools pins the external-snapshot-metadata sidecar that
// hack/images/sidecars.sh builds from this module: its version and every
// dependency's are this module's go.mod and go.sum.
package tools

import _ "github.com/kubernetes-csi/external-snapshot-metadata/cmd/csi-snapshot-metadata"

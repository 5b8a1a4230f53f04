//go:build tools

// Package etcdbuild only pins the etcd server that kubeadm runs as a static
// pod in a kind node (the tag kubeadm v1.34 asks for: 3.6.5-0). It is never
// built itself; hack/kind/build.sh compiles the command.
package etcdbuild

import _ "go.etcd.io/etcd/server/v3"

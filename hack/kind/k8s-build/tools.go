//go:build tools

// Package k8sbuild only pins the Kubernetes commands that a kind node needs
// besides the local cluster's (hack/local-cluster/k8s-build): kubeadm, which
// kind runs in its nodes, and kube-proxy, which kubeadm deploys. It is never
// built itself; hack/kind/build.sh compiles the commands.
package k8sbuild

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubeadm"
)

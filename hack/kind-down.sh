#!/usr/bin/env bash
# Deletes the kind cluster of hack/kind-up.sh and its pools.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD_DIR:-$REPO/_build}
CLUSTER=${CLUSTER:-modeguard}
export KIND_EXPERIMENTAL_PROVIDER=podman
[[ -f $BUILD/kind/containers.conf ]] && export CONTAINERS_CONF=$BUILD/kind/containers.conf
if [[ -x $BUILD/kind/parts/bin/kind ]]; then
  "$BUILD/kind/parts/bin/kind" delete cluster --name "$CLUSTER"
fi
if [[ -f $BUILD/kind/made-lib-modules ]]; then
  rmdir /lib/modules 2>/dev/null || true
  rm -f "$BUILD/kind/made-lib-modules"
fi
# The pools' images are the volumes of that cluster: gone with it.
rm -rf "$BUILD/kind/pools" "$BUILD/kind/kubeconfig"

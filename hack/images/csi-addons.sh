#!/usr/bin/env bash
# Builds csi-addons (github.com/csi-addons/kubernetes-csi-addons) from the Go
# module proxy: the csi-addons controller manager and the sidecar, each as an
# image tagged as the chart and the kustomize component name them, exported
# as a docker-archive under _build/images/, and its CRDs copied to
# _build/images/csi-addons/crds for hack/local-cluster/csi-addons-install.sh.
#
#   quay.io/csiaddons/k8s-sidecar:<v>     the chart's csiAddons.image and
#                                         components/csi-addons -> csi-addons-sidecar.tar
#   quay.io/csiaddons/k8s-controller:<v>  what the install script runs -> csi-addons-controller.tar
#
# Both archives are named csi-*.tar, so hack/local-cluster/deploy.sh imports
# them into every node with the other sidecars, and hack/images/check.sh
# checks them.
#
# As in sidecars.sh, the module is built as the main module in a writable
# copy (_build/images/csi-addons/src), so that its go.mod (and any replace
# directive in it) applies; nothing of it enters the repository. The version
# is the chart's csiAddons.image tag (CSI_ADDONS_VERSION overrides it; the
# proxy serves v0.12.0, v0.13.0 and v0.14.0 when asked for exactly, but
# refuses to list versions).
#
# Usage: hack/images/csi-addons.sh [binaries|images|all]   (default all)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/_build/images}
WORK=$OUT/csi-addons
BASE_IMAGE=${BASE_IMAGE:-debian:bookworm-slim}
GO=${GO:-go}
MODULE=github.com/csi-addons/kubernetes-csi-addons
export PATH=/usr/local/go/bin:$PATH

log() { printf '[csi-addons %s] %s\n' "$(date +%T)" "$*" >&2; }

# The sidecar's image as the chart names it; the version built is its tag.
SIDECAR_REF=$(sed -n 's#^  image: {repository: \(quay.io/csiaddons/k8s-sidecar\), tag: \([^,}]*\).*#\1:\2#p' \
  "$ROOT/deploy/helm/modeguard/values.yaml" | head -1)
[[ -n $SIDECAR_REF ]] || { echo "no csiAddons.image in deploy/helm/modeguard/values.yaml" >&2; exit 1; }
VERSION=${CSI_ADDONS_VERSION:-${SIDECAR_REF##*:}}
SIDECAR_REF=${SIDECAR_REF%:*}:$VERSION
CONTROLLER_REF=quay.io/csiaddons/k8s-controller:$VERSION

# name package-in-module
BINARIES=(
  "csi-addons-manager ./cmd/manager"
  "csi-addons-sidecar ./sidecar"
)

binaries() {
  local dir src s name pkg start
  dir=$(GOFLAGS=-mod=mod "$GO" mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $dir ]] || { log "$MODULE@$VERSION: not downloadable from the proxy"; return 1; }
  src=$WORK/src/$VERSION
  if [[ ! -f $src/go.mod ]]; then
    rm -rf "$src"; mkdir -p "$WORK/src"
    cp -r "$dir" "$src"; chmod -R u+w "$src"
  fi
  mkdir -p "$WORK/bin"
  for s in "${BINARIES[@]}"; do
    read -r name pkg <<<"$s"
    if [[ -x $WORK/bin/$name && $(cat "$WORK/bin/$name.version" 2>/dev/null) == "$VERSION" ]]; then
      log "$name $VERSION: built already"; continue
    fi
    log "building $name from $MODULE@$VERSION ($pkg)"
    start=$(date +%s)
    # One package at a time: the second finds the first's dependencies in
    # Go's build cache. -p 2: this machine has two cores.
    (cd "$src" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local \
       "$GO" build -p 2 -trimpath \
       -ldflags "-s -w -X $MODULE/internal/version.Version=$VERSION" \
       -o "$WORK/bin/$name" "$pkg")
    echo "$VERSION" >"$WORK/bin/$name.version"
    log "$name built in $(( $(date +%s) - start )) s"
  done
  # The CRDs the controller serves (NetworkFence and NetworkFenceClass among
  # them), as the module generates them.
  rm -rf "$WORK/crds"; mkdir -p "$WORK/crds"
  cp "$src"/config/crd/bases/*.yaml "$WORK/crds/"
  echo "$VERSION" >"$WORK/crds/VERSION"
  log "CRDs -> $WORK/crds ($(ls "$WORK"/crds/*.yaml | wc -l) files)"
}

# shellcheck source=binary-image.sh
source "$ROOT/hack/images/binary-image.sh"

# image name ref entrypoint archive
image() {
  local name=$1 ref=$2 entry=$3 archive=$4
  [[ -x $WORK/bin/$name ]] || { log "no binary $name: run '$0 binaries'"; return 1; }
  binary_image "$WORK/bin/$name" "$entry" "$ref" "$archive" "$VERSION" "$MODULE"
}

images() {
  command -v buildah >/dev/null || { echo "needs buildah (apt-get install buildah)" >&2; exit 1; }
  # crun fails on this cgroup-v1 host; chroot isolation needs no runtime.
  export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
  buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1 ||
    { echo "base image $BASE_IMAGE missing: run hack/images/base.sh" >&2; exit 1; }
  # The paths upstream's images use: the chart gives the sidecar no command,
  # and the install script runs the manager by its path.
  image csi-addons-sidecar "$SIDECAR_REF" /usr/sbin/csi-addons-sidecar "$OUT/csi-addons-sidecar.tar"
  image csi-addons-manager "$CONTROLLER_REF" /csi-addons-manager "$OUT/csi-addons-controller.tar"
}

case ${1:-all} in
  binaries) binaries ;;
  images) images ;;
  all) binaries; images ;;
  *) echo "usage: $0 [binaries|images|all]" >&2; exit 2 ;;
esac

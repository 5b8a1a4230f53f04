#!/usr/bin/env bash
# Builds the CSI sidecars the manifests use from the Go module proxy (no
# container registry here) and wraps each in an image tagged exactly as
# deploy/kubernetes/base/controller.yaml names it, exported as a
# docker-archive under _build/images/.
#
# Each sidecar's module is downloaded from the proxy and built as the main
# module (in a writable copy under _build/images/sidecars/src), so the
# replace directives of its go.mod apply. Nothing is vendored into the repo.
#
# Not on the proxy, so NOT built here: csi-node-driver-registrar and
# livenessprobe (see hack/images/README.md).
#
# csi-snapshot-metadata (external-snapshot-metadata) is built from a module
# of this repository, hack/snapshot-metadata, whose go.mod and go.sum pin it
# and every dependency: its own go.mod replaces its client module with
# ./client, and the proxy has no client module of the same version to put
# there (v0.2.0 needs client v0.1.0), so it cannot be built as the main
# module like the others. Its image tag is the chart's
# (snapshotMetadata.image), which components/snapshot-metadata of
# deploy/kubernetes names too; its CRD (SnapshotMetadataService) goes to
# crds/ with the others.
#
# Also from external-snapshotter, for the local cluster (hack/local-cluster),
# which runs them itself as parts of the cluster rather than of the driver:
# the snapshot-controller binary (no image) and the snapshot CRDs, copied
# from the client module to _build/images/sidecars/crds.
#
# Usage: hack/images/sidecars.sh [binaries|images|all]   (default all)
# Versions can be overridden: PROVISIONER_VERSION=v6.4.0 ATTACHER_VERSION=...
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/_build/images}
WORK=$OUT/sidecars
BASE_IMAGE=${BASE_IMAGE:-debian:bookworm-slim}
GO=${GO:-go}
export PATH=/usr/local/go/bin:$PATH

# Built version (from the proxy) per sidecar. The image tag is read from the
# manifest; where the two differ the script says so.
# The newest each module's version list on the proxy names (all four
# build against client-go v0.37, which they then share in Go's build cache).
PROVISIONER_VERSION=${PROVISIONER_VERSION:-v6.4.0}
ATTACHER_VERSION=${ATTACHER_VERSION:-v4.13.0}
RESIZER_VERSION=${RESIZER_VERSION:-v2.3.0}
SNAPSHOTTER_VERSION=${SNAPSHOTTER_VERSION:-v8.7.0}

# name module major-path version
SIDECARS=(
  "csi-provisioner github.com/kubernetes-csi/external-provisioner/v6 $PROVISIONER_VERSION"
  "csi-attacher github.com/kubernetes-csi/external-attacher/v4 $ATTACHER_VERSION"
  "csi-resizer github.com/kubernetes-csi/external-resizer/v2 $RESIZER_VERSION"
  "csi-snapshotter github.com/kubernetes-csi/external-snapshotter/v8 $SNAPSHOTTER_VERSION"
  "snapshot-controller github.com/kubernetes-csi/external-snapshotter/v8 $SNAPSHOTTER_VERSION"
)
# Built, but run by hack/local-cluster/up.sh as a process: no image.
NO_IMAGE=" snapshot-controller "

log() { printf '[sidecars %s] %s\n' "$(date +%T)" "$*" >&2; }

# The built sidecars live in the machine's cache (hack/cache.sh), keyed by
# this script (their versions), hack/snapshot-metadata's pins and the Go
# toolchain.
# shellcheck source=../cache.sh
source "$ROOT/hack/cache.sh"
# shellcheck source=binary-image.sh
source "$ROOT/hack/images/binary-image.sh"
SNAPSHOT_METADATA_MODULE=$ROOT/hack/snapshot-metadata
cache_dir sidecars "$WORK" "${BASH_SOURCE[0]}" "$SNAPSHOT_METADATA_MODULE/go.mod" "$SNAPSHOT_METADATA_MODULE/go.sum"

# The tag the manifests expect for registry.k8s.io/sig-storage/<name>; for a
# sidecar the kustomize base does not run, the chart's default.
manifest_ref() {
  local name=$1 ref
  ref=$(grep -ho "registry.k8s.io/sig-storage/$name:[^\" ]*" \
    "$ROOT"/deploy/kubernetes/base/controller.yaml "$ROOT"/deploy/kubernetes/base/node/daemonset.yaml | head -1)
  [[ -n $ref ]] || ref=$(sed -n "s#.*repository: \(registry.k8s.io/sig-storage/$name\), tag: \([^,}]*\).*#\1:\2#p" \
    "$ROOT"/deploy/helm/modeguard/values.yaml | head -1)
  [[ -n $ref ]] || { echo "no image for $name in the manifests" >&2; return 1; }
  echo "$ref"
}

moddir() { # module version -> directory in the module cache (downloads it)
  GOFLAGS=-mod=mod "$GO" mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'
}

build_one() {
  local name=$1 mod=$2 ver=$3 dir src
  dir=$(moddir "$mod" "$ver")
  [[ -d $dir ]] || { log "$mod@$ver: not downloadable from the proxy"; return 1; }
  src=$WORK/src/$name@$ver
  if [[ ! -f $src/go.mod ]]; then
    rm -rf "$src"; mkdir -p "$WORK/src"
    cp -r "$dir" "$src"; chmod -R u+w "$src"
    # external-snapshotter replaces its client module with ./client, which a
    # module zip leaves out (it is a module of its own): put the same-version
    # client module there.
    if grep -q '=> ./client' "$src/go.mod"; then
      local cmod cdir
      cmod=$(sed -n 's/^replace \(.*\) => .\/client$/\1/p' "$src/go.mod")
      cdir=$(moddir "$cmod" "$ver")
      [[ -d $cdir ]] || { log "$cmod@$ver not on the proxy"; return 1; }
      cp -r "$cdir" "$src/client"; chmod -R u+w "$src/client"
    fi
  fi
  log "building $name from $mod@$ver"
  (cd "$src" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local \
     "$GO" build -trimpath -ldflags "-s -w -X main.version=$ver" -o "$WORK/bin/$name" "./cmd/$name")
  echo "$ver" >"$WORK/bin/$name.version"
}

# The version of module $1 that hack/snapshot-metadata requires.
pinned() {
  (cd "$SNAPSHOT_METADATA_MODULE" && GOFLAGS=-mod=mod "$GO" list -m -f '{{.Version}}' "$1")
}

build_snapshot_metadata() {
  local mod=github.com/kubernetes-csi/external-snapshot-metadata ver
  ver=$(pinned "$mod") || { log "hack/snapshot-metadata: no $mod"; return 1; }
  if [[ -x $WORK/bin/csi-snapshot-metadata && $(cat "$WORK/bin/csi-snapshot-metadata.version" 2>/dev/null) == "$ver" ]]; then
    log "csi-snapshot-metadata $ver: cached"
  else
    log "building csi-snapshot-metadata from $mod@$ver (hack/snapshot-metadata)"
    (cd "$SNAPSHOT_METADATA_MODULE" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local \
       "$GO" build -trimpath -ldflags "-s -w -X main.version=$ver" -o "$WORK/bin/csi-snapshot-metadata" "$mod/cmd/csi-snapshot-metadata") ||
      return 1
    echo "$ver" >"$WORK/bin/csi-snapshot-metadata.version"
  fi
  local cdir
  cdir=$(moddir "$mod/client" "$(pinned "$mod/client")")
  [[ -f $cdir/config/crd/cbt.storage.k8s.io_snapshotmetadataservices.yaml ]] ||
    { log "no SnapshotMetadataService CRD in $mod/client"; return 1; }
  mkdir -p "$WORK/crds"
  cp "$cdir/config/crd/cbt.storage.k8s.io_snapshotmetadataservices.yaml" "$WORK/crds/"
  chmod u+w "$WORK"/crds/*.yaml
}

binaries() {
  mkdir -p "$WORK/bin"
  local s name mod ver rc=0
  for s in "${SIDECARS[@]}"; do
    read -r name mod ver <<<"$s"
    if [[ -x $WORK/bin/$name && $(cat "$WORK/bin/$name.version" 2>/dev/null) == "$ver" ]]; then
      log "$name $ver: cached"; continue
    fi
    build_one "$name" "$mod" "$ver" || { log "FAILED: $name $ver"; rc=1; }
  done
  build_snapshot_metadata || { log "FAILED: csi-snapshot-metadata"; rc=1; }
  crds || rc=1
  return $rc
}

# The snapshot.storage.k8s.io and groupsnapshot.storage.k8s.io CRDs of the
# snapshotter's client module.
crds() {
  local cdir
  cdir=$(moddir github.com/kubernetes-csi/external-snapshotter/client/v8 "$SNAPSHOTTER_VERSION")
  [[ -d $cdir/config/crd ]] || { log "no CRDs in client/v8@$SNAPSHOTTER_VERSION"; return 1; }
  mkdir -p "$WORK/crds"
  cp "$cdir"/config/crd/snapshot.storage.k8s.io_*.yaml "$cdir"/config/crd/groupsnapshot.storage.k8s.io_*.yaml "$WORK/crds/"
  chmod u+w "$WORK"/crds/*.yaml
}

images() {
  command -v buildah >/dev/null || { echo "needs buildah (apt-get install buildah)" >&2; exit 1; }
  # crun fails on this cgroup-v1 host; chroot isolation needs no runtime.
  export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
  buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1 ||
    { echo "base image $BASE_IMAGE missing: run hack/images/base.sh" >&2; exit 1; }
  local s name mod ver ref tag
  for s in "${SIDECARS[@]}" \
    "csi-snapshot-metadata github.com/kubernetes-csi/external-snapshot-metadata $(cat "$WORK/bin/csi-snapshot-metadata.version" 2>/dev/null)"; do
    read -r name mod ver <<<"$s"
    [[ $NO_IMAGE == *" $name "* ]] && continue
    [[ -x $WORK/bin/$name ]] || { log "no binary for $name, skipped"; continue; }
    ref=$(manifest_ref "$name"); tag=${ref##*:}
    [[ $tag == "$ver" ]] || log "NOTE: $ref holds $name $ver (the manifest's tag is $tag)"
    binary_image "$WORK/bin/$name" "/$name" "$ref" "$OUT/$name.tar" "$ver" "$mod"
  done
}

case ${1:-all} in
  binaries) binaries ;;
  images) images ;;
  all) binaries || true; images ;;
  *) echo "usage: $0 [binaries|images|all]" >&2; exit 2 ;;
esac

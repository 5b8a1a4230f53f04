#!/usr/bin/env bash
# Builds the pieces of a local, kind-less Kubernetes cluster into _build/:
#   _build/k8s/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kubectl}
#     at hack/local-cluster/k8s-version.sh's version, compiled from the Go module proxy through the scratch module in
#     hack/local-cluster/k8s-build (never the repository's root go.mod);
#   _build/debs/root/usr/bin/{etcd,etcdctl,containerd,containerd-shim-runc-v2,ctr,runc,busybox}
#     unpacked from Debian .debs (apt-get download + dpkg-deb -x, nothing installed system-wide);
#   _build/cni/bin/modeguard-veth, the tiny CNI plugin (shell) from hack/local-cluster/cni.
# Everything is cached: a binary that is already present is not rebuilt (FORCE=1 rebuilds);
# Kubernetes' binaries in the machine's cache (hack/cache.sh), for every clone.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
# shellcheck source=k8s-version.sh
source "$HERE/k8s-version.sh"
K8S_BIN="$BUILD/k8s/bin"
DEBS="$BUILD/debs"
FORCE="${FORCE:-0}"

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Kubernetes' binaries live in the machine's cache (hack/cache.sh), keyed by
# what they are built from.
# shellcheck source=../cache.sh
source "$REPO/hack/cache.sh"
cache_dir k8s "$BUILD/k8s" "$HERE/k8s-version.sh" "$HERE"/k8s-build/go.mod "$HERE"/k8s-build/go.sum "$HERE"/k8s-build/*.go "${BASH_SOURCE[0]}"
mkdir -p "$K8S_BIN" "$DEBS/pkgs" "$DEBS/root" "$BUILD/cni/bin"

# --- Debian packages -------------------------------------------------------
# name of the .deb -> a file it must provide once unpacked
declare -A DEB_WANT=(
  [etcd-server]=usr/bin/etcd
  [etcd-client]=usr/bin/etcdctl
  [containerd]=usr/bin/containerd
  [runc]=usr/sbin/runc
  [busybox-static]=bin/busybox
)
need_debs=()
for p in "${!DEB_WANT[@]}"; do
  if [[ "$FORCE" == 1 || ! -e "$DEBS/root/${DEB_WANT[$p]}" ]]; then need_debs+=("$p"); fi
done
if ((${#need_debs[@]})); then
  log "downloading Debian packages: ${need_debs[*]}"
  if ! (cd "$DEBS/pkgs" && apt-get download "${need_debs[@]}"); then
    log "apt-get download failed; refreshing package lists once"
    apt-get update -qq
    (cd "$DEBS/pkgs" && apt-get download "${need_debs[@]}")
  fi
  for p in "${need_debs[@]}"; do
    deb=$(ls -t "$DEBS/pkgs/${p}_"*.deb | head -1)
    log "unpacking $(basename "$deb")"
    dpkg-deb -x "$deb" "$DEBS/root"
  done
else
  log "Debian packages already unpacked in $DEBS/root"
fi
# runc lives in /usr/sbin; give every tool one bin dir.
mkdir -p "$DEBS/bin"
for f in usr/bin/etcd usr/bin/etcdctl usr/bin/containerd usr/bin/containerd-shim-runc-v2 \
         usr/bin/ctr usr/sbin/runc bin/busybox; do
  [[ -e "$DEBS/root/$f" ]] || { echo "missing $DEBS/root/$f after unpacking" >&2; exit 1; }
  ln -sf "$DEBS/root/$f" "$DEBS/bin/$(basename "$f")"
done

# --- Kubernetes --------------------------------------------------------------
CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
# The binaries of another version (k8s-version.sh changed) are all rebuilt.
built_version=$(cat "$K8S_BIN/VERSION" 2>/dev/null || true)
missing=()
for c in "${CMDS[@]}"; do
  if [[ "$FORCE" == 1 || "$built_version" != "$K8S_VERSION" || ! -x "$K8S_BIN/$c" ]]; then missing+=("$c"); fi
done
if ((${#missing[@]} == 0)); then
  log "Kubernetes $K8S_VERSION binaries already in $K8S_BIN"
else
(
cd "$HERE/k8s-build"
if [[ ! -s go.sum ]]; then
  log "resolving modules (go mod tidy)"
  go mod tidy
fi
pkgs=()
for c in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
log "building ${missing[*]} ($K8S_VERSION); about 8 minutes cold on 2 cores"
start=$(date +%s)
rm -f "$K8S_BIN/VERSION"
CGO_ENABLED=0 go build -trimpath -ldflags "$K8S_LDFLAGS" -o "$K8S_BIN/" "${pkgs[@]}"
echo "$K8S_VERSION" > "$K8S_BIN/VERSION"
log "Kubernetes build took $(( $(date +%s) - start )) s"
ls -l "$K8S_BIN"
)
fi

# --- tiny CNI plugin (a shell script) ---------------------------------------------
install -m 0755 "$HERE/cni/modeguard-veth" "$BUILD/cni/bin/modeguard-veth"
# containerd's CRI plugin always invokes a plugin named "loopback" too: the same script.
install -m 0755 "$HERE/cni/modeguard-veth" "$BUILD/cni/bin/loopback"
log "done"

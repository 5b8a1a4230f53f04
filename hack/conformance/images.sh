#!/usr/bin/env bash
# The images Kubernetes' storage e2e suites run, made without a registry and
# imported into the containerd of every node of the local cluster (whose pods
# cannot pull; the suites use IfNotPresent, so an image with the right name is
# used as it is):
#   e2e-test-images/busybox:1.37.0-1   Debian's busybox-static (almost every spec)
#   e2e-test-images/nginx:1.14-4       the same busybox (the exec spec runs /bin/sh)
#   e2e-test-images/agnhost:2.56       agnhost built from k8s.io/kubernetes (build.sh)
#                                      on busybox (hostexec pods, subPath)
#   e2e-test-images/jessie-dnsutils:1.7  a Debian rootfs (multiVolume's block specs
#                                      run GNU dd oflag=nocache, sha256sum, blockdev)
# Built into _build/conformance/images/, rebuilt only when an input is newer.
#   IMPORT=0   only build the archives: the VM cluster's nodes get them on
#              their node disk (vm-seed.sh, SEED_EXTRA), not from here
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
OUT="$BUILD/conformance/images"
BUSYBOX="$BUILD/debs/root/bin/busybox"
AGNHOST="$BUILD/conformance/bin/agnhost"
DEBIAN="$BUILD/images/base/debian-bookworm-minbase.tar"
REG=registry.k8s.io/e2e-test-images
log() { printf '[conformance-images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# shellcheck source=../local-cluster/archive.sh
source "$REPO/hack/local-cluster/archive.sh"

for f in "$BUSYBOX" "$AGNHOST" "$DEBIAN"; do
  [[ -s "$f" ]] || { echo "missing $f: run hack/local-cluster/build.sh, hack/conformance/build.sh and hack/images/base.sh first" >&2; exit 1; }
done
mkdir -p "$OUT"

# fresh OUT INPUTS...: the archive exists and is newer than every input.
fresh() {
  local out=$1 in; shift
  [[ -s "$out" ]] || return 1
  for in in "$@" "${BASH_SOURCE[0]}" "$REPO/hack/local-cluster/archive.sh"; do
    [[ "$out" -nt "$in" ]] || return 1
  done
}

if ! fresh "$OUT/busybox.tar" "$BUSYBOX"; then
  root=$(mktemp -d "$OUT/rootfs.XXXXXX")
  busybox_rootfs "$root" "$BUSYBOX"
  docker_archive "$OUT/busybox.tar" "$REG/busybox:1.37.0-1" 'null' '["/bin/sh"]' "$root" "$REG/nginx:1.14-4"
  rm -rf "$root"
fi
if ! fresh "$OUT/agnhost.tar" "$BUSYBOX" "$AGNHOST"; then
  root=$(mktemp -d "$OUT/rootfs.XXXXXX")
  busybox_rootfs "$root" "$BUSYBOX"
  install -m 0755 "$AGNHOST" "$root/agnhost"
  docker_archive "$OUT/agnhost.tar" "$REG/agnhost:2.56" '["/agnhost"]' '["pause"]' "$root"
  rm -rf "$root"
fi
if ! fresh "$OUT/jessie-dnsutils.tar" "$DEBIAN"; then
  root=$(mktemp -d "$OUT/rootfs.XXXXXX")
  tar -C "$root" -xf "$DEBIAN"
  docker_archive "$OUT/jessie-dnsutils.tar" "$REG/jessie-dnsutils:1.7" 'null' '["/bin/sh"]' "$root"
  rm -rf "$root"
fi

[[ "${IMPORT:-1}" == 1 ]] || { ls "$OUT"/*.tar; exit 0; }

# Import into every running node's containerd.
CTR="$BUILD/debs/bin/ctr"
socks=("$BUILD"/cluster/nodes/*/containerd/containerd.sock)
[[ -S "${socks[0]}" ]] || { echo "no node's containerd is running: bring the cluster up first" >&2; exit 1; }
pids=()
for s in "${socks[@]}"; do
  (
    for t in "$OUT"/*.tar; do
      "$CTR" --address "$s" -n k8s.io images import "$t" >/dev/null || { echo "importing $t into $s failed" >&2; exit 1; }
    done
  ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
log "imported $(ls "$OUT"/*.tar | wc -l) images into ${#socks[@]} nodes"

#!/usr/bin/env bash
# Builds two docker-archive images by hand from Debian's busybox-static (no registry, no Docker):
#   _build/local-cluster-images/pause.tar    tagged registry.k8s.io/pause:3.10 (a shell that sleeps, exits on TERM)
#   _build/local-cluster-images/busybox.tar  tagged localhost/modeguard/busybox:test (busybox applets in /bin)
# and, when a containerd socket is given as $1, imports both into containerd namespace k8s.io.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
BUSYBOX="$BUILD/debs/root/bin/busybox"
OUT="$BUILD/local-cluster-images"  # not _build/images: hack/images owns that
[[ -x "$BUSYBOX" ]] || { echo "no $BUSYBOX: run hack/local-cluster/build.sh first" >&2; exit 1; }
mkdir -p "$OUT"

# shellcheck source=archive.sh
source "$HERE/archive.sh"

# make_image NAME TAG ENTRYPOINT_JSON CMD_JSON
make_image() {
  local name=$1 tag=$2 entry=$3 cmd=$4 work="$OUT/$1.rootfs"
  if [[ -s "$OUT/$name.tar" && "$OUT/$name.tar" -nt "$BUSYBOX" && "$OUT/$name.tar" -nt "${BASH_SOURCE[0]}" \
        && "$OUT/$name.tar" -nt "$HERE/archive.sh" ]]; then
    return 0
  fi
  rm -rf "$work"
  busybox_rootfs "$work" "$BUSYBOX"
  docker_archive "$OUT/$name.tar" "$tag" "$entry" "$cmd" "$work"
  rm -rf "$work"
}

make_image pause registry.k8s.io/pause:3.10 \
  '["/bin/sh","-c","trap \"exit 0\" TERM INT; while true; do sleep 3600 & wait $!; done"]' 'null'
make_image busybox localhost/modeguard/busybox:test 'null' '["/bin/sh"]'

if [[ $# -ge 1 ]]; then
  CTR="$BUILD/debs/bin/ctr"
  for i in pause busybox; do
    "$CTR" --address "$1" -n k8s.io images import "$OUT/$i.tar" >/dev/null
  done
  "$CTR" --address "$1" -n k8s.io images ls -q | grep -E 'pause|busybox'
fi

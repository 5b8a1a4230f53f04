#!/usr/bin/env bash
# Makes the node disk every worker VM of vm-up.sh starts from: a sparse ext4 image whose
# containerd root (node/containerd/root, where vm-node.sh points the VM's containerd) holds
# every image the nodes run, imported and unpacked (overlayfs) on the host, natively, by a
# containerd of the same version that serves no CRI. In a VM under software emulation one
# CPU takes minutes to unpack the driver's and the sidecars' images; here it takes seconds,
# and each VM then starts from a copy of the image (vmcluster up -disk-seed).
#
# Prints the image's path. It is kept in _build/vm-node-seed/ under a key of the archives'
# names, sizes and times and of this script, and made anew when one of them changes.
#   VM_DISK_MB=8192   the disk's size (sparse: only what it holds takes space)
#   SEED_EXTRA=""     more image archives for the nodes, separated by spaces: Kubernetes'
#                     storage suites' images (make conformance-vm)
# Needs: root, hack/local-cluster/build.sh and hack/images run first.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_TAG=vm-seed
NODES=""
# shellcheck source=lib.sh
source "$HERE/lib.sh"
VM_DISK_MB="${VM_DISK_MB:-8192}"
OUT="$BUILD/vm-node-seed"

"$HERE/images.sh" >/dev/null # pause and busybox
archives=("$BUILD"/local-cluster-images/pause.tar "$BUILD"/local-cluster-images/busybox.tar
  "$BUILD"/images/modeguard.tar "$BUILD"/images/csi-*.tar)
read -r -a extra <<<"${SEED_EXTRA:-}"
archives+=("${extra[@]}")
for a in "${archives[@]}"; do [[ -s "$a" ]] || die "no image archive $a: run hack/images first"; done
key=$({ stat -L -c '%n %s %Y' "${archives[@]}"; echo "$VM_DISK_MB"; sha256sum <"${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)
img="$OUT/node-$key.img"
if [[ -s "$img" ]]; then
  echo "$img"
  exit 0
fi
mkdir -p "$OUT"
rm -f "$OUT"/node-*.img "$OUT"/node-*.img.tmp

t0=$(date +%s)
tmp="$img.tmp" work=$(mktemp -d "$OUT/work.XXXXXX")
mnt="$work/mnt" pid=""
cleanup() {
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  fi
  mountpoint -q "$mnt" && umount "$mnt"
  rm -rf "$work" "$tmp"
}
trap cleanup EXIT
truncate -s "${VM_DISK_MB}M" "$tmp"
mkfs.ext4 -q -F "$tmp"
mkdir -p "$mnt"
mount -o loop "$tmp" "$mnt"
root="$mnt/node/containerd/root" sock="$work/containerd.sock"
mkdir -p "$root"
containerd_config "$root" "$work/state" "$sock" "$work/opt" >"$work/config.toml"
containerd --config "$work/config.toml" >"$work/containerd.log" 2>&1 &
pid=$!
wait_for "the seed's containerd" 60 ctr --address "$sock" version
for a in "${archives[@]}"; do
  ctr --address "$sock" -n k8s.io images import --snapshotter overlayfs "$a" >/dev/null || die "importing $a"
done
n=$(ctr --address "$sock" -n k8s.io images ls -q | wc -l)
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=""
used=$(df -m --output=used "$mnt" | tail -1)
umount "$mnt"
mv "$tmp" "$img"
log "node disk seed $img: $n images, ${used// /} MiB used, made in $(($(date +%s) - t0)) s" >&2
echo "$img"

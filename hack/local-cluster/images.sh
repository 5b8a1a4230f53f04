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

# make_image NAME TAG ENTRYPOINT_JSON CMD_JSON
make_image() {
  local name=$1 tag=$2 entry=$3 cmd=$4 work="$OUT/$1.work"
  if [[ -s "$OUT/$name.tar" && "$OUT/$name.tar" -nt "$BUSYBOX" && "$OUT/$name.tar" -nt "${BASH_SOURCE[0]}" ]]; then
    return 0
  fi
  rm -rf "$work"; mkdir -p "$work/rootfs"/{bin,etc,tmp,proc,sys,dev,root,var/run}
  chmod 1777 "$work/rootfs/tmp"
  cp "$BUSYBOX" "$work/rootfs/bin/busybox"
  local a
  for a in $("$BUSYBOX" --list); do
    [[ "$a" == busybox ]] || ln -sf busybox "$work/rootfs/bin/$a"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$work/rootfs/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$work/rootfs/etc/group"
  tar --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -C "$work/rootfs" -cf "$work/layer.tar" .
  local diff; diff=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
  cat >"$work/config.json" <<JSON
{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z",
 "config":{"Env":["PATH=/bin"],"Entrypoint":$entry,"Cmd":$cmd,"WorkingDir":"/"},
 "rootfs":{"type":"layers","diff_ids":["sha256:$diff"]}}
JSON
  local cfg; cfg=$(sha256sum "$work/config.json" | cut -d' ' -f1)
  mv "$work/config.json" "$work/$cfg.json"
  mkdir -p "$work/$diff"; mv "$work/layer.tar" "$work/$diff/layer.tar"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]\n' "$cfg" "$tag" "$diff" >"$work/manifest.json"
  tar --numeric-owner --owner=0 --group=0 -C "$work" -cf "$OUT/$name.tar.tmp" manifest.json "$cfg.json" "$diff"
  mv "$OUT/$name.tar.tmp" "$OUT/$name.tar"
  rm -rf "$work"
  echo "built $OUT/$name.tar ($tag)"
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

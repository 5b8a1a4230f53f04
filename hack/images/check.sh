#!/usr/bin/env bash
# Checks the docker-archives in _build/images/: each is a tar holding
# manifest.json, with the repo tags it claims, and the driver's image holds
# the mkfs programs the driver runs. With CTR_IMPORT=1 (default 1
# when a ctr/containerd binary is around) it also starts a throw-away
# containerd (own root, state and socket under _build/images/check-containerd,
# CRI plugin off) and imports every archive into namespace k8s.io.
# containerd/ctr come from Debian's containerd package, extracted (not
# installed) into _build/images/containerd/root.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/_build/images}
fail=0
archives=()
# Only the archives these scripts make (others may drop files here too).
for a in "$OUT"/modeguard.tar "$OUT"/csi-*.tar; do
  [[ -f $a ]] || continue
  archives+=("$a")
  if tags=$(tar -xOf "$a" manifest.json 2>/dev/null | python3 -c \
      'import json,sys; m=json.load(sys.stdin); print(" ".join(t for e in m for t in (e.get("RepoTags") or [])))'); then
    printf 'OK   %-28s %6s  %s\n' "$(basename "$a")" "$(du -h "$a" | cut -f1)" "$tags"
  else
    printf 'FAIL %-28s no readable manifest.json\n' "$(basename "$a")"; fail=1
  fi
done

# The driver's image must hold the mkfs of every filesystem the driver
# makes: ext4 and xfs volumes, the kept btrfs (auto, btrfs) and the kept
# xfs (auto without btrfs, xfs) of the block pools. A package missing
# from the Dockerfile would show only when a pod first needs it.
if [[ -f $OUT/modeguard.tar ]]; then
  layers=$(mktemp -d)
  listing=$layers/files
  for l in $(tar -xOf "$OUT/modeguard.tar" manifest.json | python3 -c \
      'import json,sys; print("\n".join(l for e in json.load(sys.stdin) for l in e["Layers"]))'); do
    tar -xOf "$OUT/modeguard.tar" "$l" >"$layers/layer" && tar -tf "$layers/layer" >>"$listing" 2>/dev/null || true
  done
  for tool in mkfs.ext4 mkfs.xfs mkfs.btrfs; do
    if grep -qE "(^|/)sbin/$tool\$" "$listing"; then
      printf 'OK   %-28s holds %s\n' modeguard.tar "$tool"
    else
      printf 'FAIL %-28s lacks %s\n' modeguard.tar "$tool"; fail=1
    fi
  done
  rm -rf "$layers"
fi

CT=$OUT/containerd/root/usr/bin
if [[ ${CTR_IMPORT:-1} == 1 && ! -x $CT/ctr ]]; then
  (mkdir -p "$OUT/containerd" && cd "$OUT/containerd" && apt-get download containerd >/dev/null 2>&1 &&
    dpkg-deb -x containerd_*.deb root) || true
fi
if [[ ${CTR_IMPORT:-1} == 1 && -x $CT/ctr ]]; then
  D=$OUT/check-containerd
  rm -rf "$D"; mkdir -p "$D"
  cat >"$D/config.toml" <<CFG
version = 2
root = "$D/root"
state = "$D/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$D/containerd.sock"
[ttrpc]
  address = "$D/containerd.sock.ttrpc"
CFG
  "$CT/containerd" --config "$D/config.toml" >"$D/containerd.log" 2>&1 &
  cpid=$!
  trap 'kill $cpid 2>/dev/null; wait $cpid 2>/dev/null || true' EXIT
  for _ in $(seq 50); do [[ -S $D/containerd.sock ]] && break; sleep 0.2; done
  for a in "${archives[@]}"; do
    if "$CT/ctr" -a "$D/containerd.sock" -n k8s.io images import "$a" >"$D/import.log" 2>&1; then
      echo "IMPORTED $(basename "$a"): $(awk '{print $2}' "$D/import.log" | tr '\n' ' ')"
    else
      echo "IMPORT FAILED $(basename "$a"):"; cat "$D/import.log"; fail=1
    fi
  done
  "$CT/ctr" -a "$D/containerd.sock" -n k8s.io images ls -q
fi
exit $fail

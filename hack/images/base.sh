#!/usr/bin/env bash
# Makes, locally and without any container registry, the two base images the
# Dockerfile names:
#   debian:bookworm-slim  - a debootstrap --variant=minbase bookworm rootfs
#   golang:1.26-bookworm  - that rootfs + ca-certificates + git + the host's
#                           /usr/local/go (GOPATH=/go, PATH set)
# Both are stored in buildah's (rootful) storage under the short name and the
# docker.io/library/ name, so `buildah bud` / `buildah from --pull=never` find
# them. The rootfs tarball is cached in _build/images/base, a directory of
# the machine's cache (hack/cache.sh), and each image is made again only when
# its inputs changed (FORCE=1 makes everything again).
#
# Needs root. Installs debootstrap and buildah with apt-get if missing.
# Usage: hack/images/base.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/_build/images}
SUITE=bookworm
# The mirror apt uses here (deb822 or one-line sources), else deb.debian.org.
MIRROR=${MIRROR:-$( (grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources; grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print "URIs: "$2}') \
  | awk '{print $2}' | grep -E '/debian/?$' | head -1 || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-${MIRROR%/debian*}/debian-security}
GOROOT_HOST=${GOROOT_HOST:-/usr/local/go}
GO_TAG=${GO_TAG:-1.26-bookworm}

# crun here fails with "cgroups in hybrid mode not supported" (cgroup v1
# host); chroot isolation needs no OCI runtime and shares the host network.
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}

log() { printf '[base %s] %s\n' "$(date +%T)" "$*" >&2; }
[[ $(id -u) == 0 ]] || { echo "run as root" >&2; exit 1; }

need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v buildah >/dev/null || need+=(buildah)
if ((${#need[@]})); then
  log "apt-get install ${need[*]}"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; then
    log "apt-get install failed; refreshing package lists once"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
  fi
fi
mkdir -p "$OUT"
# The rootfs tarball lives in the machine's cache (hack/cache.sh).
# shellcheck source=../cache.sh
source "$ROOT/hack/cache.sh"
cache_dir base-rootfs "$OUT/base" "${BASH_SOURCE[0]}" "$SUITE"
ROOTFS_TAR=$OUT/base/debian-$SUITE-minbase.tar
ctr=
trap '[[ -n $ctr ]] && buildah rm "$ctr" >/dev/null 2>&1' ERR   # no stray working containers

# 1. rootfs tarball (cached)
if [[ ! -s $ROOTFS_TAR || ${FORCE:-0} == 1 ]]; then
  dir=$(mktemp -d "$OUT/rootfs.XXXXXX")
  trap 'rm -rf "$dir"' EXIT
  log "debootstrap --variant=minbase $SUITE from $MIRROR"
  debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 ||
    { tail -20 "$OUT/debootstrap.log" >&2; exit 1; }
  # apt sources like the official image: main, updates and security.
  rm -f "$dir/etc/apt/sources.list"
  cat >"$dir/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # Slim it: no package lists, no downloaded debs, no logs; the host's
  # resolv.conf/hostname are provided by the runtime.
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
    "$dir"/var/log/* "$dir"/tmp/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/* \
    "$dir"/usr/share/info/* "$dir"/usr/share/locale/*
  : >"$dir/etc/resolv.conf"; echo localhost >"$dir/etc/hostname"
  tar --numeric-owner --xattrs -C "$dir" -cf "$ROOTFS_TAR.tmp" .
  mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
  rm -rf "$dir"; trap - EXIT
  log "rootfs: $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1))"
else
  log "rootfs cached: $ROOTFS_TAR"
fi

# The images are made again only when what they are made from changed:
# each carries the key of its inputs as a label. Kept, an image keeps its
# id, and so buildah's cache of the layers built on it (the Dockerfile's
# apt-get and go mod download steps) stays valid.
label_of() { buildah inspect --type image --format '{{index .OCIv1.Config.Labels "io.modeguard.base-key"}}' "$1" 2>/dev/null || true; }
debian_key=$(cache_key "${BASH_SOURCE[0]}" "$SUITE" "$(sha256sum <"$ROOTFS_TAR")")
golang_key=$(cache_key "$debian_key" "$("$GOROOT_HOST/bin/go" version)" "${HOST_CAS:-1}" /usr/local/share/ca-certificates/*.crt)

# 2. debian:bookworm-slim = the rootfs as one layer
if [[ $(label_of "docker.io/library/debian:$SUITE-slim") == "$debian_key" && ${FORCE:-0} != 1 ]]; then
  log "image debian:$SUITE-slim: up to date"
else
log "image debian:$SUITE-slim"
ctr=$(buildah from scratch)
mnt=$(buildah mount "$ctr")
tar --numeric-owner --xattrs -C "$mnt" -xf "$ROOTFS_TAR"
buildah umount "$ctr" >/dev/null
buildah config --os linux --arch amd64 \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd '["bash"]' --label "io.modeguard.base=debootstrap minbase $SUITE" \
  --label "io.modeguard.base-key=$debian_key" "$ctr"
buildah commit --rm -q "$ctr" "docker.io/library/debian:$SUITE-slim" >/dev/null
buildah tag "docker.io/library/debian:$SUITE-slim" "localhost/debian:$SUITE-slim"
fi

# 3. golang:1.26-bookworm = debian + ca-certificates + git + host Go
if [[ $(label_of "docker.io/library/golang:$GO_TAG") == "$golang_key" && ${FORCE:-0} != 1 ]]; then
  log "image golang:$GO_TAG: up to date"
else
log "image golang:$GO_TAG (Go from $GOROOT_HOST: $("$GOROOT_HOST/bin/go" version))"
ctr=$(buildah from --pull=never "docker.io/library/debian:$SUITE-slim")
# This machine's HTTPS egress (Go proxy) is re-signed by a local CA that the
# host trusts via /usr/local/share/ca-certificates; the build stage's
# `go mod download` needs it too. Only this local build image gets it (the
# runtime image never contains it). HOST_CAS=0 to skip.
if [[ ${HOST_CAS:-1} == 1 ]] && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  buildah copy "$ctr" /usr/local/share/ca-certificates/ /usr/local/share/ca-certificates/ >/dev/null
fi
buildah run "$ctr" -- sh -c \
  'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates git >/dev/null && rm -rf /var/lib/apt/lists/*'
mnt=$(buildah mount "$ctr")
mkdir -p "$mnt/usr/local" "$mnt/go/bin" "$mnt/go/src"
cp -a "$GOROOT_HOST" "$mnt/usr/local/go"
buildah umount "$ctr" >/dev/null
buildah config \
  --env GOLANG_VERSION="$("$GOROOT_HOST/bin/go" env GOVERSION | sed 's/^go//')" \
  --env GOTOOLCHAIN=local --env GOPATH=/go \
  --env PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --workingdir /go --cmd '["bash"]' --label "io.modeguard.base-key=$golang_key" "$ctr"
buildah commit --rm -q "$ctr" "docker.io/library/golang:$GO_TAG" >/dev/null
buildah tag "docker.io/library/golang:$GO_TAG" "localhost/golang:$GO_TAG"
fi
# Images a rerun replaced.
buildah rmi --prune >/dev/null 2>&1 || true

buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E "debian:$SUITE-slim|golang:$GO_TAG" >&2

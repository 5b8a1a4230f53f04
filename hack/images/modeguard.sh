#!/usr/bin/env bash
# Builds modeguard:dev from the repo's Dockerfile with buildah, using only
# the local base images made by hack/images/base.sh (--pull=never: there is
# no registry here), and exports it as _build/images/modeguard.tar
# (docker-archive, ready for `ctr -n k8s.io images import`).
#
# Usage: hack/images/modeguard.sh   (IMAGE=modeguard:dev VERSION=dev)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/_build/images}
IMAGE=${IMAGE:-modeguard:dev}
VERSION=${VERSION:-$(git -C "$ROOT" describe --tags --always --dirty 2>/dev/null || echo dev)}
# crun fails here ("cgroups in hybrid mode not supported", cgroup v1 host);
# chroot isolation needs no OCI runtime, and its RUN steps use the host
# network (Debian's mirror and the Go proxy).
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}

for b in debian:bookworm-slim golang:1.26-bookworm; do
  buildah inspect --type image "$b" >/dev/null 2>&1 ||
    { echo "base image $b missing: run hack/images/base.sh" >&2; exit 1; }
done
mkdir -p "$OUT"
cd "$ROOT"
buildah bud --pull=never --layers --force-rm \
  --ignorefile hack/images/dockerignore \
  --build-arg VERSION="$VERSION" -t "$IMAGE" .
rm -f "$OUT/modeguard.tar"
# docker-archive wants a fully qualified-looking reference; keep the short
# name the manifests use (containerd stores it as docker.io/library/modeguard:dev,
# which is what the kubelet looks up for image: modeguard:dev).
buildah push -q "$IMAGE" "docker-archive:$OUT/modeguard.tar:$IMAGE"
echo "$IMAGE -> $OUT/modeguard.tar ($(du -h "$OUT/modeguard.tar" | cut -f1))"

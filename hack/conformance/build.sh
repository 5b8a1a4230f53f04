#!/usr/bin/env bash
# Builds what the conformance run needs from the Go module proxy through a
# scratch module (never the repository's root go.mod):
#   e2e.test  Kubernetes' e2e binary (go test -c k8s.io/kubernetes/test/e2e)
#   ginkgo    the Ginkgo CLI of the same ginkgo version, for parallel runs
#   agnhost   the agnhost test image's binary (hack/conformance/images.sh)
#
#   E2E_VERSION  the Kubernetes version of e2e.test and ginkgo; default the
#                local cluster's (hack/local-cluster/k8s-version.sh), built
#                through e2e-build/ into _build/conformance/bin. Another
#                version is built through e2e-build-$E2E_VERSION/ into
#                _build/conformance/bin-$E2E_VERSION, without agnhost: the
#                volumegroupsnapshottable suite runs with v1.35.4's e2e.test,
#                the first whose driver file names a VolumeGroupSnapshotClass.
#
# Cached: a binary that exists is not rebuilt unless FORCE=1, and the
# directory is in the machine's cache (hack/cache.sh), keyed by what they
# are built from. Cold, the cluster's version takes about 4 minutes with the
# local cluster's build cache, 12 without; v1.35.4, which shares few compiled
# packages with it, took 12.5 minutes (8 minutes of CPU) on a busy 2-core
# machine (docs/conformance.md).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
FORCE="${FORCE:-0}"
# shellcheck source=../local-cluster/k8s-version.sh
source "$REPO/hack/local-cluster/k8s-version.sh"
E2E_VERSION="${E2E_VERSION:-$K8S_VERSION}"
if [[ "$E2E_VERSION" == "$K8S_VERSION" ]]; then
  MOD="$HERE/e2e-build" OUT="$BUILD/conformance/bin" NAME=conformance-bin LDFLAGS="$K8S_LDFLAGS"
else
  MOD="$HERE/e2e-build-$E2E_VERSION" OUT="$BUILD/conformance/bin-$E2E_VERSION" NAME="conformance-bin-$E2E_VERSION"
  [[ -f "$MOD/go.mod" ]] || { echo "no scratch module $MOD for e2e.test $E2E_VERSION" >&2; exit 2; }
  # k8s-version.sh's flags, stamping E2E_VERSION instead.
  minor() { local m=${1#v*.}; echo "${m%%.*}"; }
  LDFLAGS=${K8S_LDFLAGS//$K8S_VERSION/$E2E_VERSION}
  LDFLAGS=${LDFLAGS//gitMinor=$(minor "$K8S_VERSION")/gitMinor=$(minor "$E2E_VERSION")}
fi
log() { printf '[conformance-build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# shellcheck source=../cache.sh
source "$REPO/hack/cache.sh"
cache_dir "$NAME" "$OUT" "$REPO/hack/local-cluster/k8s-version.sh" "$E2E_VERSION" "$MOD"/go.mod "$MOD"/go.sum "$MOD"/*.go "${BASH_SOURCE[0]}"
cd "$MOD"

# Binaries of another version are all rebuilt.
if [[ "$(cat "$OUT/VERSION" 2>/dev/null || true)" != "$E2E_VERSION" ]]; then
  FORCE=1
  rm -f "$OUT/VERSION"
fi
if [[ "$FORCE" == 1 || ! -x "$OUT/e2e.test" ]]; then
  log "building e2e.test ($E2E_VERSION)"
  start=$(date +%s)
  CGO_ENABLED=0 go test -c -trimpath -ldflags "$LDFLAGS" -o "$OUT/e2e.test.tmp" k8s.io/kubernetes/test/e2e
  mv "$OUT/e2e.test.tmp" "$OUT/e2e.test"
  log "e2e.test took $(( $(date +%s) - start )) s"
fi
pkgs=(github.com/onsi/ginkgo/v2/ginkgo)
[[ "$OUT" == "$BUILD/conformance/bin" ]] && pkgs+=(k8s.io/kubernetes/test/images/agnhost)
if [[ "$FORCE" == 1 || ! -x "$OUT/ginkgo" || ( ${#pkgs[@]} == 2 && ! -x "$OUT/agnhost" ) ]]; then
  log "building ${pkgs[*]##*/}"
  CGO_ENABLED=0 go build -trimpath -ldflags "$LDFLAGS" -o "$OUT/" "${pkgs[@]}"
fi
echo "$E2E_VERSION" > "$OUT/VERSION"
log "$(cd "$OUT" && echo *) in $OUT"

#!/usr/bin/env bash
# Builds what the conformance run needs into _build/conformance/bin, from the Go
# module proxy through the scratch module e2e-build/ (never the repository's
# root go.mod), for the local cluster's Kubernetes version (hack/local-cluster/k8s-version.sh):
#   e2e.test  Kubernetes' e2e binary (go test -c k8s.io/kubernetes/test/e2e)
#   ginkgo    the Ginkgo CLI of the same ginkgo version, for parallel runs
#   agnhost   the agnhost test image's binary (hack/conformance/images.sh)
# Cached: a binary that exists is not rebuilt unless FORCE=1, and the
# directory is in the machine's cache (hack/cache.sh), keyed by what they
# are built from. Cold, about 4 minutes with the local cluster's build
# cache, 12 without.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
OUT="$BUILD/conformance/bin"
FORCE="${FORCE:-0}"
# shellcheck source=../local-cluster/k8s-version.sh
source "$REPO/hack/local-cluster/k8s-version.sh"
log() { printf '[conformance-build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# shellcheck source=../cache.sh
source "$REPO/hack/cache.sh"
cache_dir conformance-bin "$OUT" "$REPO/hack/local-cluster/k8s-version.sh" "$HERE"/e2e-build/go.mod "$HERE"/e2e-build/go.sum "$HERE"/e2e-build/*.go "${BASH_SOURCE[0]}"
cd "$HERE/e2e-build"

# Binaries of another version (k8s-version.sh changed) are all rebuilt.
if [[ "$(cat "$OUT/VERSION" 2>/dev/null || true)" != "$K8S_VERSION" ]]; then
  FORCE=1
  rm -f "$OUT/VERSION"
fi
if [[ "$FORCE" == 1 || ! -x "$OUT/e2e.test" ]]; then
  log "building e2e.test ($K8S_VERSION)"
  start=$(date +%s)
  CGO_ENABLED=0 go test -c -trimpath -ldflags "$K8S_LDFLAGS" -o "$OUT/e2e.test.tmp" k8s.io/kubernetes/test/e2e
  mv "$OUT/e2e.test.tmp" "$OUT/e2e.test"
  log "e2e.test took $(( $(date +%s) - start )) s"
fi
if [[ "$FORCE" == 1 || ! -x "$OUT/ginkgo" || ! -x "$OUT/agnhost" ]]; then
  log "building ginkgo and agnhost"
  CGO_ENABLED=0 go build -trimpath -ldflags "$K8S_LDFLAGS" -o "$OUT/" \
    github.com/onsi/ginkgo/v2/ginkgo k8s.io/kubernetes/test/images/agnhost
fi
echo "$K8S_VERSION" > "$OUT/VERSION"
log "e2e.test, ginkgo and agnhost in $OUT"

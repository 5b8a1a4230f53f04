#!/usr/bin/env bash
# A local Kubernetes with modeguard, on kind: one control plane and two
# workers, in zones zone-a and zone-b; then a smoke test (the RWO example).
#
# Needs: docker, kind (v0.20 or later, for node labels), kubectl, make.
#   hack/kind-up.sh            # create (or reuse) the cluster, build, deploy, test
#   kind delete cluster --name modeguard   # when done
#
# Pools. A block pool is a directory per zone that every node of the zone,
# and the controller, must see at the same path. Here each zone's pool is a
# host directory (under _build/kind/pools) bind-mounted into the kind nodes
# with extraMounts: the zone's worker gets its zone's pool, the control plane
# (where the controller runs) gets both. Real clusters use a shared directory
# per zone instead.
#
# Environment: CLUSTER (modeguard), POOL_ROOT (<repo>/_build/kind/pools),
# SNAPSHOTTER_VERSION (v8.7.0: the snapshot CRDs and snapshot-controller),
# IMAGE (modeguard:dev), TIMEOUT_SECONDS (300).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER=${CLUSTER:-modeguard}
POOL_ROOT=${POOL_ROOT:-$REPO/_build/kind/pools}
SNAPSHOTTER_VERSION=${SNAPSHOTTER_VERSION:-v8.7.0}
IMAGE=${IMAGE:-modeguard:dev}
TIMEOUT_SECONDS=${TIMEOUT_SECONDS:-300}
TIMEOUT=${TIMEOUT_SECONDS}s
CONTEXT=kind-$CLUSTER

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'kind-up: %s\n' "$*" >&2; exit 1; }
k() { kubectl --context "$CONTEXT" "$@"; }

for tool in docker kind kubectl make; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed"
done

mkdir -p "$POOL_ROOT/zone-a" "$POOL_ROOT/zone-b"

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "cluster $CLUSTER exists; reusing it"
else
  log "creating kind cluster $CLUSTER (pools under $POOL_ROOT)"
  config=$(mktemp "${TMPDIR:-/tmp}/kind-modeguard.XXXXXX.yaml")
  trap 'rm -f "$config"' EXIT
  cat >"$config" <<YAML
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $POOL_ROOT/zone-a
        containerPath: /var/lib/modeguard/pools/zone-a
      - hostPath: $POOL_ROOT/zone-b
        containerPath: /var/lib/modeguard/pools/zone-b
  - role: worker
    labels:
      topology.kubernetes.io/zone: zone-a
    extraMounts:
      - hostPath: $POOL_ROOT/zone-a
        containerPath: /var/lib/modeguard/pools/zone-a
  - role: worker
    labels:
      topology.kubernetes.io/zone: zone-b
    extraMounts:
      - hostPath: $POOL_ROOT/zone-b
        containerPath: /var/lib/modeguard/pools/zone-b
YAML
  kind create cluster --name "$CLUSTER" --config "$config" --wait "$TIMEOUT"
fi

log "building $IMAGE"
if make -C "$REPO" -n image >/dev/null 2>&1; then
  make -C "$REPO" image
else
  # No image target in this Makefile: build the Dockerfile directly.
  docker build -t "$IMAGE" "$REPO"
fi
kind load docker-image "$IMAGE" --name "$CLUSTER"

log "installing the snapshot CRDs and snapshot-controller ($SNAPSHOTTER_VERSION)"
k apply -k "https://github.com/kubernetes-csi/external-snapshotter/client/config/crd?ref=$SNAPSHOTTER_VERSION"
k wait --for=condition=Established --timeout="$TIMEOUT" \
  crd/volumesnapshotclasses.snapshot.storage.k8s.io \
  crd/volumesnapshotcontents.snapshot.storage.k8s.io \
  crd/volumesnapshots.snapshot.storage.k8s.io
k apply -k "https://github.com/kubernetes-csi/external-snapshotter/deploy/kubernetes/snapshot-controller?ref=$SNAPSHOTTER_VERSION"

# The base (deploy/kubernetes/base) plus the per-zone patch: the overlay adds
# zone-b's pool to the controller, pins the controller to the control plane,
# and adds zone-b's node group.
log "deploying modeguard (deploy/kubernetes/overlays/kind)"
k apply -k "$REPO/deploy/kubernetes/overlays/kind"

log "waiting for rollouts"
k -n kube-system rollout status deployment/snapshot-controller --timeout="$TIMEOUT"
k -n modeguard rollout status deployment/modeguard-controller --timeout="$TIMEOUT"
k -n modeguard rollout status daemonset/modeguard-node-zone-a --timeout="$TIMEOUT"
k -n modeguard rollout status daemonset/modeguard-node-zone-b --timeout="$TIMEOUT"
k get csinodes -o custom-columns='NODE:.metadata.name,DRIVERS:.spec.drivers[*].name,NODEID:.spec.drivers[*].nodeID'

log "smoke test: deploy/examples/rwo-deployment.yaml"
k apply -f "$REPO/deploy/examples/rwo-deployment.yaml"
deadline=$((SECONDS + TIMEOUT_SECONDS))
running=""
while [ -z "$running" ]; do
  running=$(k get pods -l app=rwo-writers --field-selector=status.phase=Running -o name)
  if [ -n "$running" ]; then
    break
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    k get pvc,pods -o wide || true
    k describe pods -l app=rwo-writers || true
    die "no rwo-writers pod Running after $TIMEOUT"
  fi
  sleep 5
done
k get pvc,pv,pods -o wide
log "ok: $running is Running on a modeguard volume"
log "more stories: deploy/examples/; tear down: kind delete cluster --name $CLUSTER"

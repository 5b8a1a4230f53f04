#!/usr/bin/env bash
# modeguard on kind, with podman: three nodes in two zones, the Helm chart
# installed, and the block stories of test/e2e run against it.
#
#   hack/kind-up.sh              # build what is missing, create (or reuse) the cluster, install, test
#   KIND_TEST=0 hack/kind-up.sh  # the same without the stories
#   hack/kind-down.sh            # delete the cluster and its pools
#
# Nodes: modeguard-control-plane (zone-a, untainted, the controller's node),
# modeguard-worker (zone-a), modeguard-worker2 (zone-b); the stories' nodes in
# that order (MODEGUARD_E2E_NODES).
#
# Nothing is pulled: the node image, the control plane's images and
# kube-proxy are built here (hack/kind/build.sh: kindest/node is not
# reachable from this machine), the driver's and the sidecars' images by
# hack/images, and loaded into the nodes with kind load. Without a
# registry, the chart's liveness probe and node-driver-registrar images
# cannot be had: the plugin registers itself (hack/kind/helm-values.yaml).
#
# Pools. A block pool is a directory per zone that every node of the zone,
# and the controller, must see at the same path: here a host directory per
# zone (under _build/kind/pools) bind-mounted into the nodes of its zone, and
# both into the control plane, where the controller runs. The host's /dev is
# the nodes' /dev, so the loop devices the node plugins make are there.
#
# Needs root (rootful podman), Go, and Debian's podman and runc (installed
# with apt-get when missing). Environment: CLUSTER (modeguard),
# TIMEOUT_SECONDS (600), KIND_TEST (1).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD_DIR:-$REPO/_build}
CLUSTER=${CLUSTER:-modeguard}
TIMEOUT_SECONDS=${TIMEOUT_SECONDS:-600}
TIMEOUT=${TIMEOUT_SECONDS}s
KIND_TEST=${KIND_TEST:-1}
POOLS=$BUILD/kind/pools
KUBECONFIG_FILE=$BUILD/kind/kubeconfig
# The block stories: every story of test/e2e but those needing snapshots
# (no snapshot-controller image here), NFS (no NFS client in this host's
# kernel) or the local cluster's own scripts (node reboots).
KIND_STORIES=${KIND_STORIES:-'^(TestRWODeploymentStaysOnOneNode|TestRWOPDeploymentRunsOnePod|TestStatefulSetPodKeepsItsVolume|TestRWOPSecondPodRefused|TestTopologyFollowsTheData|TestExpansionGrowsMountedFilesystem)$'}
# shellcheck source=local-cluster/k8s-version.sh
source "$REPO/hack/local-cluster/k8s-version.sh"
NODE_IMAGE=localhost/modeguard/kind-node:$K8S_VERSION
KUBECTL=$BUILD/k8s/bin/kubectl
HELM=${HELM:-$BUILD/tools/helm}
KIND=$BUILD/kind/parts/bin/kind
export KIND_EXPERIMENTAL_PROVIDER=podman

log() { printf '[kind %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { printf 'kind-up: %s\n' "$*" >&2; exit 1; }
k() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

[[ $(id -u) == 0 ]] || die "run as root (rootful podman, loop devices)"
need=()
command -v podman >/dev/null || need+=(podman)
[[ -x /usr/sbin/runc ]] || need+=(runc)
# Workers join the control plane by its name: podman's CNI networks resolve
# container names only with the dnsname plugin.
[[ -x /usr/lib/cni/dnsname ]] || need+=(golang-github-containernetworking-plugin-dnsname)
if ((${#need[@]})); then
  log "apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
fi

log "building what is missing (cached: under a minute)"
make -C "$REPO" -s build "$HELM" >/dev/null
bash "$REPO/hack/local-cluster/build.sh" >/dev/null
bash "$REPO/hack/local-cluster/images.sh" >/dev/null
bash "$REPO/hack/images/base.sh"
bash "$REPO/hack/images/modeguard.sh"
bash "$REPO/hack/images/sidecars.sh" all
bash "$REPO/hack/kind/build.sh"

mkdir -p "$POOLS/zone-a" "$POOLS/zone-b" "$(dirname "$KUBECONFIG_FILE")"
# podman's settings for kind's nodes (not for the image builds above):
# runc, since crun refuses a cgroup v1 host's hybrid hierarchy ("cgroups in
# hybrid mode not supported"); and rlimits runc may set here, since
# podman's defaults (nofile 1048576, nproc 4194304) exceed what a host
# without CAP_SYS_RESOURCE allows and every container would fail to start:
# nofile this process's hard limit, nproc 32768 at most (runc was refused
# this host's whole nproc hard limit, and granted 32768).
nproc=$(ulimit -Hu)
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
cat >"$BUILD/kind/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$nproc:$nproc"]
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
CONF
export CONTAINERS_CONF=$BUILD/kind/containers.conf
# kind mounts the host's /lib/modules into every node; a host whose kernel
# has no modules on disk (this one) gets an empty directory, removed again
# by hack/kind-down.sh.
if [[ ! -e /lib/modules ]]; then
  log "no /lib/modules on this host: making an empty one for kind's mount"
  mkdir /lib/modules
  touch "$BUILD/kind/made-lib-modules"
fi
# A kind network made before the dnsname plugin was there has no DNS, and
# kind reuses it: made again (when no container is on it).
if [[ $(podman network inspect kind --format '{{.DNSEnabled}}' 2>/dev/null) == false ]] &&
  [[ -z $(podman ps -a --filter network=kind --format '{{.Names}}') ]]; then
  log "podman network kind has no DNS: removing it for kind to make it again"
  podman network rm kind >/dev/null
fi
if "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "cluster $CLUSTER exists; reusing it"
else
  log "creating kind cluster $CLUSTER from $NODE_IMAGE (about 3 minutes)"
  config=$(mktemp "${TMPDIR:-/tmp}/kind-modeguard.XXXXXX.yaml")
  trap 'rm -f "$config"' EXIT
  cat >"$config" <<YAML
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  disableDefaultCNI: true # kindnetd cannot be pulled; the node image brings a bridge network
nodes:
  - role: control-plane
    labels:
      topology.kubernetes.io/zone: zone-a
    kubeadmConfigPatches:
      - |
        kind: InitConfiguration
        nodeRegistration:
          taints: []
    extraMounts:
      - {hostPath: /dev, containerPath: /dev}
      - {hostPath: $POOLS/zone-a, containerPath: /var/lib/modeguard/pools/zone-a}
      - {hostPath: $POOLS/zone-b, containerPath: /var/lib/modeguard/pools/zone-b}
  - role: worker
    labels:
      topology.kubernetes.io/zone: zone-a
    extraMounts:
      - {hostPath: /dev, containerPath: /dev}
      - {hostPath: $POOLS/zone-a, containerPath: /var/lib/modeguard/pools/zone-a}
  - role: worker
    labels:
      topology.kubernetes.io/zone: zone-b
    extraMounts:
      - {hostPath: /dev, containerPath: /dev}
      - {hostPath: $POOLS/zone-b, containerPath: /var/lib/modeguard/pools/zone-b}
YAML
  "$KIND" create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config "$config" --kubeconfig "$KUBECONFIG_FILE" --retain
fi
"$KIND" get kubeconfig --name "$CLUSTER" >"$KUBECONFIG_FILE"

log "loading images into the nodes"
for img in "$BUILD"/images/*.tar "$BUILD/local-cluster-images/busybox.tar" "$BUILD/kind/kube-proxy.tar"; do
  "$KIND" load image-archive "$img" --name "$CLUSTER"
done
k wait --for=condition=Ready nodes --all --timeout="$TIMEOUT"
# kind's default StorageClass needs an image this machine cannot pull.
k delete storageclass standard --ignore-not-found

SNAP=$BUILD/images/sidecars/crds
if compgen -G "$SNAP/*.yaml" >/dev/null; then
  log "the snapshot CRDs (the csi-snapshotter sidecar needs them; no snapshot-controller: no snapshots)"
  k apply -f "$SNAP" >/dev/null
fi

log "installing deploy/helm/modeguard (values: hack/kind/helm-values.yaml)"
"$HELM" upgrade --install modeguard "$REPO/deploy/helm/modeguard" --namespace modeguard --create-namespace \
  --kubeconfig "$KUBECONFIG_FILE" --values "$REPO/hack/kind/helm-values.yaml" --wait --timeout "$TIMEOUT"
k -n modeguard rollout status deployment/modeguard-controller --timeout="$TIMEOUT"
k -n modeguard rollout status daemonset/modeguard-node-zone-a --timeout="$TIMEOUT"
k -n modeguard rollout status daemonset/modeguard-node-zone-b --timeout="$TIMEOUT"
k get csinodes -o custom-columns='NODE:.metadata.name,DRIVERS:.spec.drivers[*].name,NODEID:.spec.drivers[*].nodeID'

if [[ $KIND_TEST == 1 ]]; then
  log "the block stories of test/e2e"
  (cd "$REPO" && MODEGUARD_E2E_KUBECONFIG=$KUBECONFIG_FILE MODEGUARD_E2E_BUILD_DIR=$BUILD MODEGUARD_E2E_POOLS=$POOLS \
    MODEGUARD_E2E_NODES=$CLUSTER-control-plane,$CLUSTER-worker,$CLUSTER-worker2 \
    go test -count=1 -v -timeout 30m ./test/e2e/ -run "$KIND_STORIES")
fi
log "ok; KUBECONFIG=$KUBECONFIG_FILE; tear down: hack/kind-down.sh"

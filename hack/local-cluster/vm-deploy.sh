#!/usr/bin/env bash
# Installs modeguard with its chart on the cluster of vm-up.sh, as an operator would on a
# cluster of separate machines: helm install with the chart's defaults but for
# hack/local-cluster/vm-helm-values.yaml (each value says why this cluster needs it). The
# images are on every node already (vm-seed.sh). Places the storage targets, the NFS target
# and the two controller replicas (below) and installs csi-addons (its CRDs and controller)
# around the chart. Waits (bounded) for the controllers, every node plugin and storage target,
# csi-addons' controller, and the driver in every node's CSINode.
#   WAIT_SECONDS=300   each wait, under emulation
#   VALUES=FILE ...    further values files, after vm-helm-values.yaml
#   CHART=DIR          another chart than deploy/helm/modeguard (an earlier release's, to
#                      upgrade from)
#   VM_VALUES=FILE     instead of vm-helm-values.yaml (that release's, which its schema takes)
# Needs: root, vm-up.sh running.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
C="${CLUSTER_DIR:-$BUILD/cluster-vm}"
WAIT="${WAIT_SECONDS:-300}"
NS=modeguard
export KUBECONFIG="$C/admin.kubeconfig"
export PATH="$BUILD/k8s/bin:$PATH"
HELM="${HELM:-$BUILD/tools/helm}"
CHART="${CHART:-$REPO/deploy/helm/modeguard}"

log() { printf '[vm-deploy %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[vm-deploy %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }
diag() {
  kubectl get pods -A -o wide || true
  kubectl -n "$NS" describe pods | grep -E -A2 'Warning|Error' | tail -30 || true
  for p in $(kubectl -n "$NS" get pods -o name 2>/dev/null); do
    kubectl -n "$NS" logs "$p" --all-containers --tail=15 --prefix || true
  done
}
trap 'rc=$?; if (( rc != 0 )); then diag; fi' EXIT

[[ $EUID -eq 0 ]] || die "must run as root"
[[ -x "$HELM" ]] || die "helm not found (make $HELM, or set HELM)"
mapfile -t NODES < <(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' 2>/dev/null)
((${#NODES[@]})) || die "no cluster at $KUBECONFIG: run hack/local-cluster/vm-up.sh first"

t0=$(date +%s)
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl label --overwrite namespace "$NS" pod-security.kubernetes.io/enforce=privileged \
  pod-security.kubernetes.io/warn=privileged pod-security.kubernetes.io/audit=privileged >/dev/null
# Where the driver's parts run, as an operator would place them on such a cluster:
# - block volumes over iSCSI (vm-helm-values.yaml): each zone's storage target on the zone's
#   last node, and the controller finds each target's Service name at that node's address in
#   its /etc/hosts, as this cluster has neither kube-proxy nor cluster DNS;
# - the NFS target (nfs.node) on the last zone's storage node, found by its Service name in
#   the controllers' /etc/hosts as the storage targets are;
# - the two controller replicas on the storage nodes (one each: on the host's network the
#   chart keeps them apart), so that the first node runs workloads only: a story can fence it
#   or cut its power without taking a controller or a target with it.
placement="$C/vm-placement-values.yaml"
printf 'controller:\n  affinity:\n    nodeAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n' >"$placement"
printf '        nodeSelectorTerms:\n          - matchExpressions:\n' >>"$placement"
printf '              - {key: modeguard.csi.dev/storage-target, operator: Exists}\n' >>"$placement"
printf '  hostAliases:\n' >>"$placement"
storage_node="" aliases=()
for zone in $(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.labels.topology\.kubernetes\.io/zone}{"\n"}{end}' | sort -u); do
  storage_node=$(kubectl get nodes -l "topology.kubernetes.io/zone=$zone" \
    -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort -V | tail -1)
  ip=$(kubectl get node "$storage_node" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')
  kubectl label --overwrite node "$storage_node" "modeguard.csi.dev/storage-target=$zone" >/dev/null
  aliases+=("$ip modeguard-target-$zone.$NS.svc")
  log "storage target of $zone: $storage_node"
done
# The NFS target's name at the last storage node's address, in that address's entry (one
# entry per address).
aliases[-1]+=" modeguard-nfs.$NS.svc"
for a in "${aliases[@]}"; do
  read -r ip names <<<"$a"
  printf '    - {ip: "%s", hostnames: [%s]}\n' "$ip" "${names// /, }" >>"$placement"
done
printf 'nfs:\n  node: "%s"\n' "$storage_node" >>"$placement"
log "the NFS target: $storage_node"
# csi-addons (csiAddons.enabled in vm-helm-values.yaml): its CRDs before the chart, so that
# modeguard's sidecar registers at its first start; its controller after.
CSI_ADDONS_API_HOST=10.98.0.1 CSI_ADDONS_API_PORT=6443 WAIT_SECONDS="$WAIT" bash "$HERE/csi-addons-install.sh" crds
values=(--values "${VM_VALUES:-$HERE/vm-helm-values.yaml}" --values "$placement")
for v in ${VALUES:-}; do values+=(--values "$v"); done
log "helm upgrade --install modeguard $CHART ${values[*]}"
"$HELM" upgrade --install modeguard "$CHART" --namespace "$NS" "${values[@]}" \
  >"$C/helm-install.out"

log "waiting for the controllers, the targets and the node plugins (<= ${WAIT}s each)"
kubectl -n "$NS" rollout status deployment/modeguard-controller --timeout="${WAIT}s"
for w in $(kubectl -n "$NS" get daemonset,statefulset -o name); do
  kubectl -n "$NS" rollout status "$w" --timeout="${WAIT}s"
done
CSI_ADDONS_API_HOST=10.98.0.1 CSI_ADDONS_API_PORT=6443 WAIT_SECONDS="$WAIT" \
  bash "$HERE/csi-addons-install.sh"
deadline=$(($(date +%s) + WAIT))
for n in "${NODES[@]}"; do
  until kubectl get csinode "$n" -o jsonpath='{.spec.drivers[*].name}' 2>/dev/null | grep -q modeguard.csi.dev; do
    (($(date +%s) < deadline)) || die "the driver is not registered in CSINode $n"
    sleep 1
  done
done
log "installed in $(($(date +%s) - t0)) s; the controllers run on $(kubectl -n "$NS" get pod \
  -l app.kubernetes.io/component=controller -o jsonpath='{.items[*].spec.nodeName}')"
kubectl get csinode -o custom-columns='NODE:.metadata.name,DRIVER:.spec.drivers[*].name,TOPOLOGY:.spec.drivers[*].topologyKeys'

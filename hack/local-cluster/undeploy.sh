#!/usr/bin/env bash
# Removes every modeguard volume from the cluster of up.sh before it goes down, so that no
# image, loop device or export outlives it: deletes the pods that use a modeguard claim
# (outside the driver's namespace), the VolumeSnapshots, then the claims, and waits
# (bounded) until every PersistentVolume of the driver is gone, that is, until the driver
# has unpublished, detached and deleted each one. Needs: root, up.sh and deploy.sh run.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
WAIT="${WAIT_SECONDS:-180}"
DRIVER=modeguard.csi.dev
export KUBECONFIG="$BUILD/cluster/admin.kubeconfig"
export PATH="$BUILD/k8s/bin:$PATH"

log() { printf '[undeploy %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
kubectl get --raw /readyz >/dev/null 2>&1 || { log "no cluster running: nothing to undeploy"; exit 0; }

# namespace/claim of every claim bound to a PV of the driver
mapfile -t claims < <(kubectl get pv -o jsonpath="{range .items[?(@.spec.csi.driver==\"$DRIVER\")]}{.spec.claimRef.namespace}/{.spec.claimRef.name}{\"\\n\"}{end}")
log "${#claims[@]} modeguard volume(s)"
for nc in "${claims[@]}"; do
  [[ -n "$nc" ]] || continue
  ns=${nc%%/*} claim=${nc#*/}
  for pod in $(kubectl -n "$ns" get pods -o jsonpath="{range .items[?(@.spec.volumes[*].persistentVolumeClaim.claimName==\"$claim\")]}{.metadata.name}{\" \"}{end}"); do
    kubectl -n "$ns" delete pod "$pod" --grace-period=1 --wait=false >/dev/null 2>&1 || true
  done
done
# Workloads would recreate their pods.
kubectl get deployments,statefulsets -A -o jsonpath='{range .items[*]}{.metadata.namespace} {.kind} {.metadata.name}{"\n"}{end}' |
  while read -r ns kind name; do
    [[ -n "$ns" && "$ns" != modeguard && "$ns" != kube-system ]] || continue
    kubectl -n "$ns" delete "$kind" "$name" --wait=false >/dev/null 2>&1 || true
  done
kubectl delete volumesnapshots --all -A --wait=false >/dev/null 2>&1 || true
for nc in "${claims[@]}"; do
  [[ -n "$nc" ]] || continue
  kubectl -n "${nc%%/*}" delete pvc "${nc#*/}" --wait=false >/dev/null 2>&1 || true
done

deadline=$(( $(date +%s) + WAIT ))
while :; do
  left=$(kubectl get pv -o jsonpath="{range .items[?(@.spec.csi.driver==\"$DRIVER\")]}{.metadata.name}{\" \"}{end}")
  left+=$(kubectl get volumesnapshotcontents -o jsonpath="{range .items[?(@.spec.driver==\"$DRIVER\")]}{.metadata.name}{\" \"}{end}" 2>/dev/null || true)
  [[ -z "$left" ]] && break
  if (( $(date +%s) >= deadline )); then
    log "ERROR: volumes not deleted within ${WAIT}s: $left"
    kubectl get pv,volumeattachments -o wide || true
    exit 1
  fi
  sleep 1
done
log "no modeguard volume or snapshot left"

# With every volume deleted, nothing of the driver's may still be attached or mounted on the
# host: a loop device or mount left here is a leak of the driver's, reported, not cleaned
# (down.sh cleans up after a failed run).
# The pools' own btrfs (deploy.sh: pool-<zone>.img mounted at pools/<zone>) are the driver's
# storage, not leaks.
MG="$BUILD/modeguard-local/"
# shellcheck source=pool-loops.sh
source "$HERE/pool-loops.sh"
leaks=$(losetup -a 2>/dev/null | grep -F "$MG" | grep -vE "\\(${MG}pool-[^/]*\\.img\\)$" || true)
for dev in $(pool_bound_loops "$MG"); do
  grep -qF "$dev:" <<<"$leaks" || leaks+=$'\n'"$(losetup "$dev")"
done
leaks+=$(awk -v p="$MG" 'index($2, p) == 1 && $2 !~ "^" p "pools/zone-[^/]*$" {print "mount " $2}' /proc/self/mounts)
if [[ -n "$leaks" ]]; then
  log "ERROR: left by deleted volumes:"
  echo "$leaks" >&2
  exit 1
fi

# Installed with Helm (deploy.sh): uninstall the release and check that it took every object
# it made, cluster-wide and in the namespace (whose Pod Security labels deploy.sh set, so it
# goes too).
HELM="${HELM:-$BUILD/tools/helm}"
NS=modeguard
if [[ -x "$HELM" ]] && "$HELM" -n "$NS" status modeguard >/dev/null 2>&1; then
  log "helm uninstall modeguard"
  "$HELM" -n "$NS" uninstall modeguard --wait --timeout "${WAIT}s" >/dev/null
  kubectl delete namespace "$NS" --wait=true --timeout="${WAIT}s" >/dev/null
  left=$(kubectl get csidrivers,storageclasses,volumesnapshotclasses,clusterroles,clusterrolebindings \
    -l app.kubernetes.io/instance=modeguard -o name 2>/dev/null || true)
  left+=$(kubectl get csidriver "$DRIVER" -o name 2>/dev/null || true)
  left+=$(kubectl get namespace "$NS" -o name 2>/dev/null || true)
  if [[ -n "$left" ]]; then
    log "ERROR: left after helm uninstall:"
    echo "$left" >&2
    exit 1
  fi
  log "helm uninstall left nothing of the release"
fi

#!/usr/bin/env bash
# Deploys modeguard onto the cluster of up.sh and proves a block volume works: imports
# _build/images/*.tar into every node's containerd, installs deploy/helm/modeguard with
# hack/local-cluster/helm-values.yaml (the chart's defaults but for what this one-host
# cluster needs, each value saying why), waits (bounded) for the controller and the node
# pods and for the driver in every node's CSINode, then a PVC of modeguard-block + a pod
# using it, writes a file in it, prints the result and the chart's NOTES.
# Needs: root, up.sh running, the archives of hack/images. CLEAN=1: delete the test pod+PVC
# at the end (so the volume is unpublished and its loop device detached).
# HELM_EXTRA_VALUES: more values files, given to helm after helm-values.yaml (paths
# relative to the repository; /work/main rewritten as in helm-values.yaml), e.g.
# hack/local-cluster/csi-addons-values.yaml.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
C="$BUILD/cluster"
WAIT="${WAIT_SECONDS:-120}"
NS=modeguard
TESTNS=default
export KUBECONFIG="$C/admin.kubeconfig"
export PATH="$BUILD/k8s/bin:$BUILD/debs/bin:$PATH"
HELM="${HELM:-$BUILD/tools/helm}"

log() { printf '[deploy %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[deploy %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }
# On failure: show what there is to see.
diag() {
  kubectl get pods -A -o wide || true
  kubectl -n "$NS" describe pods | tail -40 || true
  for p in $(kubectl -n "$NS" get pods -o name 2>/dev/null); do
    kubectl -n "$NS" logs "$p" --all-containers --tail=30 --prefix || true
  done
  kubectl -n "$TESTNS" describe pod mg-local-test 2>/dev/null | tail -20 || true
}
trap 'rc=$?; if (( rc != 0 )); then diag; fi' EXIT

[[ $EUID -eq 0 ]] || die "must run as root"
mapfile -t NODES < <(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' 2>/dev/null)
((${#NODES[@]})) || die "no cluster: run hack/local-cluster/up.sh first"
[[ -x "$HELM" ]] || die "helm not found (make $HELM, or set HELM)"

log "importing images into the containerd of ${NODES[*]}"
for n in "${NODES[@]}"; do
  for t in "$BUILD"/images/modeguard.tar "$BUILD"/images/csi-*.tar; do
    ctr -a "$C/nodes/$n/containerd/containerd.sock" -n k8s.io images import "$t" >/dev/null || die "import $t into $n"
  done &
done
wait

log "making the pool and state directories"
# Each zone's pool is a btrfs of its own (a sparse image, POOL_SIZE each), as a production pool
# should be: a snapshot or clone of a volume in use is then an atomic clone (on a filesystem
# without reflinks the driver would keep a btrfs or an xfs with reflinks in the pool directory), a group
# snapshot of volumes being written is of one instant (the driver lays a new pool on btrfs out
# with its volumes in a subvolume: one read-only snapshot of it holds every member; on xfs a group
# of more than one volume being written is refused), and a zone that fills up is full alone, so
# the capacity the driver publishes differs by zone as it would across real zones. An image of
# another filesystem (a pool of an earlier layout, kept with KEEP_STATE=1) is made anew.
mkdir -p "$BUILD"/modeguard-local/{pools,node,nfs,ganesha}
for zone in zone-a zone-b; do
  pool="$BUILD/modeguard-local/pools/$zone" img="$BUILD/modeguard-local/pool-$zone.img"
  mkdir -p "$pool"
  mountpoint -q "$pool" && continue
  if [[ -s "$img" && "$(blkid -p -o value -s TYPE "$img" 2>/dev/null)" != btrfs ]]; then
    log "$img is not a btrfs: making it anew"
    rm -f "$img"
  fi
  if [[ ! -s "$img" ]]; then
    truncate -s "${POOL_SIZE:-16G}" "$img"
    mkfs.btrfs -q "$img" >/dev/null || die "mkfs.btrfs $img"
  fi
  mount -t btrfs -o loop "$img" "$pool" || die "mounting the pool of $zone ($img)"
done

# The values' host paths assume the repository at /work/main.
log "installing deploy/helm/modeguard (values: hack/local-cluster/helm-values.yaml)"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl label --overwrite namespace "$NS" pod-security.kubernetes.io/enforce=privileged \
  pod-security.kubernetes.io/warn=privileged pod-security.kubernetes.io/audit=privileged >/dev/null
sed "s#/work/main/_build#$BUILD#g" "$HERE/helm-values.yaml" >"$BUILD/helm-values.yaml"
values=(--values "$BUILD/helm-values.yaml")
for f in ${HELM_EXTRA_VALUES:-}; do
  [[ "$f" == /* ]] || f="$REPO/$f"
  [[ -f "$f" ]] || die "HELM_EXTRA_VALUES: no file $f"
  sed "s#/work/main/_build#$BUILD#g" "$f" >"$BUILD/helm-values-$(basename "$f")"
  values+=(--values "$BUILD/helm-values-$(basename "$f")")
  log "more values: $f"
done
"$HELM" upgrade --install modeguard "$REPO/deploy/helm/modeguard" --namespace "$NS" \
  "${values[@]}" >"$BUILD/helm-install.out"

log "waiting for the controller and node pods (<= ${WAIT}s)"
kubectl -n "$NS" rollout status deployment/modeguard-controller --timeout="${WAIT}s"
kubectl -n "$NS" rollout status daemonset/modeguard-node-zone-a --timeout="${WAIT}s"
kubectl -n "$NS" rollout status daemonset/modeguard-node-zone-b --timeout="${WAIT}s"
kubectl -n "$NS" wait --for=condition=Ready pod -l app.kubernetes.io/name=modeguard --timeout="${WAIT}s"
deadline=$(( $(date +%s) + WAIT ))
for n in "${NODES[@]}"; do
  until kubectl get csinode "$n" -o jsonpath='{.spec.drivers[*].name}' 2>/dev/null | grep -q modeguard.csi.dev; do
    (( $(date +%s) < deadline )) || die "driver not registered in CSINode $n"
    sleep 1
  done
done

log "PVC (modeguard-block) and a pod using it"
kubectl apply -n "$TESTNS" -f - >/dev/null <<'YAML'
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: mg-local-test
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: modeguard-block
  resources:
    requests:
      storage: 64Mi
---
apiVersion: v1
kind: Pod
metadata:
  name: mg-local-test
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: localhost/modeguard/busybox:test
      imagePullPolicy: Never
      command: [sh, -c, "sleep 3600"]
      volumeMounts:
        - name: data
          mountPath: /data
  volumes:
    - name: data
      persistentVolumeClaim:
        claimName: mg-local-test
YAML
kubectl -n "$TESTNS" wait --for=condition=Ready pod/mg-local-test --timeout="${WAIT}s"

log "writing a file in the volume"
kubectl -n "$TESTNS" exec mg-local-test -- sh -c 'echo "hello from $(hostname) $(date)" > /data/hello && cat /data/hello && df -h /data && grep " /data " /proc/mounts'

kubectl get pv,pvc,pod -A -o wide
kubectl get csinode -o custom-columns='NODE:.metadata.name,DRIVER:.spec.drivers[*].name,NODEID:.spec.drivers[*].nodeID,TOPOLOGY:.spec.drivers[*].topologyKeys'


sed -n '/^NOTES:/,$p' "$BUILD/helm-install.out"

if [[ "${CLEAN:-0}" == 1 ]]; then
  log "deleting the test pod and claim (and waiting for the PV: DeleteVolume removes the image)"
  pv=$(kubectl -n "$TESTNS" get pvc mg-local-test -o jsonpath='{.spec.volumeName}')
  kubectl -n "$TESTNS" delete pod mg-local-test --wait=true --timeout="${WAIT}s"
  kubectl -n "$TESTNS" delete pvc mg-local-test --wait=true --timeout="${WAIT}s"
  if [[ -n "$pv" ]]; then kubectl wait --for=delete "pv/$pv" --timeout="${WAIT}s"; fi
fi
log "done"

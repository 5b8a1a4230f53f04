#!/usr/bin/env bash
# A NetworkFence end to end on the cluster of up.sh: modeguard installed with
# csiAddons.enabled (deploy.sh with HELM_EXTRA_VALUES=hack/local-cluster/csi-addons-values.yaml)
# and csi-addons installed (csi-addons-install.sh). Fails (exit 1) on the
# first assertion that does not hold. make test-csi-addons runs it on a
# cluster of its own; docs/testing.md.
#
# What it asserts, for a /32 block holding one node's address (FENCE_NODE:
# by default the first node that holds no modeguard volume, since a node with
# a volume of the loop transport cannot be fenced and the result would be
# Failed):
#   1. the sidecar's CSIAddonsNode is Connected (the csi-addons controller
#      reaches the sidecar);
#   2. a NetworkFence Fenced on it reaches status.result Succeeded, and the
#      driver's fence list (fences.json in the chart's csiAddons.fenceDir,
#      on the controller's node, which is this host) holds the block;
#   3. deleting that Fenced NetworkFence does NOT lift the fence: the object
#      goes (csi-addons removes its finalizer) and the block stays in the
#      list. (Should a csi-addons version unfence on deletion, this fails:
#      the operator guide says otherwise.)
#   4. a NetworkFence on the same block with fenceState Unfenced reaches
#      Succeeded, and the block is gone from the list;
#   5. the documented way: Fenced, then spec.fenceState changed to Unfenced
#      on the same object: Succeeded, block gone; then the object deleted.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
export KUBECONFIG="${KUBECONFIG:-$BUILD/cluster/admin.kubeconfig}"
export PATH="$BUILD/k8s/bin:$PATH"
WAIT="${WAIT_SECONDS:-90}"
NS="${MODEGUARD_NAMESPACE:-modeguard}"
DRIVER=modeguard.csi.dev
SECRET="${FENCE_SECRET:-modeguard-networkfence}"
NF=modeguard-fence-test

log() { printf '[fence-test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() {
  printf '[fence-test %s] FAIL: %s\n' "$(date +%H:%M:%S)" "$*" >&2
  kubectl get networkfences -o wide 2>/dev/null || true
  kubectl get csiaddonsnodes -A -o wide 2>/dev/null || true
  [[ -n "${FENCE_FILE:-}" ]] && { echo "--- $FENCE_FILE"; cat "$FENCE_FILE" 2>/dev/null; echo; } || true
  kubectl -n "$NS" logs deployment/modeguard-controller -c csi-addons --tail=20 2>/dev/null || true
  kubectl -n "$NS" logs deployment/modeguard-controller -c modeguard --tail=20 2>/dev/null || true
  kubectl -n "${CSI_ADDONS_NAMESPACE:-csi-addons-system}" logs deployment/csi-addons-controller --tail=30 2>/dev/null || true
  exit 1
}
# until DESCRIPTION COMMAND...: COMMAND succeeds within WAIT seconds.
until_ok() {
  local what=$1 deadline=$((SECONDS + WAIT))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$what: not within ${WAIT}s"
    sleep 1
  done
}
# The fence list holds CIDR (exact).
listed() {
  python3 - "$FENCE_FILE" "$1" <<'PY'
import json, sys
try:
    with open(sys.argv[1]) as f:
        fences = json.load(f).get("fences") or []
except FileNotFoundError:
    fences = []
sys.exit(0 if any(x.get("cidr") == sys.argv[2] for x in fences) else 1)
PY
}
not_listed() { ! listed "$1"; }
result_is() { # name result fenceState
  [[ "$(kubectl get networkfence "$1" -o jsonpath='{.status.result}/{.spec.fenceState}')" == "$2/$3" ]]
}
gone() { ! kubectl get networkfence "$1" >/dev/null 2>&1; }
# apply NAME STATE: a NetworkFence on $CIDR as docs/operator-guide.md describes it.
apply() {
  kubectl apply -f - >/dev/null <<YAML
apiVersion: csiaddons.openshift.io/v1alpha1
kind: NetworkFence
metadata:
  name: $1
spec:
  driver: $DRIVER
  fenceState: $2
  cidrs: [$CIDR]
  secret: {name: $SECRET, namespace: $NS}
YAML
}
delete_nf() { kubectl delete networkfence "$1" --ignore-not-found --wait=false >/dev/null; until_ok "NetworkFence $1 deleted" gone "$1"; }
# Whatever the outcome: no fence of this test stays in force, no object of
# it stays (bounded; failures here are reported, the test's result stands).
cleanup() {
  local n
  for n in "$NF" "$NF-lift"; do
    kubectl get networkfence "$n" >/dev/null 2>&1 || continue
    kubectl patch networkfence "$n" --type=merge -p '{"spec":{"fenceState":"Unfenced"}}' >/dev/null 2>&1 || true
    kubectl wait networkfence "$n" --for=jsonpath='{.status.result}'=Succeeded --timeout=30s >/dev/null 2>&1 ||
      log "cleanup: $n not Unfenced within 30s"
    kubectl delete networkfence "$n" --timeout=30s >/dev/null 2>&1 || log "cleanup: $n not deleted within 30s"
  done
}
trap cleanup EXIT

kubectl get crd networkfences.csiaddons.openshift.io >/dev/null 2>&1 ||
  fail "no NetworkFence CRD: run hack/local-cluster/csi-addons-install.sh"
kubectl get networkfence "$NF" >/dev/null 2>&1 && fail "NetworkFence $NF exists already (an earlier run?)"

# The fence list: the fence-dir hostPath of the controller (every node is
# this host).
dir=$(kubectl -n "$NS" get deployment modeguard-controller \
  -o jsonpath='{.spec.template.spec.volumes[?(@.name=="fence-dir")].hostPath.path}')
[[ -n "$dir" ]] || fail "the controller has no fence-dir volume: install the chart with csiAddons.enabled=true"
FENCE_FILE="${FENCE_FILE:-$dir/fences.json}"

if [[ -z "${FENCE_NODE:-}" ]]; then
  holding=" $(kubectl get volumeattachments -o jsonpath="{range .items[?(@.spec.attacher==\"$DRIVER\")]}{.spec.nodeName}{' '}{end}") "
  for n in $(kubectl get nodes -o jsonpath='{.items[*].metadata.name}'); do
    [[ "$holding" == *" $n "* ]] || { FENCE_NODE=$n; break; }
  done
  [[ -n "${FENCE_NODE:-}" ]] || fail "every node holds a modeguard volume; set FENCE_NODE"
fi
addr=$(kubectl get node "$FENCE_NODE" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')
[[ -n "$addr" ]] || fail "node $FENCE_NODE has no InternalIP"
CIDR="$addr/32"
[[ "$addr" == *:* ]] && CIDR="$addr/128"
log "node $FENCE_NODE, block $CIDR, fence list $FENCE_FILE"
not_listed "$CIDR" || fail "$CIDR is in the fence list before the test"

log "1. the sidecar's CSIAddonsNode is Connected"
connected() {
  kubectl -n "$NS" get csiaddonsnodes -o jsonpath="{range .items[?(@.spec.driver.name==\"$DRIVER\")]}{.status.state}{'\n'}{end}" | grep -qx Connected
}
until_ok "a CSIAddonsNode of $DRIVER in $NS Connected" connected

log "2. NetworkFence $NF Fenced -> Succeeded, $CIDR in the fence list"
apply "$NF" Fenced
until_ok "NetworkFence $NF Succeeded" result_is "$NF" Succeeded Fenced
listed "$CIDR" || fail "NetworkFence $NF Succeeded but $CIDR is not in $FENCE_FILE"
kubectl -n "$NS" logs deployment/modeguard-controller -c modeguard --tail=200 | grep 'Network fence recorded' | grep -qF "$CIDR" ||
  fail "the controller's log does not say 'Network fence recorded' for $CIDR"

log "3. deleting the Fenced NetworkFence leaves the fence in force"
delete_nf "$NF"
sleep 3 # what a deletion would have called, it has called by now
listed "$CIDR" || fail "deleting the Fenced NetworkFence $NF lifted $CIDR: this csi-addons version unfences on deletion (docs/operator-guide.md says it does not)"

log "4. a NetworkFence Unfenced on the same block lifts it"
apply "$NF-lift" Unfenced
until_ok "NetworkFence $NF-lift Succeeded" result_is "$NF-lift" Succeeded Unfenced
not_listed "$CIDR" || fail "NetworkFence $NF-lift Unfenced Succeeded but $CIDR is still in $FENCE_FILE"
delete_nf "$NF-lift"

log "5. Fenced, then spec.fenceState Unfenced on the same object, then deleted"
apply "$NF" Fenced
until_ok "NetworkFence $NF Succeeded" result_is "$NF" Succeeded Fenced
listed "$CIDR" || fail "$CIDR not in the fence list after the second fence"
kubectl patch networkfence "$NF" --type=merge -p '{"spec":{"fenceState":"Unfenced"}}' >/dev/null
until_ok "NetworkFence $NF Unfenced Succeeded" result_is "$NF" Succeeded Unfenced
not_listed "$CIDR" || fail "$CIDR still in the fence list after fenceState Unfenced"
delete_nf "$NF"
not_listed "$CIDR" || fail "$CIDR back in the fence list after deleting the Unfenced NetworkFence"

log "PASS: fenced and lifted $CIDR ($FENCE_NODE) through NetworkFence objects"

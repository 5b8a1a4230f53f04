#!/usr/bin/env bash
# Installs (or uninstalls) csi-addons on the cluster KUBECONFIG points at:
# its CRDs (from the module, copied by hack/images/csi-addons.sh to
# _build/images/csi-addons/crds) and its controller, the Deployment,
# ServiceAccount and RBAC of hack/local-cluster/csi-addons/controller.yaml.
# The image must be on the nodes already (deploy.sh imports
# _build/images/csi-*.tar, csi-addons-controller.tar among them).
# modeguard's side (the sidecar, its RBAC, the fence list) is the chart's
# csiAddons.enabled or deploy/kubernetes/components/csi-addons.
#
# Usage: hack/local-cluster/csi-addons-install.sh [install|crds|uninstall]
#   crds: the CRDs alone. Install them before modeguard's sidecar starts: a
#   sidecar that finds no CSIAddonsNode CRD tries once to register, exits
#   three minutes later and registers only when restarted (so it does
#   again after an uninstall and a new install: the uninstall deletes its
#   CSIAddonsNode with the CRDs).
#
# Settings (environment):
#   CSI_ADDONS_NAMESPACE    the controller's namespace (csi-addons-system)
#   CSI_ADDONS_IMAGE        quay.io/csiaddons/k8s-controller:<version of the CRDs built>
#   CSI_ADDONS_CRDS         directory of the CRDs (_build/images/csi-addons/crds)
#   CSI_ADDONS_HOST_NETWORK true: the controller on the node's network (false)
#   CSI_ADDONS_API_HOST     with CSI_ADDONS_API_PORT: where the controller finds
#   CSI_ADDONS_API_PORT     the API server, for a cluster without kube-proxy
#                           (unset: the kubernetes Service, as usual)
#   CSI_ADDONS_HEALTH_PORT  its health endpoint, on the pod's IP (8081)
#   WAIT_SECONDS            bound of every wait (120)
#   CSI_ADDONS_FORCE=1      uninstall although a NetworkFence is Fenced
#
# On the local cluster (hack/local-cluster/README.md):
#   KUBECONFIG=_build/cluster/admin.kubeconfig CSI_ADDONS_HOST_NETWORK=true \
#   CSI_ADDONS_API_HOST=127.0.0.1 CSI_ADDONS_API_PORT=6443 hack/local-cluster/csi-addons-install.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
export PATH="$BUILD/k8s/bin:$PATH"
WAIT="${WAIT_SECONDS:-120}"
NS="${CSI_ADDONS_NAMESPACE:-csi-addons-system}"
CRDS="${CSI_ADDONS_CRDS:-$BUILD/images/csi-addons/crds}"
MANIFEST="$HERE/csi-addons/controller.yaml"

log() { printf '[csi-addons-install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[csi-addons-install %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

[[ -n "${KUBECONFIG:-}" ]] || die "set KUBECONFIG to the cluster's kubeconfig"
command -v kubectl >/dev/null || die "no kubectl (PATH, or hack/local-cluster/build.sh)"
command -v envsubst >/dev/null || die "no envsubst (Debian package gettext-base)"

# The manifest with the settings filled in (only our variables: the
# manifest's $(POD_IP) and the like are the kubelet's to expand).
render() {
  local version api_env=""
  version=$(cat "$CRDS/VERSION" 2>/dev/null || true)
  export CSI_ADDONS_NAMESPACE="$NS"
  export CSI_ADDONS_IMAGE="${CSI_ADDONS_IMAGE:-quay.io/csiaddons/k8s-controller:${version:?no $CRDS/VERSION: run hack/images/csi-addons.sh}}"
  export CSI_ADDONS_HOST_NETWORK="${CSI_ADDONS_HOST_NETWORK:-false}"
  export CSI_ADDONS_HEALTH_PORT="${CSI_ADDONS_HEALTH_PORT:-8081}"
  if [[ -n "${CSI_ADDONS_API_HOST:-}" ]]; then
    api_env="            - {name: KUBERNETES_SERVICE_HOST, value: \"$CSI_ADDONS_API_HOST\"}
            - {name: KUBERNETES_SERVICE_PORT, value: \"${CSI_ADDONS_API_PORT:-443}\"}"
  fi
  export CSI_ADDONS_API_ENV="$api_env"
  envsubst '${CSI_ADDONS_NAMESPACE} ${CSI_ADDONS_IMAGE} ${CSI_ADDONS_HOST_NETWORK} ${CSI_ADDONS_HEALTH_PORT} ${CSI_ADDONS_API_ENV}' <"$MANIFEST"
}

diag() {
  kubectl -n "$NS" get pods -o wide || true
  kubectl -n "$NS" describe pods | tail -30 || true
  kubectl -n "$NS" logs deployment/csi-addons-controller --tail=40 || true
}

crds() {
  compgen -G "$CRDS/*.yaml" >/dev/null || die "no CRDs in $CRDS: run hack/images/csi-addons.sh"
  log "CRDs from $CRDS ($(cat "$CRDS/VERSION" 2>/dev/null))"
  # Server-side: some of these CRDs are too large for the annotation a
  # client-side apply keeps.
  kubectl apply --server-side --force-conflicts -f "$CRDS" >/dev/null
  kubectl wait --for=condition=Established -f "$CRDS" --timeout="${WAIT}s" >/dev/null ||
    die "CRDs not established within ${WAIT}s"
}

install() {
  local start=$SECONDS
  crds
  log "controller $(render | sed -n 's/^ *image: //p') in namespace $NS"
  render | kubectl apply -f - >/dev/null
  if ! kubectl -n "$NS" rollout status deployment/csi-addons-controller --timeout="${WAIT}s"; then
    diag; die "controller not ready within ${WAIT}s"
  fi
  log "installed in $((SECONDS - start)) s"
}

# Gone, or the bounded wait fails.
wait_gone() { # what...
  kubectl wait --for=delete "$@" --timeout="${WAIT}s" >/dev/null 2>&1 || ! kubectl get "$@" >/dev/null 2>&1
}

uninstall() {
  local start=$SECONDS fenced
  if kubectl get crd networkfences.csiaddons.openshift.io >/dev/null 2>&1; then
    # A NetworkFence's finalizer is removed by the controller, which does
    # not unfence on deletion: a Fenced one deleted stays in force in the
    # driver. Lift it first (spec.fenceState: Unfenced).
    fenced=$(kubectl get networkfences -o jsonpath='{range .items[?(@.spec.fenceState=="Fenced")]}{.metadata.name}{" "}{end}')
    if [[ -n "$fenced" && "${CSI_ADDONS_FORCE:-0}" != 1 ]]; then
      die "NetworkFences still Fenced: $fenced- set spec.fenceState: Unfenced first (or CSI_ADDONS_FORCE=1: they stay in force in the driver)"
    fi
    log "deleting NetworkFences and NetworkFenceClasses (the controller removes their finalizers)"
    kubectl delete networkfences --all --wait=false >/dev/null
    kubectl delete networkfenceclasses --all --wait=false >/dev/null
    wait_gone networkfences --all || die "NetworkFences not gone within ${WAIT}s"
    wait_gone networkfenceclasses --all || die "NetworkFenceClasses not gone within ${WAIT}s"
  fi
  log "deleting the controller"
  if kubectl get namespace "$NS" >/dev/null 2>&1; then
    kubectl -n "$NS" delete deployment csi-addons-controller --ignore-not-found --wait=true --timeout="${WAIT}s" >/dev/null
    wait_gone -n "$NS" pods -l app.kubernetes.io/name=csi-addons-controller || die "controller pods not gone within ${WAIT}s"
  fi
  if kubectl get crd csiaddonsnodes.csiaddons.openshift.io >/dev/null 2>&1; then
    # The controller kept a finalizer on each CSIAddonsNode it connected
    # to, and it is gone now: drop them, or the CRD's deletion waits for
    # ever. A sidecar makes its CSIAddonsNode again while the CRD exists.
    local n
    for n in $(kubectl get csiaddonsnodes -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{" "}{end}'); do
      kubectl -n "${n%%/*}" patch csiaddonsnode "${n#*/}" --type=merge -p '{"metadata":{"finalizers":null}}' >/dev/null 2>&1 || true
    done
  fi
  render | kubectl delete --ignore-not-found --wait=true --timeout="${WAIT}s" -f - >/dev/null
  if compgen -G "$CRDS/*.yaml" >/dev/null; then
    kubectl delete --ignore-not-found --wait=true --timeout="${WAIT}s" -f "$CRDS" >/dev/null
  fi
  log "uninstalled in $((SECONDS - start)) s"
}

case "${1:-install}" in
  install) install ;;
  crds) crds ;;
  uninstall) uninstall ;;
  *) echo "usage: $0 [install|uninstall]" >&2; exit 2 ;;
esac

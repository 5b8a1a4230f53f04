#!/usr/bin/env bash
# Runs Kubernetes' external storage e2e suites against modeguard on the local
# cluster (hack/local-cluster), with the driver files of test/conformance, or
# on the cluster whose nodes are VMs (hack/local-cluster/vm-up.sh) when
# KUBECONFIG is its admin.kubeconfig (make conformance-vm).
#
#   DRIVER=block|nfs|iscsi   the driver file (test/conformance/$DRIVER.yaml);
#                      default block. nfs and iscsi need nodes with the kernel's
#                      NFS client and iSCSI initiator: the VM cluster's
#   SUITES="a|b"       suite names as the spec names spell them (provisioning,
#                      volumes, multiVolume, read-write-once-pod, ...); default: all
#                      the suites docs/conformance.md lists for the driver
#   SKIP=regexp        more specs not to run than test/conformance/skip-$DRIVER.txt
#   PROCS=2            parallel Ginkgo workers; [Serial] specs run alone at the end
#   REPORT=dir         JUnit report and log (default _build/conformance/report-$DRIVER)
#   BUILD_ONLY=1       only build the binaries SUITES need
#
# The suites run with e2e.test of the cluster's version (v1.34.4), but for
# volumegroupsnapshottable: it runs with e2e.test $GROUP_E2E_VERSION (v1.35.4,
# the first whose external driver names a VolumeGroupSnapshotClass) and the
# driver file test/conformance/$DRIVER-group.yaml, as a second run reported
# in $REPORT-group (a driver without that file skips it).
#
# Builds e2e.test (hack/conformance/build.sh); on the local cluster (no
# KUBECONFIG, or its admin.kubeconfig) brings it up when no node answers (make
# cluster-up) and imports the test images into every node
# (hack/conformance/images.sh); on the VM cluster checks that every node has
# them (its node disks were made with them: make conformance-vm); runs; prints a per-suite summary
# (passed/failed/skipped) from the JUnit report. Exits non-zero when a spec fails.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
OUT="$BUILD/conformance"
DRIVER="${DRIVER:-block}"
PROCS="${PROCS:-2}"
REPORT="${REPORT:-$OUT/report-$DRIVER}"
log() { printf '[conformance %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

case "$DRIVER" in
  block|nfs|iscsi) ;;
  *) echo "DRIVER must be block, nfs or iscsi, not $DRIVER" >&2; exit 2 ;;
esac
SUITES="${SUITES:-provisioning|volume-modify|volumes|volumeIO|volumeMode|subPath|multiVolume|read-write-once-pod|topology|snapshottable|volume-expand|fsgroupchangepolicy|ephemeral|volumeLimits|capacity|snapshottable-stress|volume-stress|volumegroupsnapshottable}"
DRIVER_FILE="$REPO/test/conformance/$DRIVER.yaml"
[[ -f "$DRIVER_FILE" ]] || { echo "no driver file $DRIVER_FILE" >&2; exit 2; }
GROUP_E2E_VERSION="${GROUP_E2E_VERSION:-v1.35.4}"
GROUP_DRIVER_FILE="$REPO/test/conformance/$DRIVER-group.yaml"
# volumegroupsnapshottable leaves SUITES for a run of its own.
GROUP=0
IFS='|' read -r -a names <<<"$SUITES"
rest=()
for n in "${names[@]}"; do
  if [[ "$n" == volumegroupsnapshottable ]]; then GROUP=1; else rest+=("$n"); fi
done
SUITES=$(IFS='|'; echo "${rest[*]}")
if [[ "$GROUP" == 1 && ! -f "$GROUP_DRIVER_FILE" ]]; then
  log "volumegroupsnapshottable: no $GROUP_DRIVER_FILE for $DRIVER, not run"
  GROUP=0
fi
if [[ -z "$SUITES" && "$GROUP" == 0 ]]; then
  log "no suite to run for $DRIVER"
  exit 0
fi
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then
  [[ -z "$SUITES" ]] || bash "$HERE/build.sh"
  [[ "$GROUP" == 0 ]] || E2E_VERSION="$GROUP_E2E_VERSION" bash "$HERE/build.sh"
  exit 0
fi

# The local cluster's nodes share this kernel: NFS volumes mount only where
# it has an NFS client (docs/conformance.md).
LOCAL=0 VM=0
[[ -z "${KUBECONFIG:-}" || "$KUBECONFIG" == "$BUILD/cluster/admin.kubeconfig" ]] && LOCAL=1
[[ "${KUBECONFIG:-}" == "$BUILD/cluster-vm/admin.kubeconfig" ]] && VM=1
if [[ "$LOCAL" == 1 && "$DRIVER" == nfs ]] && ! grep -qw nfs4 /proc/filesystems && ! modprobe -q nfsv4 2>/dev/null; then
  log "DRIVER=nfs: this kernel has no NFS client, so no pod of the local cluster can mount an NFS volume;"
  log "run it on the VM cluster (make conformance-vm) or with KUBECONFIG naming a cluster whose nodes have one (docs/conformance.md)"
  exit 0
fi
if [[ "$LOCAL" == 1 && "$DRIVER" == iscsi ]]; then
  log "DRIVER=iscsi: the local cluster serves block volumes over loop devices, and this kernel has no iSCSI initiator;"
  log "run it on the VM cluster (make conformance-vm), whose chart has iscsi.enabled (docs/conformance.md)"
  exit 2
fi

[[ -z "$SUITES" ]] || bash "$HERE/build.sh"
[[ "$GROUP" == 0 ]] || E2E_VERSION="$GROUP_E2E_VERSION" bash "$HERE/build.sh"
export KUBECONFIG="${KUBECONFIG:-$BUILD/cluster/admin.kubeconfig}"
export PATH="$BUILD/k8s/bin:$PATH"  # the suite runs kubectl exec
if [[ "$LOCAL" == 1 ]]; then
  if ! kubectl get --raw /readyz >/dev/null 2>&1 \
     || ! kubectl get csidriver modeguard.csi.dev >/dev/null 2>&1; then
    log "no local cluster with modeguard answers: make cluster-up"
    make -C "$REPO" cluster-up
  fi
  bash "$HERE/images.sh"  # elsewhere the nodes pull the test images
  # volumeLimits fills one node up to its limit and takes the node to hold no
  # other volume of the driver: the claim deploy.sh proves the cluster with goes.
  kubectl -n default delete pod mg-local-test --ignore-not-found --wait=true --timeout=120s >/dev/null
  kubectl -n default delete pvc mg-local-test --ignore-not-found --wait=true --timeout=120s >/dev/null
elif [[ "$VM" == 1 ]]; then
  # The VMs' node disks hold the test images (SEED_EXTRA of vm-seed.sh) or
  # nothing would: they cannot pull, and importing under emulation takes
  # minutes per node. Each kubelet lists the images it has.
  want=registry.k8s.io/e2e-test-images/agnhost:2.56
  for node in $(kubectl get nodes -o name); do
    images=$(kubectl get "$node" -o jsonpath='{.status.images[*].names[*]}')
    [[ " $images " == *" $want "* ]] \
      || { echo "$node has no $want: bring the VM cluster up with the test images (make conformance-vm)" >&2; exit 1; }
  done
fi

# Specs that cannot pass here, kept in test/conformance/skip-$DRIVER.txt
# (docs/conformance.md says why for each), plus $SKIP.
skip=$(grep -vE '^\s*(#|$)' "$REPO/test/conformance/skip-$DRIVER.txt" 2>/dev/null | paste -sd'|' || true)
[[ -n "${SKIP:-}" ]] && skip="${skip:+$skip|}$SKIP"
skip_args=()
[[ -n "$skip" ]] && skip_args=(--skip="$skip")

# run_suites BIN MODULE DRIVER_FILE SUITES REPORT: one Ginkgo run of e2e.test
# BIN, from the scratch module MODULE, whose go.mod has the ginkgo the CLI
# next to BIN was built from.
run_suites() {
  local bin=$1 mod=$2 file=$3 suites=$4 report=$5 focus start rc=0
  rm -rf "$report"; mkdir -p "$report"; report=$(cd "$report" && pwd)
  # Spec names read "External Storage [Driver: modeguard.csi.dev] [Testpattern: ...] <suite> <spec>".
  focus="External.Storage \\[Driver: modeguard\\.csi\\.dev\\] \\[Testpattern: [^]]*\\] ($suites) "
  log "running $DRIVER with $(basename "$(dirname "$bin")")/e2e.test $(cat "$(dirname "$bin")/VERSION") and $(basename "$file"): suites ($suites) with $PROCS workers; log in $report/e2e.log"
  start=$(date +%s)
  (cd "$mod" && "$(dirname "$bin")/ginkgo" --procs="$PROCS" --focus="$focus" "${skip_args[@]}" \
      --timeout="${GINKGO_TIMEOUT:-4h}" --no-color --silence-skips --junit-report=junit.xml --output-dir="$report" \
      "$bin" -- \
      -storage.testdriver="$file" -repo-root="$REPO" \
      -kubeconfig="$KUBECONFIG" -provider=skeleton -node-os-distro=debian \
      -disable-log-dump -report-dir="$report") >"$report/e2e.log" 2>&1 || rc=$?
  log "took $(( $(date +%s) - start )) s, exit $rc"
  python3 "$HERE/summary.py" "$report/junit.xml" || true
  if (( rc != 0 )); then
    echo "--- failures (tail of $report/e2e.log) ---"
    grep -E '^\s*\[FAIL\]|^  \[FAILED\]|Summarizing' -A3 "$report/e2e.log" | tail -60
  fi
  return $rc
}

rc=0
if [[ -n "$SUITES" ]]; then
  run_suites "$OUT/bin/e2e.test" "$HERE/e2e-build" "$DRIVER_FILE" "$SUITES" "$REPORT" || rc=$?
fi
if [[ "$GROUP" == 1 ]]; then
  run_suites "$OUT/bin-$GROUP_E2E_VERSION/e2e.test" "$HERE/e2e-build-$GROUP_E2E_VERSION" "$GROUP_DRIVER_FILE" \
    volumegroupsnapshottable "$REPORT-group" || rc=$?
fi
exit $rc

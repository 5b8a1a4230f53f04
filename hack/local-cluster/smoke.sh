#!/usr/bin/env bash
# Proves a cluster started by up.sh runs pods: a busybox pod reaches Running, `kubectl exec`
# and `kubectl logs` work (apiserver -> kubelet via the Hostname address "localhost"),
# the pod has an address from the CNI plugin, and the host reaches it. Bounded waits.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
K=("$BUILD/k8s/bin/kubectl" --kubeconfig "$BUILD/cluster/admin.kubeconfig" --request-timeout=20s)
POD=smoke-busybox
"${K[@]}" delete pod "$POD" --ignore-not-found --grace-period=1 --wait=true --timeout=30s >/dev/null
"${K[@]}" run "$POD" --image=localhost/modeguard/busybox:test --restart=Never -- sh -c 'echo smoke-ok; exec sleep 3600'
"${K[@]}" wait --for=condition=Ready "pod/$POD" --timeout=60s
"${K[@]}" get pod "$POD" -o wide
out=$("${K[@]}" exec "$POD" -- sh -c 'echo exec-ok $(hostname)')
[[ "$out" == "exec-ok $POD" ]] || { echo "unexpected exec output: $out" >&2; exit 1; }
echo "$out"
logs=$("${K[@]}" logs "$POD")
[[ "$logs" == smoke-ok ]] || { echo "unexpected logs: $logs" >&2; exit 1; }
echo "logs-ok"
ip=$("${K[@]}" get pod "$POD" -o jsonpath='{.status.podIP}')
"$BUILD/debs/bin/busybox" ping -c1 -W2 "$ip" >/dev/null && echo "host reaches pod at $ip"
"${K[@]}" delete pod "$POD" --grace-period=1 --wait=true --timeout=30s >/dev/null
echo "smoke test passed"

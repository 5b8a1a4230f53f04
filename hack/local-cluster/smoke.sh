#!/usr/bin/env bash
# Proves a cluster started by up.sh runs pods on every node: a busybox pod per node reaches
# Running, `kubectl exec` and `kubectl logs` work (apiserver -> kubelet by the node's Hostname
# address, which is the kubelet's own loopback address), the pod has an address from the CNI
# plugin, and the host reaches it. Bounded waits (SMOKE_WAIT seconds for a pod to be Ready,
# default 60, and for its deletion, default 30). CLUSTER_DIR: another cluster's (vm-up.sh's _build/cluster-vm).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
K=("$BUILD/k8s/bin/kubectl" --kubeconfig "${CLUSTER_DIR:-$BUILD/cluster}/admin.kubeconfig" --request-timeout=20s)
i=0
for node in $("${K[@]}" get nodes -o jsonpath='{.items[*].metadata.name}'); do
  POD=smoke-busybox-$i; i=$((i + 1))
  "${K[@]}" delete pod "$POD" --ignore-not-found --grace-period=1 --wait=true --timeout="${SMOKE_WAIT:-30}s" >/dev/null
  "${K[@]}" run "$POD" --image=localhost/modeguard/busybox:test --image-pull-policy=Never --restart=Never \
    --overrides="{\"apiVersion\":\"v1\",\"spec\":{\"nodeName\":\"$node\"}}" -- sh -c 'echo smoke-ok; exec sleep 3600' >/dev/null
  "${K[@]}" wait --for=condition=Ready "pod/$POD" --timeout="${SMOKE_WAIT:-60}s" >/dev/null
  out=$("${K[@]}" exec "$POD" -- sh -c 'echo exec-ok $(hostname)')
  [[ "$out" == "exec-ok $POD" ]] || { echo "$node: unexpected exec output: $out" >&2; exit 1; }
  logs=$("${K[@]}" logs "$POD")
  [[ "$logs" == smoke-ok ]] || { echo "$node: unexpected logs: $logs" >&2; exit 1; }
  ip=$("${K[@]}" get pod "$POD" -o jsonpath='{.status.podIP}')
  "$BUILD/debs/bin/busybox" ping -c1 -W2 "$ip" >/dev/null
  echo "node $node: pod $POD at $ip runs; exec, logs and host -> pod work"
  "${K[@]}" delete pod "$POD" --grace-period=1 --wait=true --timeout="${SMOKE_WAIT:-30}s" >/dev/null
done
echo "smoke test passed"

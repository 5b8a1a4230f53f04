#!/usr/bin/env bash
# Measures a cluster started by vm-up.sh (docs/vm-cluster.md):
#   - per node, a busybox pod's start: created -> Running, as the client sees it and as the
#     pod's status says; then exec and logs through the node's kubelet, and host -> pod ping;
#   - per VM, the resident memory of its qemu on the host and the memory the guest uses;
#   - idle (no pod) for IDLE_SECONDS (default 60): the CPU each qemu, the control plane and
#     the whole host take, in percent of one core.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
C="${CLUSTER_DIR:-$BUILD/cluster-vm}"
K=("$BUILD/k8s/bin/kubectl" --kubeconfig "$C/admin.kubeconfig" --request-timeout=30s)
VMC="$C/bin/vmcluster"
IDLE="${IDLE_SECONDS:-60}"
POD_WAIT="${POD_WAIT:-300}"
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", b - a}'; }

echo "== pod start per node"
i=0
for node in $("${K[@]}" get nodes -o jsonpath='{.items[*].metadata.name}'); do
  POD=measure-$i; i=$((i + 1))
  "${K[@]}" delete pod "$POD" --ignore-not-found --grace-period=1 --wait=true >/dev/null
  t0=$(now)
  "${K[@]}" run "$POD" --image=localhost/modeguard/busybox:test --image-pull-policy=Never --restart=Never \
    --overrides="{\"apiVersion\":\"v1\",\"spec\":{\"nodeName\":\"$node\",\"terminationGracePeriodSeconds\":1}}" \
    -- sh -c 'echo measure-ok; exec sleep 3600' >/dev/null
  "${K[@]}" wait --for=jsonpath='{.status.phase}'=Running "pod/$POD" --timeout="${POD_WAIT}s" >/dev/null
  t1=$(now)
  "${K[@]}" wait --for=condition=Ready "pod/$POD" --timeout="${POD_WAIT}s" >/dev/null
  t2=$(now)
  created=$("${K[@]}" get pod "$POD" -o jsonpath='{.metadata.creationTimestamp}')
  started=$("${K[@]}" get pod "$POD" -o jsonpath='{.status.containerStatuses[0].state.running.startedAt}')
  out=$("${K[@]}" exec "$POD" -- sh -c 'echo exec-ok $(hostname)')
  [[ "$out" == "exec-ok $POD" ]] || { echo "$node: unexpected exec output: $out" >&2; exit 1; }
  logs=$("${K[@]}" logs "$POD")
  [[ "$logs" == measure-ok ]] || { echo "$node: unexpected logs: $logs" >&2; exit 1; }
  ip=$("${K[@]}" get pod "$POD" -o jsonpath='{.status.podIP}')
  "$BUILD/debs/bin/busybox" ping -c1 -W5 "$ip" >/dev/null
  echo "node $node: created -> Running $(secs "$t0" "$t1") s, Ready $(secs "$t0" "$t2") s" \
    "(status: created $created, container started $started); exec, logs, host -> pod $ip work"
  t0=$(now)
  "${K[@]}" delete pod "$POD" --grace-period=1 --wait=true >/dev/null
  echo "node $node: pod deleted in $(secs "$t0" "$(now)") s"
done

echo "== memory per VM"
declare -A QEMU=()
for f in "$C"/vms/*/vm.json; do
  name=$(sed -n 's/.*"name":"\([^"]*\)".*/\1/p' "$f")
  pid=$(sed -n 's/.*"pid":\([0-9]*\).*/\1/p' "$f")
  QEMU[$name]=$pid
  rss=$(awk '/^VmRSS/ {print int($2 / 1024)}' "/proc/$pid/status")
  guest=$("$VMC" run -dir "$C/vms" "$name" -- free -m | awk '/^Mem:/ {print "total " $2 " MiB, used " $3 " MiB, buff/cache " $6 " MiB"}')
  echo "$name: qemu RSS $rss MiB; guest: $guest"
done

echo "== idle CPU over ${IDLE} s (percent of one core)"
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
declare -A before=()
for n in "${!QEMU[@]}"; do before[q:$n]=$(ticks "${QEMU[$n]}"); done
declare -A CP=()
while read -r name pid; do
  [[ -r /proc/$pid/stat ]] && CP[$name]=$pid && before[c:$name]=$(ticks "$pid")
done <"$C/pids"
read -r _ u ni s _ <"/proc/stat"
host0=$((u + ni + s))
load0=$(cut -d' ' -f1-3 /proc/loadavg)
sleep "$IDLE"
read -r _ u ni s _ <"/proc/stat"
for n in $(printf '%s\n' "${!QEMU[@]}" | sort); do
  echo "qemu $n: $(awk -v d="$(( $(ticks "${QEMU[$n]}") - ${before[q:$n]} ))" -v hz="$hz" -v t="$IDLE" 'BEGIN {printf "%.1f", 100 * d / hz / t}') %"
done
cp=0
for n in "${!CP[@]}"; do cp=$((cp + $(ticks "${CP[$n]}") - ${before[c:$n]})); done
echo "control plane (etcd, apiserver, controller-manager, scheduler, snapshot-controller): $(awk -v d="$cp" -v hz="$hz" -v t="$IDLE" 'BEGIN {printf "%.1f", 100 * d / hz / t}') %"
echo "host busy: $(awk -v d="$(( u + ni + s - host0 ))" -v hz="$hz" -v t="$IDLE" 'BEGIN {printf "%.1f", 100 * d / hz / t}') % of one core ($(nproc) cores); load average before $load0, after $(cut -d' ' -f1-3 /proc/loadavg)"

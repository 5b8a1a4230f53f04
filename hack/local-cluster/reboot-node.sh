#!/usr/bin/env bash
# Does to one node of the local cluster what a reboot does, then boots it again:
#   - its kubelet, its containerd, the containerd shims and every pod process of the node are
#     killed (SIGKILL: a reboot asks nobody);
#   - every mount below the node's directory goes (the staging and target mounts of its
#     volumes, pod network namespaces, container root filesystems), and the loop devices those
#     mounts used are detached: what the node's kernel held is gone;
#   - what is on disk stays: the kubelet's root directory, containerd's root, the node plugin's
#     --state-dir (below _build/modeguard-local/node);
#   - containerd and the kubelet start again with the same configuration, and the kubelet
#     brings the node's pods back (the node plugin's among them).
# The node's kernel is the machine's, so its boot id does not change: the driver must notice
# the lost mounts and devices from the kernel itself. Usage: reboot-node.sh NODE (one of NODES,
# e.g. 127.0.0.2). Needs root and a cluster started by up.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_TAG=reboot-node
source "$HERE/lib.sh"

[[ $EUID -eq 0 ]] || die "must run as root"
node=${1:-}
[[ -n "$node" ]] || die "usage: reboot-node.sh NODE (one of: $NODES)"
idx=-1 i=0
for nz in $NODES; do
  [[ "${nz%%=*}" == "$node" ]] && idx=$i
  i=$((i + 1))
done
((idx >= 0)) || die "$node is not a node of this cluster ($NODES)"
N="$NODES_DIR/$node"
[[ -d "$N" && -s "$C/pids" ]] || die "no running cluster with node $node: run up.sh first"

# The last PID recorded for NAME, if it still runs one of our binaries (a recycled PID is not).
recorded_pid() {
  local pid
  pid=$(awk -v n="$1" '$1 == n {p = $2} END {print p}' "$C/pids")
  [[ -n "$pid" ]] && ours_exe "$pid" && echo "$pid"
  return 0
}
# kill_now PID: SIGKILL and wait until it is gone (reparented to init, which reaps it).
kill_now() {
  local pid=$1
  kill -KILL "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]]; do sleep 0.05; done
}

log "rebooting node $node"
pid=$(recorded_pid "kubelet-$node")
[[ -n "$pid" ]] && kill_now "$pid"
# Pod processes: the children of the shims that name THIS node's containerd socket.
sock="$N/containerd/containerd.sock"
for d in /proc/[0-9]*; do
  cmd=$(tr '\0' ' ' 2>/dev/null <"$d/cmdline") || continue
  [[ "$cmd" == *containerd-shim-runc-v2* && "$cmd" == *"$sock"* ]] || continue
  s=${d#/proc/}
  for child in $(cat "/proc/$s/task/$s/children" 2>/dev/null); do kill_now "$child"; done
  kill_now "$s"
done
pid=$(recorded_pid "containerd-$node")
[[ -n "$pid" ]] && kill_now "$pid"

# The loop devices the node's mounts use: a filesystem on one (major 7), or a device node bound
# at a raw block volume's target (root /loopN of devtmpfs).
mapfile -t loops < <(awk -v p="$N/" 'index($5, p) == 1 {
    split($3, mm, ":"); if (mm[1] == 7) print "7:" mm[2];
    if ($4 ~ /^\/loop[0-9]+$/) print "dev:" substr($4, 2)
  }' /proc/self/mountinfo | sort -u)
for i in 1 2 3; do
  mapfile -t mnts < <(awk -v p="$N/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r)
  ((${#mnts[@]})) || break
  for m in "${mnts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "cannot unmount $m"; done
done
for l in "${loops[@]}"; do
  case "$l" in
    7:*) dev=/dev/$(basename "$(readlink "/sys/dev/block/$l" 2>/dev/null)") ;;
    dev:*) dev=/dev/${l#dev:} ;;
  esac
  [[ "$dev" =~ ^/dev/loop[0-9]+$ ]] || continue
  if [[ -s "/sys/block/${dev#/dev/}/loop/backing_file" ]]; then
    losetup -d "$dev" && log "detached $dev"
  fi
done
for f in "$C/logs/kubelet-$node.log" "$C/logs/containerd-$node.log"; do
  [[ -f "$f" ]] && mv "$f" "$f.before-reboot"
done

log "booting node $node again"
start_node "$node" "$idx"
wait_for "kubelet /healthz of $node" "$WAIT" curl -sf "http://$node:10248/healthz"
wait_for "node $node Ready" "$WAIT" "${KUBECTL[@]}" wait --for=condition=Ready "node/$node" --timeout=2s
log "node $node is back"

#!/usr/bin/env bash
# Stops what hack/local-cluster/up.sh started, by the PIDs in _build/cluster/pids (SIGTERM,
# then SIGKILL after a bounded wait): the kubelets, pod processes (found under the containerd
# shims that name one of OUR containerd sockets), the containerds, control plane, etcd. Then detaches
# the loop devices a kubelet left on raw block volumes and unmounts everything under _build/cluster (netns bind mounts included), removes the host veths of our CNI plugin,
# the cgroups made for the kubelet, and restores the host sysctls the kubelet changed.
# PURGE=1 also deletes _build/cluster (PKI, etcd data, images). HOST_NODES=0 (vm-down.sh: a
# cluster with no node on the host) leaves the host's veths and kubelet cgroups alone: they
# may be the local cluster's, running beside it.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
C="${CLUSTER_DIR:-$BUILD/cluster}"
CGROUP_ROOT=/modeguard-local
TERM_WAIT="${TERM_WAIT_SECONDS:-10}"

log() { printf '[down %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# stop_pid NAME PID: TERM, wait up to TERM_WAIT s, then KILL.
stop_pid() {
  local name=$1 pid=$2
  kill -0 "$pid" 2>/dev/null || return 0
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null
  local deadline=$(( $(date +%s) + TERM_WAIT ))
  while kill -0 "$pid" 2>/dev/null; do
    if (( $(date +%s) >= deadline )); then
      log "$name (pid $pid) ignored SIGTERM for ${TERM_WAIT}s; SIGKILL"
      kill -KILL "$pid" 2>/dev/null
      sleep 0.2
      break
    fi
    sleep 0.1
  done
}

# A recorded PID counts only while it still runs one of our binaries (guards against reuse).
# shellcheck source=ours.sh
source "$HERE/ours.sh"
ours() { ours_exe "$1"; }
declare -A PID_OF=()
if [[ -s "$C/pids" ]]; then
  while read -r name pid; do
    if ours "$pid"; then PID_OF[$name]=$pid; fi
  done <"$C/pids"
fi
# 1. The kubelets, so that they restart nothing.
for n in "${!PID_OF[@]}"; do
  [[ "$n" == kubelet* ]] && stop_pid "$n" "${PID_OF[$n]}" &
done
wait

# 2. Pod processes. containerd-shim-runc-v2 processes outlive containerd; ours carry one of
# OUR containerd socket paths (below $C/nodes) on their command line (that is how they are
# found, never by program name). Test pods are disposable: their processes get SIGTERM and 1 s, then SIGKILL.
shims=()
for d in /proc/[0-9]*; do
  cmd=$(tr '\0' ' ' 2>/dev/null <"$d/cmdline") || continue
  if [[ "$cmd" == *containerd-shim-runc-v2* && "$cmd" == *"$C/nodes/"*"/containerd/containerd.sock"* ]]; then
    shims+=("${d#/proc/}")
  fi
done
for s in "${shims[@]}"; do
  for child in $(cat "/proc/$s/task/$s/children" 2>/dev/null); do
    TERM_WAIT=1 stop_pid "pod process (shim $s)" "$child" &
  done
done
wait
# 3. containerd and the shims, then the control plane in parallel, etcd last.
for n in "${!PID_OF[@]}"; do
  [[ "$n" == containerd* ]] && stop_pid "$n" "${PID_OF[$n]}" &
done
for s in "${shims[@]}"; do stop_pid "containerd-shim (pid $s)" "$s" & done
for n in kube-scheduler kube-controller-manager kube-apiserver; do
  [[ -n "${PID_OF[$n]:-}" ]] && stop_pid "$n" "${PID_OF[$n]}" &
done
wait
[[ -n "${PID_OF[etcd]:-}" ]] && stop_pid etcd "${PID_OF[etcd]}"
# anything else recorded (future additions), in reverse order
if [[ -s "$C/pids" ]]; then
  tac "$C/pids" | while read -r name pid; do if ours "$pid"; then stop_pid "$name" "$pid"; fi; done
fi

# A kubelet holds each raw block volume it maps with a loop device of its own, backed by the
# device node it bound below its root; a kubelet that was killed never releases them, and they
# keep the volume's loop device (and so its pool) busy. Their backing path names the cluster
# dir only while that bind mount exists: detach them before unmounting.
for f in /sys/block/loop*/loop/backing_file; do
  [[ -r "$f" && "$(cat "$f" 2>/dev/null)" == "$C/"* ]] || continue
  dev=/dev/$(basename "$(dirname "$(dirname "$f")")")
  losetup -d "$dev" 2>/dev/null && log "detached $dev (a kubelet's hold on a raw block volume)"
done

# Unmount everything below the cluster dir, deepest first (overlay rootfs, netns, volumes).
if [[ -d "$C" ]]; then
  for i in 1 2 3; do
    mapfile -t mnts < <(awk -v p="$C/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r)
    ((${#mnts[@]})) || break
    for m in "${mnts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "cannot unmount $m"; done
  done
fi

# The driver's storage (pools, node state, NFS images, ganesha's files): a cluster starts with
# empty etcd, so volumes recorded there would be orphans. Unmount what is still mounted below
# it, detach the loop devices backed by its files, then delete it (KEEP_STATE=1 keeps it).
# The loop devices of volume images go first: they keep the pools' btrfs (its own loop device,
# released by its unmount) busy.
MG="$BUILD/modeguard-local"
# shellcheck source=pool-loops.sh
source "$HERE/pool-loops.sh"
detach_loops_under_mg() {
  local f dev
  for f in /sys/block/loop*/loop/backing_file; do
    [[ -r "$f" ]] || continue
    if [[ "$(cat "$f")" == "$MG/"* && "$(cat "$f")" != "$MG"/pool-*.img ]]; then
      dev=/dev/$(basename "$(dirname "$(dirname "$f")")")
      losetup -d "$dev" 2>/dev/null && log "detached $dev ($(cat "$f" 2>/dev/null))"
    fi
  done
  # Bound to a file of a pool through a mount that is gone: named by another path.
  for dev in $(pool_bound_loops "$MG"); do
    losetup -d "$dev" 2>/dev/null && log "detached $dev (a file on a pool's filesystem)"
  done
  return 0
}
if [[ -d "$MG" ]]; then
  mapfile -t mnts < <(awk -v p="$MG/" 'index($2, p) == 1 && $2 !~ "^" p "pools/zone-[^/]*$" {print $2}' /proc/self/mounts | sort -r)
  for m in "${mnts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "cannot unmount $m"; done
  detach_loops_under_mg
  for pool in "$MG"/pools/*/; do
    pool=${pool%/}
    if mountpoint -q "$pool"; then
      umount "$pool" 2>/dev/null || umount -l "$pool" 2>/dev/null || log "cannot unmount $pool"
    fi
  done
  if [[ "${KEEP_STATE:-0}" != 1 ]]; then rm -rf "$MG"; fi
fi

# Host ends of our CNI veths (named mg<container-id prefix>) and their addresses.
[[ "${HOST_NODES:-1}" == 0 ]] || for l in /sys/class/net/mg*; do
  [[ -e "$l" ]] || continue
  n=$(basename "$l")
  if [[ "$n" =~ ^mg[0-9a-f]{12}$ ]]; then ip link del "$n" 2>/dev/null && log "removed veth $n"; fi
done
rm -rf "$C"/nodes/*/cni/data/ips 2>/dev/null

# Cgroups made for the kubelet (only empty ones can go; deepest first).
[[ "${HOST_NODES:-1}" == 0 ]] || for h in /sys/fs/cgroup/*/; do
  [[ -d "$h${CGROUP_ROOT#/}" ]] || continue
  find "$h${CGROUP_ROOT#/}" -depth -type d -exec rmdir {} \; 2>/dev/null
done

# Host sysctls the kubelet changed, back to what up.sh found.
if [[ -s "$C/sysctl.saved" ]]; then
  while read -r k v; do echo "$v" >"/proc/sys/$k" 2>/dev/null || log "cannot restore $k"; done <"$C/sysctl.saved"
  rm -f "$C/sysctl.saved"
fi

: >"$C/pids" 2>/dev/null
if [[ "${PURGE:-0}" == 1 ]]; then
  log "removing $C"
  rm -rf "$C"
fi
log "down"

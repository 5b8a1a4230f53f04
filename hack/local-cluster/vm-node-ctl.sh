#!/usr/bin/env bash
# What happens to a worker VM of vm-up.sh in a node's life, for tests and by hand:
#   vm-node-ctl.sh reboot NODE            cut the VM's power (SIGKILL to qemu: nothing flushed,
#                                         nothing unmounted) and boot it again on the same node
#                                         disk; its containerd and kubelet start again
#                                         (vm-node.sh), as a machine's init would start them
#   vm-node-ctl.sh restart-kubelet NODE   stop the node's kubelet (SIGTERM) and start it again;
#                                         its pods, their mounts and containerd stay
# NODE: the VM's name (vm1) or its address, which is its node name (10.98.0.21). Returns
# once the kubelet answers on /healthz again.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
C="${CLUSTER_DIR:-$BUILD/cluster-vm}"
VMC="$C/bin/vmcluster"
die() { printf '[vm-node-ctl %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

(($# == 2)) || die "usage: vm-node-ctl.sh reboot|restart-kubelet NODE"
action=$1 node=$2
name=""
for rec in "$C"/vms/*/vm.json; do
  [[ -e "$rec" ]] || break
  n=$(basename "$(dirname "$rec")")
  if [[ "$n" == "$node" ]] || grep -Eq "\"addr\": ?\"${node//./\\.}\"" "$rec"; then name=$n; fi
done
[[ -n "$name" ]] || die "no VM named or addressed $node in $C/vms"
mapfile -t envargs < <(sed 's/^/-e\n/' "$C/vms/$name/node.env")

case "$action" in
  reboot)
    "$VMC" reboot -dir "$C/vms" "$name"
    "$VMC" run -dir "$C/vms" "${envargs[@]}" "$name" -- bash "$HERE/vm-node.sh" >>"$C/vms/$name/vm-node.log" 2>&1 ||
      die "$name: vm-node.sh failed after the reboot (see $C/vms/$name/vm-node.log)"
    ;;
  restart-kubelet)
    "$VMC" run -dir "$C/vms" "${envargs[@]}" -e ONLY=kubelet "$name" -- bash "$HERE/vm-node.sh" >>"$C/vms/$name/vm-node.log" 2>&1 ||
      die "$name: restarting the kubelet failed (see $C/vms/$name/vm-node.log)"
    ;;
  *) die "unknown action $action: reboot or restart-kubelet" ;;
esac
tail -1 "$C/vms/$name/vm-node.log"

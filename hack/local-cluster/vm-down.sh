#!/usr/bin/env bash
# Stops what vm-up.sh started: the VMs (qemu by recorded PID, SIGTERM then SIGKILL: a
# VM's containerd, kubelet and pods go with it), their tap devices, the control plane
# (down.sh with the same CLUSTER_DIR) and the bridge, with the routes through it.
# PURGE=1 also deletes _build/cluster-vm.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
export CLUSTER_DIR="${CLUSTER_DIR:-$BUILD/cluster-vm}"
VM_BRIDGE="${VM_BRIDGE:-mgvbr0}"
C="$CLUSTER_DIR"
rc=0

if compgen -G "$C/vms/*/vm.json" >/dev/null; then
  VMC="$C/bin/vmcluster"
  if [[ ! -x "$VMC" ]]; then
    mkdir -p "$C/bin"
    (cd "$REPO" && CGO_ENABLED=0 go build -o "$VMC" ./test/vm/vmcluster) || rc=1
  fi
  "$VMC" down -dir "$C/vms" || rc=1
fi
HOST_NODES=0 "$HERE/down.sh" || rc=1
if [[ -e /sys/class/net/$VM_BRIDGE ]]; then
  ip link del "$VM_BRIDGE" && echo "[vm-down] removed bridge $VM_BRIDGE" || rc=1
fi
if [[ -s "$C/host-ip-forward" ]]; then
  cat "$C/host-ip-forward" >/proc/sys/net/ipv4/ip_forward || rc=1
  rm -f "$C/host-ip-forward"
fi
# The node disks (sparse, up to VM_DISK_MB each) are made anew by every vm-up.sh.
rm -f "$C"/vms/*/disk.img
# The mount points vm-node.sh made in the root the VMs share with the host (9p), where
# nothing else was: removed while empty.
rmdir /var/lib/modeguard /etc/modeguard /var/lib/kubelet /var/log/containers 2>/dev/null || true
exit $rc

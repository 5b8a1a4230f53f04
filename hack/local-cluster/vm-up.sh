#!/usr/bin/env bash
# Starts a Kubernetes v1.34.4 cluster whose worker nodes are qemu VMs (software emulation)
# on Debian's kernel, the one the VM harness boots (test/vm/vmtest), which has the NFS
# client and the iSCSI initiator the host's kernel lacks. The control plane runs on the host
# (up.sh with NODES="": etcd, apiserver, controller-manager, scheduler, snapshot-controller),
# the apiserver listening on the address of a bridge of the host (VM_BRIDGE, VM_NET.1/24);
# each VM (test/vm/vmcluster) has a tap on that bridge, its own address, a node disk and a
# containerd and a kubelet of its own (vm-node.sh) that reach the apiserver over the bridge.
#
#   VM_NODES="vm1=zone-a vm2=zone-a vm3=zone-b"
#                                      NAME=ZONE per VM; the i-th VM (from 1) gets the
#                                      address VM_NET.(20+i), which is also its node name, and
#                                      its pods 10.244.(10+i).0/24
#   VM_NET=10.98.0  VM_BRIDGE=mgvbr0
#   VM_MEMORY_MB=1536                  the node that runs the controller (six containers and
#                                      ganesha) with a 1 GiB VM is short of memory
#   VM_DISK_MB=8192                    the node disk (sparse), made by vm-seed.sh with every
#                                      image the nodes run in its containerd
#   SEED_EXTRA=""                      more image archives for that disk (vm-seed.sh)
#   VM_TB_SIZE_MB=512                  qemu's cache of translated code per VM: a node's kubelet,
#                                      containerd and pods fill about 450 MiB of qemu's default
#                                      (1 GiB); a smaller cache is flushed when full and its code
#                                      translated again, which costs the CPU the run is short of
#
# The host reaches every pod (a route per node's pod subnet through the VM). State in
# _build/cluster-vm (CLUSTER_DIR): PKI, etcd, control plane logs (logs/), and per VM
# vms/NAME/{console.log,qemu.log,containerd.log,kubelet.log,disk.img}. The local cluster
# (up.sh) and this one use the same ports: one at a time. Stop with vm-down.sh.
# Needs: root, qemu-system-x86_64, hack/local-cluster/build.sh run first.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
export CLUSTER_DIR="${CLUSTER_DIR:-$BUILD/cluster-vm}"
VM_NET="${VM_NET:-10.98.0}"
VM_BRIDGE="${VM_BRIDGE:-mgvbr0}"
VM_NODES="${VM_NODES:-vm1=zone-a vm2=zone-a vm3=zone-b}"
VM_MEMORY_MB="${VM_MEMORY_MB:-1536}"
VM_DISK_MB="${VM_DISK_MB:-8192}"
VM_TB_SIZE_MB="${VM_TB_SIZE_MB:-512}"
export API_ADDRESS="$VM_NET.1" NODES=""
# Under emulation a kubelet takes tens of seconds to start.
export WAIT_SECONDS="${WAIT_SECONDS:-300}"
LOG_TAG=vm-up
# shellcheck source=lib.sh
source "$HERE/lib.sh"

[[ $EUID -eq 0 ]] || die "must run as root"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 is not installed (Debian: qemu-system-x86)"
[[ "$VM_NET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "VM_NET '$VM_NET' is not three octets"
[[ -e /sys/class/net/$VM_BRIDGE ]] && die "bridge $VM_BRIDGE exists: run vm-down.sh first"
names=() addrs=() zones=()
i=0
for nz in $VM_NODES; do
  i=$((i + 1))
  [[ "$nz" =~ ^[a-z0-9]+=[a-z0-9-]+$ ]] || die "VM_NODES entry '$nz' is not name=zone"
  names+=("${nz%%=*}") zones+=("${nz#*=}") addrs+=("$VM_NET.$((20 + i))")
done
((${#names[@]})) || die "VM_NODES is empty"

T0=$(date +%s.%N)
since() { printf '%.1f' "$(echo "$(date +%s.%N) - $1" | bc)"; }

# The tool that boots the VMs and runs commands in them.
VMC="$C/bin/vmcluster"
mkdir -p "$C/bin"
(cd "$REPO" && CGO_ENABLED=0 go build -o "$VMC" ./test/vm/vmcluster)
SEED=$(VM_DISK_MB="$VM_DISK_MB" "$HERE/vm-seed.sh") # every node's disk, images in its containerd

log "bridge $VM_BRIDGE $API_ADDRESS/24"
ip link add "$VM_BRIDGE" type bridge
ip addr add "$API_ADDRESS/24" dev "$VM_BRIDGE"
ip link set "$VM_BRIDGE" up
# The host routes each node's pod subnet to its VM (below), so a pod reaches another node's
# pods through the host, as a cluster network joins its nodes: the host forwards between the
# bridge's ports. The setting it had is kept for vm-down.sh to restore.
cat /proc/sys/net/ipv4/ip_forward >"$C/host-ip-forward"
echo 1 >/proc/sys/net/ipv4/ip_forward

t=$(date +%s.%N)
"$HERE/up.sh"
T_CP=$(since "$t")
for k in "${!names[@]}"; do
  a=${addrs[$k]}
  cert "kubelet-$a" "system:node:$a" system:nodes "" clientAuth
  cert "kubelet-serving-$a" "$a" "" "IP:$a" serverAuth
done

t=$(date +%s.%N)
vmargs=()
for k in "${!names[@]}"; do vmargs+=("${names[$k]}=${addrs[$k]}"); done
"$VMC" up -dir "$C/vms" -bridge "$VM_BRIDGE" -memory "$VM_MEMORY_MB" -disk-seed "$SEED" -tb-size "$VM_TB_SIZE_MB" "${vmargs[@]}"
T_BOOT=$(since "$t")

t=$(date +%s.%N)
log "making the VMs nodes (vm-node.sh; logs in $C/vms/NAME/)"
pids=()
for k in "${!names[@]}"; do
  n=${names[$k]} a=${addrs[$k]}
  # What vm-node.sh needs, kept for vm-node-ctl.sh (a reboot runs it again).
  printf '%s\n' NODE="$a" POD_SUBNET="10.244.$((11 + k))" LOCAL="$C/vms/$n/local" LOGS="$C/vms/$n" \
    CLUSTER_DIR="$C" API_ADDRESS="$API_ADDRESS" BUILD_DIR="$BUILD" WAIT_SECONDS="$WAIT_SECONDS" >"$C/vms/$n/node.env"
  mapfile -t envargs < <(sed 's/^/-e\n/' "$C/vms/$n/node.env")
  "$VMC" run -dir "$C/vms" "${envargs[@]}" "$n" -- bash "$HERE/vm-node.sh" >"$C/vms/$n/vm-node.log" 2>&1 &
  pids+=($!)
done
failed=0
for k in "${!names[@]}"; do
  if ! wait "${pids[$k]}"; then
    failed=1
    tail -20 "$C/vms/${names[$k]}/vm-node.log" >&2
    log "${names[$k]}: vm-node.sh failed (kubelet.log, containerd.log, console.log in $C/vms/${names[$k]})"
  fi
done
((failed == 0)) || die "a VM did not become a node"
T_NODE=$(since "$t")
for k in "${!names[@]}"; do
  grep -h 'uptime' "$C/vms/${names[$k]}/vm-node.log" | sed "s/^/  ${names[$k]}: /"
  ip route replace "10.244.$((11 + k)).0/24" via "${addrs[$k]}" dev "$VM_BRIDGE"
done

t=$(date +%s.%N)
for k in "${!names[@]}"; do
  a=${addrs[$k]}
  wait_for "node $a Ready" "$WAIT" "${KUBECTL[@]}" wait --for=condition=Ready "node/$a" --timeout=2s
  "${KUBECTL[@]}" label node "$a" "topology.kubernetes.io/zone=${zones[$k]}" --overwrite >/dev/null
done
T_READY=$(since "$t")
log "cluster up in $(since "$T0") s: control plane ${T_CP} s, VMs booted ${T_BOOT} s, containerd+kubelet ${T_NODE} s, Ready ${T_READY} s more"
log "export KUBECONFIG=$C/admin.kubeconfig"
"${KUBECTL[@]}" get nodes -o wide -L topology.kubernetes.io/zone

#!/usr/bin/env bash
# Runs inside a worker VM (vm-up.sh runs it through the VM's agent): makes the VM a node of
# the cluster in CLUSTER_DIR, a containerd and a kubelet joining the apiserver at
# API_ADDRESS over the bridge. The VM's root filesystem is the host's, seen over 9p, so the
# host's binaries (_build) run here; its kernel, mounts, /run, /proc, /sys, cgroups, sysctls
# and network are its own. What the node keeps goes to its node disk, mounted at LOCAL:
#   LOCAL/node/kubelet           bound at /var/lib/kubelet (shared, for Bidirectional mounts)
#   LOCAL/node/containerd/...    containerd's root; its state and socket are in /run/containerd
#   LOCAL/node/container-logs    bound at /var/log/containers; pod logs in LOCAL/node/pod-logs
#   LOCAL/node/cni/...           the CNI configuration (pods in POD_SUBNET.0/24) and leases
#   LOCAL/node/host/var/lib/modeguard, .../etc/modeguard, .../etc/iscsi
#                                bound at those paths: what the driver's pods keep in host
#                                directories (the chart's defaults) is the node's own, as on
#                                a machine of its own, not the host's root that the VM sees
# Logs go to LOGS on the host (containerd.log, kubelet.log); the PIDs to /run/modeguard-node.
# Environment: NODE (the node's name: its address on the bridge), POD_SUBNET (three octets,
# e.g. 10.244.10), LOCAL, LOGS, CLUSTER_DIR, API_ADDRESS, BUILD_DIR; ONLY=kubelet restarts
# the kubelet alone. Returns once the kubelet answers on /healthz.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${NODE:?}" "${POD_SUBNET:?}" "${LOCAL:?}" "${LOGS:?}" "${CLUSTER_DIR:?}" "${API_ADDRESS:?}"
LOG_TAG="vm-node $NODE"
NODES=""
# shellcheck source=lib.sh
source "$HERE/lib.sh"
uptime_s() { local u _; read -r u _ </proc/uptime; echo "$u"; }
step() { log "[uptime $(uptime_s) s] $*"; }

N="$LOCAL/node"
RUN=/run/modeguard-node

# daemon NAME COMMAND...: in a session of its own (the agent waits for this script only),
# output appended to LOGS/NAME.log, PID in RUN/NAME.pid.
daemon() {
  local name=$1; shift
  setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
  echo $! >"$RUN/$name.pid"
}
start_kubelet() {
  step "starting the kubelet"
  # cAdvisor's per-container housekeeping (every 10 s by default) was the largest share of an
  # idle kubelet's CPU in a profile of a node on one emulated CPU (21 %); the stories read no
  # container statistics, and eviction on such a node waits no longer than 30 s to see memory.
  daemon kubelet kubelet --config="$N/kubelet/config.yaml" --kubeconfig="$N/kubelet.kubeconfig" \
    --hostname-override="$NODE" --node-ip="$NODE" --v=1 \
    --housekeeping-interval=30s
  wait_for "kubelet /healthz" "$WAIT" curl -sf "http://$NODE:10248/healthz"
  step "kubelet healthy"
}

# ONLY=kubelet: restart the running node's kubelet (SIGTERM, as a service manager stops
# it), nothing else: its pods, their mounts and containerd stay.
if [[ "${ONLY:-}" == kubelet ]]; then
  pid=$(cat "$RUN/kubelet.pid")
  step "stopping the kubelet (pid $pid)"
  kill "$pid"
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then die "the kubelet (pid $pid) outlived SIGTERM by 30 s"; fi
  start_kubelet
  exit 0
fi
mkdir -p "$N"/{kubelet,containerd/root,containerd/opt,cni/net.d,cni/data,container-logs,pod-logs} "$RUN" "$LOGS"

# cgroup v2, every controller delegated from the root (the kubelet's cgroupfs driver makes
# kubepods below it).
if ! mountpoint -q /sys/fs/cgroup; then mount -t cgroup2 cgroup2 /sys/fs/cgroup; fi
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
  echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || log "cannot delegate cgroup controller $c"
done
# Every mount shared, as systemd leaves a machine's root: the chart's HostToContainer and
# Bidirectional mounts need it.
mount --make-rshared /
# The node's own directories over the host's (bind mounts in the VM's mount table only). A
# fresh host may have no directory to bind onto: an empty one is made on the host's root.
mkdir -p /var/lib/kubelet /var/log/containers
mountpoint -q /var/lib/kubelet || mount --bind "$N/kubelet" /var/lib/kubelet
mount --make-shared /var/lib/kubelet
mountpoint -q /var/log/containers || mount --bind "$N/container-logs" /var/log/containers
for d in /var/lib/modeguard /etc/modeguard /etc/iscsi; do
  mkdir -p "$N/host$d" "$d"
  mountpoint -q "$d" || mount --bind "$N/host$d" "$d"
done
# open-iscsi, as the node's package sets it up: an initiator name of the node's own, kept in
# its /etc/iscsi (the node disk) across reboots, and iscsid, which the node plugin's iscsiadm
# talks to (hostNetwork: the same abstract socket). No iscsid.conf: every node record is
# node.startup=manual, so a reboot logs in to nothing until the kubelet stages a volume again.
if [[ ! -s /etc/iscsi/initiatorname.iscsi ]]; then
  printf 'InitiatorName=iqn.2026-11.dev.csi.modeguard.node:%s\n' "$NODE" >/etc/iscsi/initiatorname.iscsi
fi
mkdir -p /run/lock
# What the node's programs put in /tmp stays in the VM.
mountpoint -q /tmp || mount -t tmpfs -o mode=1777 tmp /tmp
if [[ -f /etc/machine-id ]] && ! mountpoint -q /etc/machine-id; then
  printf '%s\n' "$(printf '%s' "$NODE" | sha256sum | cut -c1-32)" >"$N/machine-id"
  mount --bind "$N/machine-id" /etc/machine-id
fi
# Pods reach the bridge (and the host them) through the VM; the other nodes' pods through
# the host, which routes each node's pod subnet to its VM (vm-up.sh), as a cluster's network
# joins its nodes' pods.
echo 1 >/proc/sys/net/ipv4/ip_forward
ip route replace 10.244.0.0/16 via "$API_ADDRESS"

cat >"$N/cni/net.d/10-modeguard.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "modeguard-vm",
  "plugins": [
    {"type": "modeguard-veth", "subnet": "$POD_SUBNET.0/24", "gateway": "$POD_SUBNET.1", "dataDir": "$N/cni/data"}
  ]
}
EOF
# The programs every pod, container start and exec runs, the runc shim and runc, copied into
# the VM's memory at each boot: read from the host's root over 9p (cache=none), page by page,
# starting the shim took about 11 s of a pod sandbox's 15 s (docs/vm-cluster.md).
mkdir -p "$RUN/bin"
cp -L "$DEBS/containerd-shim-runc-v2" "$DEBS/runc" "$RUN/bin/"
export PATH="$RUN/bin:$PATH" RUNC="$RUN/bin/runc"
sock=/run/containerd/containerd.sock
containerd_config "$N/containerd/root" /run/containerd/state "$sock" "$N/containerd/opt" "$NODE" "$N/cni/net.d" \
  >"$N/containerd/config.toml"

step "starting iscsid"
daemon iscsid iscsid -f
step "starting containerd"
daemon containerd containerd --config "$N/containerd/config.toml"
wait_for "containerd" "$WAIT" ctr --address "$sock" version
# A node disk made by vm-seed.sh holds every image already; an empty one gets pause and busybox.
if ctr --address "$sock" -n k8s.io images ls -q | grep -qx 'registry.k8s.io/pause:3.10'; then
  step "containerd answers; the images are on the node disk"
else
  step "containerd answers; importing the images"
  "$HERE/images.sh" "$sock" >/dev/null
  step "images imported"
fi

cat >"$N/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE
port: 10250
readOnlyPort: 0
healthzBindAddress: $NODE
healthzPort: 10248
tlsCertFile: $P/kubelet-serving-$NODE.crt
tlsPrivateKeyFile: $P/kubelet-serving-$NODE.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $P/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupsPerQOS: true
failSwapOn: false
containerRuntimeEndpoint: unix://$sock
staticPodPath: ""
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
podLogsDir: $N/pod-logs
EOF
kubeconfig "$N/kubelet.kubeconfig" "kubelet-$NODE"
start_kubelet

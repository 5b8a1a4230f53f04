# Shared by up.sh and reboot-node.sh (sourced, with HERE set to this directory and LOG_TAG
# naming the caller in log lines): paths, logging, waiting, starting recorded processes,
# kubeconfigs, and start_node, which starts one node's containerd and kubelet.
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
# CLUSTER_DIR: another cluster's state (vm-up.sh's), by default the local cluster's.
C="${CLUSTER_DIR:-$BUILD/cluster}"
BIN="$BUILD/k8s/bin"
DEBS="$BUILD/debs/bin"
# Set but empty: no node on the host (vm-up.sh: every node is a VM).
NODES="${NODES-127.0.0.1=zone-a 127.0.0.2=zone-a 127.0.0.3=zone-b}"
# The apiserver's address: loopback, or a bridge address VMs reach it at (vm-up.sh).
API_ADDRESS="${API_ADDRESS:-127.0.0.1}"
CGROUP_ROOT=/modeguard-local
SERVICE_CIDR=10.0.0.0/24
API_PORT=6443
WAIT="${WAIT_SECONDS:-60}"
export PATH="$DEBS:$BIN:$PATH"
P="$C/pki"
NODES_DIR="$C/nodes"
KUBECTL=(kubectl --kubeconfig "$C/admin.kubeconfig")

# shellcheck source=ours.sh
source "$HERE/ours.sh"
log() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*"; }
die() { printf '[%s %s] ERROR: %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

# wait_for DESCRIPTION SECONDS COMMAND...: poll every 0.2 s, fail with the log hint.
wait_for() {
  local what=$1 secs=$2; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) >= deadline )); then die "timed out after ${secs}s waiting for $what (logs in $C/logs)"; fi
    sleep 0.2
  done
}
# start NAME COMMAND...: run in the background, log to logs/NAME.log, record the pid.
start() {
  local name=$1; shift
  "$@" >"$C/logs/$name.log" 2>&1 &
  local pid=$!
  echo "$name $pid" >>"$C/pids"
  sleep 0.3
  kill -0 "$pid" 2>/dev/null || { tail -20 "$C/logs/$name.log" >&2; die "$name exited at once"; }
}

# cert NAME CN O SANs(comma list or empty) EKU: a key and a certificate signed by the
# cluster's CA in $P, made once (kept while $P/NAME.crt exists).
cert() {
  local name=$1 cn=$2 o=$3 san=$4 eku=$5
  [[ -s "$P/$name.crt" ]] && return 0
  local subj="/CN=$cn"; [[ -n "$o" ]] && subj="/O=$o$subj"
  openssl genrsa -out "$P/$name.key" 2048 2>/dev/null
  openssl req -new -key "$P/$name.key" -subj "$subj" -out "$P/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n "$san" ]] && echo "subjectAltName=$san"
  } >"$P/$name.ext"
  openssl x509 -req -in "$P/$name.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$P/$name.ext" -out "$P/$name.crt" 2>/dev/null
  rm -f "$P/$name.csr" "$P/$name.ext"
}

kubeconfig() { # kubeconfig FILE CERTNAME
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    certificate-authority: $P/ca.crt
    server: https://$API_ADDRESS:$API_PORT
users:
- name: user
  user:
    client-certificate: $P/$2.crt
    client-key: $P/$2.key
contexts:
- name: local
  context: {cluster: local, user: user}
current-context: local
EOF
}

# containerd_config ROOT STATE SOCKET OPT [ADDRESS CNI_CONF_DIR [CRI_LINES]]: a node's containerd
# configuration on stdout (local cluster, VM nodes, vm-seed.sh). With ADDRESS, the CRI for a
# kubelet: streams served on ADDRESS, runc from _build, pods' network from CNI_CONF_DIR, the
# overlayfs snapshotter, CRI_LINES added to its section. Without, no CRI: a containerd that
# only imports images.
containerd_config() {
  local root=$1 state=$2 sock=$3 opt=$4 addr=${5:-} cni=${6:-} extra=${7:-} nocri=""
  [[ -n "$addr" ]] || nocri='  "io.containerd.grpc.v1.cri",'
  cat <<EOF
version = 2
root = "$root"
state = "$state"
disabled_plugins = [
${nocri:+$nocri
}  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
]
[grpc]
  address = "$sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$opt"
EOF
  [[ -n "$addr" ]] || return 0
  cat <<EOF
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
${extra:+$extra
}  stream_server_address = "$addr"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "${RUNC:-$DEBS/runc}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$BUILD/cni/bin"
    conf_dir = "$cni"
EOF
}

# start_node NAME INDEX: containerd (own root, state and socket; a kubelet treats every pod
# its runtime reports as its own, so nodes cannot share one), the CNI config (pods of node
# INDEX get 10.244.INDEX.0/24), and the kubelet.
start_node() {
  local name=$1 idx=$2 ip=$1
  local N="$NODES_DIR/$name"
  local sock="$N/containerd/containerd.sock" cg="$CGROUP_ROOT/node$idx"
  local p
  # A kubelet killed a moment ago (reboot-node.sh) may leave its ports taken
  # for a while on a loaded machine: wait up to 30 s before giving up.
  for p in 10250 10248; do
    local tries=0
    while ss -Hltn "src $ip and sport = :$p" | grep -q .; do
      if ((++tries > 300)); then die "$ip:$p already in use: $(ss -Hltnp "src $ip and sport = :$p")"; fi
      sleep 0.1
    done
  done
  mkdir -p "$N"/{containerd/root,containerd/state,cni/net.d,cni/data,kubelet/root,kubelet/pki}
  cat >"$N/cni/net.d/10-modeguard.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "modeguard-local",
  "plugins": [
    {"type": "modeguard-veth", "subnet": "10.244.$idx.0/24", "gateway": "10.244.$idx.1", "dataDir": "$N/cni/data"}
  ]
}
EOF
  # On one host: the kubelets of this host's nodes share its kernel and its OOM scores, and
  # network namespaces go below the node's own state directory.
  containerd_config "$N/containerd/root" "$N/containerd/state" "$sock" "$N/containerd/opt" "$ip" "$N/cni/net.d" \
    $'  restrict_oom_score_adj = true\n  netns_mounts_under_state_dir = true' >"$N/containerd/config.toml"
  log "starting containerd for node $name"
  start "containerd-$name" containerd --config "$N/containerd/config.toml"
  wait_for "containerd socket of $name" "$WAIT" ctr --address "$sock" version
  "$HERE/images.sh" "$sock"

  for h in /sys/fs/cgroup/*/; do
    [[ "$h" == */unified/ ]] && continue
    mkdir -p "$h${cg#/}"
  done
  kubeconfig "$N/kubelet.kubeconfig" "kubelet-$name"
  cat >"$N/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: $ip
healthzPort: 10248
tlsCertFile: $P/kubelet-serving-$name.crt
tlsPrivateKeyFile: $P/kubelet-serving-$name.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $P/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: $cg
cgroupsPerQOS: true
failSwapOn: false
containerRuntimeEndpoint: unix://$sock
staticPodPath: ""
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
podLogsDir: $N/kubelet/pod-logs
EOF
  log "starting kubelet for node $name ($ip)"
  start "kubelet-$name" kubelet --config="$N/kubelet/config.yaml" --kubeconfig="$N/kubelet.kubeconfig" \
    --root-dir="$N/kubelet/root" --cert-dir="$N/kubelet/pki" --hostname-override="$name" \
    --v=1
}

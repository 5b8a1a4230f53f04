#!/usr/bin/env bash
# Starts a one-node Kubernetes v1.33.13 cluster on this machine, without kind or Docker:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd and a kubelet
# for node "localhost". Everything listens on 127.0.0.1 (or on unix sockets); state lives
# in _build/cluster. PIDs go to _build/cluster/pids (name pid per line); stop with down.sh.
# Each run starts from empty etcd/containerd/kubelet state (KEEP_STATE=1 keeps it).
# Needs: root, hack/local-cluster/build.sh run first. Admin kubeconfig:
#   _build/cluster/admin.kubeconfig
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
C="$BUILD/cluster"
BIN="$BUILD/k8s/bin"
DEBS="$BUILD/debs/bin"
NODE=localhost
CGROUP_ROOT=/modeguard-local
POD_SUBNET=10.244.0.0/24
POD_GW=10.244.0.1
SERVICE_CIDR=10.0.0.0/24
API_PORT=6443
WAIT="${WAIT_SECONDS:-60}"
export PATH="$DEBS:$BIN:$PATH"

log() { printf '[up %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[up %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

[[ $EUID -eq 0 ]] || die "must run as root"
for b in "$BIN"/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kubectl} \
         "$DEBS"/{etcd,containerd,containerd-shim-runc-v2,runc,ctr} "$BUILD/cni/bin/modeguard-veth" "$BUILD/cni/bin/loopback"; do
  [[ -x "$b" ]] || die "missing $b: run hack/local-cluster/build.sh first"
done
if [[ -s "$C/pids" ]]; then
  while read -r name pid; do
    if kill -0 "$pid" 2>/dev/null; then die "$name (pid $pid) from an earlier up.sh still runs: run down.sh first"; fi
  done <"$C/pids"
fi
for port in 2379 2380 $API_PORT 10250 10248 10257 10259; do
  if ss -Hltn "sport = :$port" | grep -q .; then die "port $port already in use"; fi
done

if awk -v p="$C/" 'index($2, p) == 1 {found=1} END {exit !found}' /proc/self/mounts; then
  die "mounts left under $C: run hack/local-cluster/down.sh first"
fi
# A fresh cluster every time (PKI and nothing else kept) unless KEEP_STATE=1.
if [[ "${KEEP_STATE:-0}" != 1 ]]; then
  rm -rf "$C"/{etcd,containerd,kubelet,cni,logs}
fi
mkdir -p "$C"/{pki,logs,etcd,containerd/root,containerd/state,cni/net.d,cni/data,kubelet}
: >"$C/pids"

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

# ---------------------------------------------------------------- PKI (openssl)
P="$C/pki"
cert() { # cert NAME CN O SANs(comma list or empty) EKU
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
if [[ ! -s "$P/ca.crt" ]]; then
  log "creating PKI in $P"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 3650 \
    -subj "/CN=modeguard-local-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
fi
cert apiserver kube-apiserver "" \
  "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.0.0.1" serverAuth
cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters "" clientAuth
cert admin admin system:masters "" clientAuth
cert controller-manager system:kube-controller-manager "" "" clientAuth
cert scheduler system:kube-scheduler "" "" clientAuth
cert kubelet "system:node:$NODE" system:nodes "" clientAuth
cert kubelet-serving "$NODE" "" "DNS:$NODE,IP:127.0.0.1" serverAuth
if [[ ! -s "$P/sa.key" ]]; then
  openssl genrsa -out "$P/sa.key" 2048 2>/dev/null
  openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
fi

kubeconfig() { # kubeconfig FILE CERTNAME
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    certificate-authority: $P/ca.crt
    server: https://127.0.0.1:$API_PORT
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
kubeconfig "$C/admin.kubeconfig" admin
kubeconfig "$C/controller-manager.kubeconfig" controller-manager
kubeconfig "$C/scheduler.kubeconfig" scheduler
kubeconfig "$C/kubelet.kubeconfig" kubelet
KUBECTL=(kubectl --kubeconfig "$C/admin.kubeconfig")

# ---------------------------------------------------------------- etcd
log "starting etcd"
start etcd etcd --name local --data-dir "$C/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster local=http://127.0.0.1:2380 --listen-metrics-urls "" \
  --quota-backend-bytes 1073741824 --log-level warn
wait_for "etcd health" "$WAIT" curl -sf http://127.0.0.1:2379/health

# ---------------------------------------------------------------- apiserver
log "starting kube-apiserver"
start kube-apiserver kube-apiserver \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port=$API_PORT \
  --etcd-servers=http://127.0.0.1:2379 \
  --authorization-mode=Node,RBAC --anonymous-auth=false \
  --client-ca-file="$P/ca.crt" \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
  --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$P/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$P/ca.crt" \
  --kubelet-preferred-address-types=Hostname,InternalIP \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-cluster-ip-range=$SERVICE_CIDR \
  --enable-admission-plugins=NodeRestriction \
  --allow-privileged=true --profiling=false --v=1
wait_for "kube-apiserver /readyz" "$WAIT" curl -sf --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
  "https://127.0.0.1:$API_PORT/readyz"

# ---------------------------------------------------------------- controller-manager, scheduler
log "starting kube-controller-manager and kube-scheduler"
start kube-controller-manager kube-controller-manager \
  --kubeconfig="$C/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$C/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$C/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
  --service-cluster-ip-range=$SERVICE_CIDR --allocate-node-cidrs=false \
  --controllers='*,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller' \
  --profiling=false --v=1
start kube-scheduler kube-scheduler \
  --kubeconfig="$C/scheduler.kubeconfig" \
  --authentication-kubeconfig="$C/scheduler.kubeconfig" \
  --authorization-kubeconfig="$C/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --leader-elect=false --profiling=false --v=1

# ---------------------------------------------------------------- containerd + CNI
cat >"$C/cni/net.d/10-modeguard.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "modeguard-local",
  "plugins": [
    {"type": "modeguard-veth", "subnet": "$POD_SUBNET", "gateway": "$POD_GW", "dataDir": "$C/cni/data"}
  ]
}
EOF
CTRD_SOCK="$C/containerd/containerd.sock"
cat >"$C/containerd/config.toml" <<EOF
version = 2
root = "$C/containerd/root"
state = "$C/containerd/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
]
[grpc]
  address = "$CTRD_SOCK"
[ttrpc]
  address = "$C/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$C/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$DEBS/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$BUILD/cni/bin"
    conf_dir = "$C/cni/net.d"
EOF
log "starting containerd"
start containerd containerd --config "$C/containerd/config.toml"
wait_for "containerd socket" "$WAIT" ctr --address "$CTRD_SOCK" version
log "importing images"
"$HERE/images.sh" "$CTRD_SOCK"

# ---------------------------------------------------------------- kubelet
for h in /sys/fs/cgroup/*/; do
  [[ "$h" == */unified/ ]] && continue
  mkdir -p "$h${CGROUP_ROOT#/}"
done
cat >"$C/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $P/kubelet-serving.crt
tlsPrivateKeyFile: $P/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $P/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
cgroupsPerQOS: true
failSwapOn: false
containerRuntimeEndpoint: unix://$CTRD_SOCK
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
podLogsDir: $C/kubelet/pod-logs
EOF
# The kubelet (protectKernelDefaults: false) sets these host sysctls; remember them for down.sh.
if [[ ! -s "$C/sysctl.saved" ]]; then
  for k in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do
    if [[ -r /proc/sys/$k ]]; then echo "$k $(cat /proc/sys/$k)"; fi
  done >"$C/sysctl.saved"
fi
log "starting kubelet (node $NODE)"
start kubelet kubelet --config="$C/kubelet/config.yaml" --kubeconfig="$C/kubelet.kubeconfig" \
  --root-dir="$C/kubelet/root" --cert-dir="$C/kubelet/pki" --hostname-override=$NODE \
  --v=1
wait_for "kubelet /healthz" "$WAIT" curl -sf http://127.0.0.1:10248/healthz
wait_for "node $NODE Ready" "$WAIT" "${KUBECTL[@]}" wait --for=condition=Ready "node/$NODE" --timeout=2s
wait_for "default service account" "$WAIT" "${KUBECTL[@]}" get serviceaccount default -n default
log "cluster up; export KUBECONFIG=$C/admin.kubeconfig"
"${KUBECTL[@]}" get nodes -o wide

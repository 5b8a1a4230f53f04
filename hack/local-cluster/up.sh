#!/usr/bin/env bash
# Starts a Kubernetes v1.34.4 cluster on this machine, without kind or Docker: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and, per node, a containerd and a
# kubelet. The nodes (NODES, "name=zone ..."; the default below):
#   127.0.0.1  zone-a
#   127.0.0.2  zone-a
#   127.0.0.3  zone-b
# A node is named by the loopback address its kubelet listens on. The apiserver reaches a
# kubelet (exec, logs) by the node's Hostname address, and an address needs no name
# resolution; the kubelet, which refuses a loopback --node-ip, takes a node name that is an
# address as the node's InternalIP, so pods see it as status.hostIP. Two nodes share zone-a so that a zonal volume has a second node
# it could be attached to. Everything listens on 127.0.0.0/8 (or on unix sockets); state
# lives in _build/cluster, each node's in _build/cluster/nodes/<name>. PIDs go to
# _build/cluster/pids (name pid per line); stop with down.sh.
# Each run starts from empty etcd/containerd/kubelet state (KEEP_STATE=1 keeps it).
# For a cluster whose nodes are VMs (vm-up.sh): CLUSTER_DIR (state elsewhere than
# _build/cluster), API_ADDRESS (the address etcd, the apiserver, controller-manager and
# scheduler listen on: a bridge address the VMs reach, so that this cluster and the local
# one on loopback share no port) and NODES="" (no node on the host).
# Needs: root, hack/local-cluster/build.sh run first. Admin kubeconfig:
#   _build/cluster/admin.kubeconfig
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_TAG=up
source "$HERE/lib.sh"

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
for nz in $NODES; do
  name=${nz%%=*}
  [[ "$nz" == *=* && -n "$name" && -n "${nz#*=}" ]] || die "NODES entry '$nz' is not name=zone"
  [[ "$name" =~ ^127\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "node '$name' must be a 127.x.y.z address"
done
# Only a listener on that address or on every address is in the way: the cluster of
# vm-up.sh on its bridge address and this one on loopback run side by side, whichever
# started first.
for port in 2379 2380 $API_PORT 10257 10259; do
  if ss -Hltn "sport = :$port" | awk -v a="$API_ADDRESS:$port" '$4 == a || $4 ~ /^(0\.0\.0\.0|\*|\[::\]):/ {f=1} END {exit !f}'; then
    die "port $API_ADDRESS:$port already in use"
  fi
done

if awk -v p="$C/" 'index($2, p) == 1 {found=1} END {exit !found}' /proc/self/mounts; then
  die "mounts left under $C: run hack/local-cluster/down.sh first"
fi
# A fresh cluster every time (PKI and nothing else kept) unless KEEP_STATE=1.
if [[ "${KEEP_STATE:-0}" != 1 ]]; then
  rm -rf "$C"/{etcd,nodes,logs}
fi
mkdir -p "$C"/{pki,logs,etcd,nodes}
: >"$C/pids"


# ---------------------------------------------------------------- PKI (openssl)
if [[ ! -s "$P/ca.crt" ]]; then
  log "creating PKI in $P"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 3650 \
    -subj "/CN=modeguard-local-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
fi
api_san="DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.0.0.1"
[[ "$API_ADDRESS" == 127.0.0.1 ]] || api_san+=",IP:$API_ADDRESS"
# A certificate kept from a run with another API_ADDRESS is made again.
if [[ -s "$P/apiserver.crt" ]] && ! openssl x509 -noout -ext subjectAltName -in "$P/apiserver.crt" 2>/dev/null |
    grep -qw "IP Address:$API_ADDRESS"; then
  rm -f "$P/apiserver.crt"
fi
cert apiserver kube-apiserver "" "$api_san" serverAuth
cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters "" clientAuth
cert admin admin system:masters "" clientAuth
cert controller-manager system:kube-controller-manager "" "" clientAuth
cert scheduler system:kube-scheduler "" "" clientAuth
for nz in $NODES; do
  name=${nz%%=*}
  cert "kubelet-$name" "system:node:$name" system:nodes "" clientAuth
  cert "kubelet-serving-$name" "$name" "" "IP:$name" serverAuth
done
if [[ ! -s "$P/sa.key" ]]; then
  openssl genrsa -out "$P/sa.key" 2048 2>/dev/null
  openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
fi

kubeconfig "$C/admin.kubeconfig" admin
kubeconfig "$C/controller-manager.kubeconfig" controller-manager
kubeconfig "$C/scheduler.kubeconfig" scheduler

# ---------------------------------------------------------------- etcd
log "starting etcd"
start etcd etcd --name local --data-dir "$C/etcd" \
  --listen-client-urls "http://$API_ADDRESS:2379" --advertise-client-urls "http://$API_ADDRESS:2379" \
  --listen-peer-urls "http://$API_ADDRESS:2380" --initial-advertise-peer-urls "http://$API_ADDRESS:2380" \
  --initial-cluster "local=http://$API_ADDRESS:2380" --listen-metrics-urls "" \
  --quota-backend-bytes 1073741824 --log-level warn
wait_for "etcd health" "$WAIT" curl -sf "http://$API_ADDRESS:2379/health"

# ---------------------------------------------------------------- apiserver
log "starting kube-apiserver"
start kube-apiserver kube-apiserver \
  --bind-address="$API_ADDRESS" --advertise-address="$API_ADDRESS" --secure-port=$API_PORT \
  --etcd-servers="http://$API_ADDRESS:2379" \
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
  "https://$API_ADDRESS:$API_PORT/readyz"

# ---------------------------------------------------------------- controller-manager, scheduler
log "starting kube-controller-manager and kube-scheduler"
start kube-controller-manager kube-controller-manager \
  --kubeconfig="$C/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$C/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$C/controller-manager.kubeconfig" \
  --bind-address="$API_ADDRESS" --leader-elect=false --use-service-account-credentials=true \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
  --service-cluster-ip-range=$SERVICE_CIDR --allocate-node-cidrs=false \
  --controllers='*,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller' \
  --profiling=false --v=1
start kube-scheduler kube-scheduler \
  --kubeconfig="$C/scheduler.kubeconfig" \
  --authentication-kubeconfig="$C/scheduler.kubeconfig" \
  --authorization-kubeconfig="$C/scheduler.kubeconfig" \
  --bind-address="$API_ADDRESS" --leader-elect=false --profiling=false --v=1

# ---------------------------------------------------------------- snapshots
# The VolumeSnapshot and VolumeGroupSnapshot CRDs and the snapshot-controller, built by hack/images/sidecars.sh from
# external-snapshotter: cluster parts (a CSI driver ships only the csi-snapshotter sidecar),
# run here like the other controllers. With them the SnapshotMetadataService CRD of
# external-snapshot-metadata, also a cluster part: the chart then runs the
# csi-snapshot-metadata sidecar (snapshotMetadata.enabled auto) and makes the driver's object.
SNAP="$BUILD/images/sidecars"
if [[ -x "$SNAP/bin/snapshot-controller" ]] && compgen -G "$SNAP/crds/*.yaml" >/dev/null; then
  log "VolumeSnapshot CRDs and snapshot-controller"
  "${KUBECTL[@]}" apply -f "$SNAP/crds" >/dev/null
  "${KUBECTL[@]}" wait --for=condition=Established --timeout="${WAIT}s" \
    crd/volumesnapshots.snapshot.storage.k8s.io crd/volumesnapshotcontents.snapshot.storage.k8s.io \
    crd/volumesnapshotclasses.snapshot.storage.k8s.io \
    crd/volumegroupsnapshots.groupsnapshot.storage.k8s.io crd/volumegroupsnapshotcontents.groupsnapshot.storage.k8s.io \
    crd/volumegroupsnapshotclasses.groupsnapshot.storage.k8s.io >/dev/null
  if [[ -f $SNAP/crds/cbt.storage.k8s.io_snapshotmetadataservices.yaml ]]; then
    "${KUBECTL[@]}" wait --for=condition=Established --timeout="${WAIT}s" \
      crd/snapshotmetadataservices.cbt.storage.k8s.io >/dev/null
  fi
  # Volume group snapshots are beta in the snapshotter, off unless asked for.
  start snapshot-controller "$SNAP/bin/snapshot-controller" --kubeconfig="$C/admin.kubeconfig" \
    --leader-election=false --v=1
else
  log "no snapshot-controller in $SNAP (hack/images/sidecars.sh binaries builds it): no VolumeSnapshots"
fi

# ---------------------------------------------------------------- nodes
# The node plugins see every node's kubelet directory below $C/nodes, mounted Bidirectional;
# containerd allows that only on a shared mount, so $C/nodes is bound onto itself and shared
# (down.sh unmounts it).
mount --bind "$NODES_DIR" "$NODES_DIR"
mount --make-rshared "$NODES_DIR"
# The kubelet (protectKernelDefaults: false) sets these host sysctls; remember them for down.sh
# (with no node on the host, no kubelet here changes them).
if [[ -n "$NODES" && ! -s "$C/sysctl.saved" ]]; then
  for k in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do
    if [[ -r /proc/sys/$k ]]; then echo "$k $(cat /proc/sys/$k)"; fi
  done >"$C/sysctl.saved"
fi

idx=0
for nz in $NODES; do
  start_node "${nz%%=*}" "$idx"
  idx=$((idx + 1))
done
for nz in $NODES; do
  name=${nz%%=*}
  wait_for "kubelet /healthz of $name" "$WAIT" curl -sf "http://$name:10248/healthz"
  wait_for "node $name Ready" "$WAIT" "${KUBECTL[@]}" wait --for=condition=Ready "node/$name" --timeout=2s
  "${KUBECTL[@]}" label node "$name" "topology.kubernetes.io/zone=${nz#*=}" --overwrite >/dev/null
done
wait_for "default service account" "$WAIT" "${KUBECTL[@]}" get serviceaccount default -n default
log "cluster up; export KUBECONFIG=$C/admin.kubeconfig"
"${KUBECTL[@]}" get nodes -o wide -L topology.kubernetes.io/zone

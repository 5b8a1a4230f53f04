#!/usr/bin/env bash
# Builds, without any registry, what kind needs to run modeguard here:
#   _build/kind/parts/bin/{kind,kubeadm,kube-proxy,etcd}
#     kind v0.33.0, kubeadm and kube-proxy at hack/local-cluster/k8s-version.sh's version and
#     etcd 3.6.5, compiled from the Go module proxy (hack/kind/{k8s,etcd}-build);
#   _build/kind/parts/images/*.tar
#     the control plane's images as kubeadm names them (kube-apiserver, kube-controller-manager,
#     kube-scheduler from the local cluster's build; etcd; the local cluster's pause), one static
#     binary each;
#   _build/kind/kube-proxy.tar
#     kube-proxy with Debian's iptables and nft, which it runs;
#   localhost/modeguard/kind-node:<version> in buildah's storage (podman reads it)
#     kind's node image: Debian bookworm (hack/images/base.sh), systemd, containerd, runc and the
#     CNI plugins from Debian, the files of kind's own base image (from the kind module), kubelet,
#     kubectl and kubeadm, the control plane's images imported at boot, and a bridge network
#     configured at boot (kind's own network plugin, kindnetd, is an image this machine cannot
#     pull).
# Why not kind's own images: kindest/node and kindest/base come from registries unreachable
# here, and `kind build node-image` starts from kindest/base.
#
# Needs root; run hack/local-cluster/build.sh, hack/local-cluster/images.sh and
# hack/images/base.sh first (hack/kind-up.sh does). The parts are in the machine's cache
# (hack/cache.sh); the node image is made again when its inputs change.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${BUILD_DIR:-$REPO/_build}"
# shellcheck source=../local-cluster/k8s-version.sh
source "$REPO/hack/local-cluster/k8s-version.sh"
# shellcheck source=../local-cluster/archive.sh
source "$REPO/hack/local-cluster/archive.sh"
# shellcheck source=../cache.sh
source "$REPO/hack/cache.sh"
KIND_VERSION=v0.33.0
ETCD_TAG=3.6.5-0
NODE_IMAGE="localhost/modeguard/kind-node:$K8S_VERSION"
PARTS="$BUILD/kind/parts"
K8S_BIN="$BUILD/k8s/bin"
PAUSE_TAR="$BUILD/local-cluster-images/pause.tar"
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot} # see hack/images/base.sh
log() { printf '[kind-build %s] %s\n' "$(date +%T)" "$*" >&2; }

for f in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
  [[ -x $K8S_BIN/$f ]] || { echo "no $K8S_BIN/$f: run hack/local-cluster/build.sh first" >&2; exit 1; }
done
[[ -s $PAUSE_TAR ]] || { echo "no $PAUSE_TAR: run hack/local-cluster/images.sh first" >&2; exit 1; }
buildah inspect --type image localhost/debian:bookworm-slim >/dev/null 2>&1 ||
  { echo "no localhost/debian:bookworm-slim: run hack/images/base.sh first" >&2; exit 1; }

cache_dir kind-parts "$PARTS" "$REPO/hack/local-cluster/k8s-version.sh" "$HERE"/k8s-build/go.mod "$HERE"/k8s-build/go.sum \
  "$HERE"/k8s-build/tools.go "$HERE"/etcd-build/go.mod "$HERE"/etcd-build/go.sum "$HERE"/etcd-build/tools.go "$KIND_VERSION" \
  "$REPO/hack/local-cluster/archive.sh" "${BASH_SOURCE[0]}"
mkdir -p "$PARTS/bin" "$PARTS/images"

# --- binaries ---------------------------------------------------------------
if [[ ! -x $PARTS/bin/kind ]]; then
  log "kind $KIND_VERSION"
  GOBIN="$PARTS/bin" CGO_ENABLED=0 go install "sigs.k8s.io/kind@$KIND_VERSION"
fi
if [[ ! -x $PARTS/bin/kubeadm || ! -x $PARTS/bin/kube-proxy ]]; then
  log "kubeadm and kube-proxy $K8S_VERSION (about 4 minutes cold)"
  (cd "$HERE/k8s-build" && CGO_ENABLED=0 go build -trimpath -ldflags "$K8S_LDFLAGS" -o "$PARTS/bin/" \
    k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kube-proxy)
fi
if [[ ! -x $PARTS/bin/etcd ]]; then
  log "etcd $ETCD_TAG"
  (cd "$HERE/etcd-build" && CGO_ENABLED=0 go build -trimpath -o "$PARTS/bin/etcd" go.etcd.io/etcd/server/v3)
fi

# --- the control plane's images --------------------------------------------
# image NAME TAG BINARY: a docker-archive of one static binary in /usr/local/bin.
image() {
  local name=$1 tag=$2 bin=$3 out="$PARTS/images/$1.tar"
  [[ -s $out ]] && return 0
  local root; root=$(mktemp -d "$PARTS/images/$name.rootfs.XXXXXX")
  mkdir -p "$root/usr/local/bin" "$root/tmp" "$root/etc"
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\n' >"$root/etc/passwd"
  cp "$bin" "$root/usr/local/bin/$name"
  docker_archive "$out" "registry.k8s.io/$name:$tag" "[\"/usr/local/bin/$name\"]" null "$root" >/dev/null
  rm -rf "$root"
  log "image registry.k8s.io/$name:$tag"
}
for c in kube-apiserver kube-controller-manager kube-scheduler; do image "$c" "$K8S_VERSION" "$K8S_BIN/$c"; done
image etcd "$ETCD_TAG" "$PARTS/bin/etcd"
cp "$PAUSE_TAR" "$PARTS/images/pause.tar"

# --- the node image -----------------------------------------------------------
KIND_MOD=$(go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
KIND_FILES="$KIND_MOD/images/base/files"
[[ -d $KIND_FILES ]] || { echo "no $KIND_FILES in the kind module" >&2; exit 1; }
# The image is labelled with the hash of what it is made of.
key=$(cache_key "${BASH_SOURCE[0]}" "$HERE"/node/* "$K8S_VERSION" \
  "$(cat "$PARTS"/images/*.tar "$K8S_BIN/kubelet" "$K8S_BIN/kubectl" "$PARTS/bin/kubeadm" | sha256sum)" \
  "$(find "$KIND_FILES" -type f -exec cat {} + | sha256sum)")
label_of() { buildah inspect --type image --format '{{index .OCIv1.Config.Labels "io.modeguard.kind-node-key"}}' "$1" 2>/dev/null || true; }
if [[ $(label_of "$NODE_IMAGE") == "$key" ]]; then
  log "$NODE_IMAGE is current"
else
  log "making $NODE_IMAGE (about 3 minutes)"
  ctr=$(buildah from --pull=never localhost/debian:bookworm-slim)
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  # What kind's base image installs, from Debian; runc, not crun: crun refuses a cgroup v1
  # host's hybrid hierarchy.
  buildah run "$ctr" -- sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends -o Dpkg::Options::=--force-confold systemd conntrack iptables nftables iproute2 \
    ethtool util-linux mount kmod libseccomp2 pigz e2fsprogs xfsprogs bash ca-certificates procps jq containerd \
    runc containernetworking-plugins socat >/dev/null && rm -rf /var/lib/apt/lists/*'
  buildah copy --chmod 0755 "$ctr" "$KIND_FILES/usr/local/bin/" /usr/local/bin/ >/dev/null
  buildah copy "$ctr" "$KIND_FILES/kind/" /kind/ >/dev/null
  buildah copy --chmod 0755 "$ctr" "$KIND_FILES/kind/bin/" /kind/bin/ >/dev/null
  buildah copy "$ctr" "$KIND_FILES/etc/" /etc/ >/dev/null
  buildah copy --chmod 0755 "$ctr" "$K8S_BIN/kubelet" "$K8S_BIN/kubectl" "$PARTS/bin/kubeadm" /usr/bin/ >/dev/null
  buildah copy "$ctr" "$PARTS/images/" /kind/images/ >/dev/null
  buildah copy "$ctr" "$HERE/node/modeguard-kind-images.service" "$HERE/node/modeguard-kind-cni.service" \
    /etc/systemd/system/ >/dev/null
  buildah copy --chmod 0755 "$ctr" "$HERE/node/write-cni-config" /kind/bin/ >/dev/null
  # As kind's base image does: systemd as init in a container, containerd with kind's
  # hooks, the kubelet started by systemd.
  buildah run "$ctr" -- sh -euc '
    find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
    rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
    echo ReadKMsg=no >>/etc/systemd/journald.conf
    ln -sf /usr/lib/systemd/systemd /sbin/init
    ln -sf /usr/bin/containerd /usr/local/bin/containerd
    mkdir -p /opt/cni/bin /etc/cni/net.d /etc/kubernetes/manifests
    for p in /usr/lib/cni/*; do ln -sf "$p" /opt/cni/bin/; done
    # the hook kind adds to every container, and no rlimits (CAP_SYS_RESOURCE is not granted here)
    ctr oci spec | jq ".hooks.createContainer += [{\"path\": \"/kind/bin/mount-product-files.sh\"}] | del(.process.rlimits)" \
      >/etc/containerd/cri-base.json
    sed -i -e "s/restrict_oom_score_adj = false/restrict_oom_score_adj = true/" /etc/containerd/config.toml
    systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
      modeguard-kind-images.service modeguard-kind-cni.service
    systemctl mask systemd-binfmt.service
    echo '"$K8S_VERSION"' >/kind/version
  '
  buildah config --cmd '[]' "$ctr"
  buildah config --env container=docker --stop-signal SIGRTMIN+3 \
    --entrypoint '["/usr/local/bin/entrypoint","/sbin/init"]' --label "io.modeguard.kind-node-key=$key" "$ctr"
  buildah commit --rm -q "$ctr" "$NODE_IMAGE" >/dev/null
  trap - EXIT
fi

# kube-proxy needs iptables and nft: Debian's, with the kube-proxy binary. Loaded into the
# nodes after they start (hack/kind-up.sh).
KP_TAR="$BUILD/kind/kube-proxy.tar"
kp_key=$(cache_key "${BASH_SOURCE[0]}" "$(sha256sum <"$PARTS/bin/kube-proxy")" "$(buildah images --format "{{.ID}}" localhost/debian:bookworm-slim)")
if [[ ! -s $KP_TAR || $(cat "$KP_TAR.key" 2>/dev/null) != "$kp_key" ]]; then
  log "image registry.k8s.io/kube-proxy:$K8S_VERSION"
  ctr=$(buildah from --pull=never localhost/debian:bookworm-slim)
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  buildah run "$ctr" -- sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends iptables nftables conntrack ipset kmod >/dev/null && rm -rf /var/lib/apt/lists/*'
  buildah copy --chmod 0755 "$ctr" "$PARTS/bin/kube-proxy" /usr/local/bin/kube-proxy >/dev/null
  buildah config --cmd '[]' "$ctr"
  buildah config --entrypoint '["/usr/local/bin/kube-proxy"]' "$ctr"
  buildah commit --rm -q "$ctr" "localhost/modeguard/kind-kube-proxy:$K8S_VERSION" >/dev/null
  trap - EXIT
  mkdir -p "$(dirname "$KP_TAR")"
  rm -f "$KP_TAR"
  buildah push -q "localhost/modeguard/kind-kube-proxy:$K8S_VERSION" \
    "docker-archive:$KP_TAR:registry.k8s.io/kube-proxy:$K8S_VERSION" >/dev/null
  echo "$kp_key" >"$KP_TAR.key"
fi
log "done: $NODE_IMAGE, $KP_TAR"

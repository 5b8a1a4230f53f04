# syntax=docker/dockerfile:1
# Build stage: a static binary, so the runtime image needs no Go.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/modeguard ./cmd/modeguard

# Runtime, one image for every role: what the node plugin calls (mount,
# blkid, mkfs, resize, mount.nfs4, and iscsiadm for volumes served over
# iSCSI, talking to the host's iscsid; loop devices are bound by ioctl) and
# what the controller runs for NFS (nfs-ganesha with its VFS backend, a
# private D-Bus daemon). A storage target needs nothing more: LIO is
# configured through configfs. Any role with a --block-pool makes the
# pool's kept filesystem: mkfs.xfs (auto) or mkfs.btrfs (btrfs).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount e2fsprogs xfsprogs btrfs-progs coreutils \
      nfs-common nfs-ganesha nfs-ganesha-vfs dbus netbase open-iscsi \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /proc/self/mounts /etc/mtab
# netbase: mount.nfs4 looks up "tcp" in /etc/protocols. /etc/mtab: ganesha
# reads the mount table through it to find the filesystems it exports.
COPY --from=build /out/modeguard /usr/local/bin/modeguard
ENTRYPOINT ["/usr/local/bin/modeguard"]

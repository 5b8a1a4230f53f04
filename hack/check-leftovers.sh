#!/usr/bin/env bash
# Fails when tests left loop devices, mounts, network namespaces or driver
# processes behind: a test that leaks here leaks in CI and on a user's node.
set -u
status=0
report() { echo "$1:"; echo "$2"; status=1; }
loops=$(losetup -a 2>/dev/null || true)
[ -n "$loops" ] && report "leftover loop devices" "$loops"
mounts=$(grep -E ' /(tmp|var/tmp|work)/' /proc/mounts || true)
[ -n "$mounts" ] && report "leftover mounts" "$mounts"
netns=$(ip netns list 2>/dev/null | grep -E '^mg' || true)
[ -n "$netns" ] && report "leftover network namespaces" "$netns"
# The bridge and tap devices of a cluster with VM nodes (vm-up.sh).
links=$(ip -o link show 2>/dev/null | awk -F': ' '$2 ~ /^mgv(t|br)/ {sub(/@.*/, "", $2); print $2}')
[ -n "$links" ] && report "leftover VM bridge or tap devices" "$links"
# By command name: the driver, its ganesha, test VMs; and private buses.
procs=$( (ps -eo pid=,stat=,comm= | awk '$2 !~ /Z/ && ($3 == "modeguard" || $3 == "modeguard.test" || $3 == "ganesha.nfsd" || $3 ~ /^qemu-system/)';
          ps -eo pid=,stat=,args= | awk '$2 !~ /Z/' | grep -E 'dbus-daemon --config-file=/(tmp|var/tmp)' | grep -v grep) || true)
[ -n "$procs" ] && report "leftover processes" "$procs"
# The nodes of a kind cluster (hack/kind-up.sh) are podman containers.
if command -v podman >/dev/null; then
	kind_nodes=$(podman ps -a --filter label=io.x-k8s.kind.cluster --format '{{.Names}}' 2>/dev/null || true)
	[ -n "$kind_nodes" ] && report "leftover kind nodes" "$kind_nodes"
	# With no container left, no container's root may stay mounted.
	if [ -z "$(podman ps -aq 2>/dev/null)" ] && [ -z "$(buildah containers -q 2>/dev/null)" ]; then
		roots=$(awk '$2 ~ "^/var/lib/containers/storage/overlay/.*/merged$" {print $2}' /proc/mounts)
		[ -n "$roots" ] && report "leftover container root mounts" "$roots"
	fi
fi
[ "$status" = 0 ] && echo "no leftover loop devices, mounts, namespaces, processes or kind nodes"
exit "$status"

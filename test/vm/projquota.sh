#!/usr/bin/env bash
# Runs the tests of pkg/backend/nfs/projquota (built with -race), or of the
# package VM_TEST_PKG names, as root inside a throwaway QEMU virtual machine
# booted with Debian's stock kernel.
#
# Why: the tests need xfs project quotas, and a kernel built without
# CONFIG_XFS_QUOTA cannot mount xfs with -o prjquota; there the tests that
# need a pool skip. Debian's kernel has it. The VM sees the host's root
# filesystem over 9p (so it uses the host's Go test binary, xfsprogs,
# coreutils and util-linux), gets a fresh tmpfs as TMPDIR, and powers off
# when the tests end, taking every mount and loop device with it.
#
# Needs: x86_64, root, Debian package sources (apt-get download fetches the
# kernel and busybox-static .debs, unpacked only into the work directory),
# qemu-system-x86 (installed with apt-get when missing). Runs under
# software emulation (TCG): about a minute.
#
# Usage: test/vm/projquota.sh [test binary flags, e.g. -test.run TestCopyTree]
# Exit status: the test binary's.
#
# Environment (all optional; with none set it does what make test-vm needs):
#   VM_TEST_PKG      package directory to test, relative to the repository
#                    root (default pkg/backend/nfs/projquota): other packages'
#                    tests and benchmarks that need a pool run here too, e.g.
#                    VM_TEST_PKG=pkg/backend/nfs ... -test.run '^$' -test.bench X
#   VM_TEST_RACE     0 builds the test binary without -race (default 1): the
#                    race detector slows Go code several times over, which
#                    distorts a benchmark's times though not a test's result.
#   VM_TEST_TIMEOUT  seconds before the VM is killed (default 1200); a
#                    benchmark that sets up thousands of volumes under
#                    emulation may need more.
#   VM_TEST_ENV      NAME=VALUE words put in the tests' environment.
#   VM_TEST_DRIVER   1 builds bin/modeguard (-race) on the host first and
#                    gives its path to the tests (MODEGUARD_TEST_BINARY), for
#                    tests that run the driver's binary: a build under
#                    emulation would take minutes.
set -euo pipefail

test_pkg=${VM_TEST_PKG:-pkg/backend/nfs/projquota}
pkgdir=$(cd "$(dirname "$0")/../../$test_pkg" && pwd)
test_bin=$(basename "$pkgdir").test
race=(-race)
if [ "${VM_TEST_RACE:-1}" = 0 ]; then race=(); fi
vm_timeout=${VM_TEST_TIMEOUT:-1200}
work=$(realpath -m "${PROJQUOTA_VM_DIR:-/var/tmp/projquota-vm}")
mkdir -p "$work"
cd "$work"

if ! command -v qemu-system-x86_64 >/dev/null; then
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-system-x86 >/dev/null
fi

kernel_pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$kernel_pkg" ]; then
	apt-get update -qq
	kernel_pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
kver=${kernel_pkg#linux-image-}
# The kernel and an initramfs with busybox and the few modules needed are
# kept in $work between runs; the rest of the unpacked packages is not. The
# initramfs is made again when the module list changes (initrd.mods).
# ext4: the image store's ext4 volumes grow online only with
# CAP_SYS_RESOURCE, which the VM's root has. veth and bridge: tests that
# run ganesha and NFS clients in network namespaces of their own.
mods="virtio_pci 9pnet_virtio 9p crc32c_generic xfs loop ext4 veth bridge"
if [ ! -f "kernel/boot/vmlinuz-$kver" ] || [ ! -f initrd.gz ] || [ "$(cat initrd.mods 2>/dev/null)" != "$mods" ]; then
	rm -rf kernel busybox initrd initrd.gz ./*.deb
	apt-get download -qq "$kernel_pkg" busybox-static 2>/dev/null
	dpkg-deb -x linux-image-*.deb kernel
	dpkg-deb -x busybox-static_*.deb busybox
	rm -f ./*.deb
	bb=$work/busybox/bin/busybox
	mkdir -p initrd/bin initrd/proc initrd/sys initrd/dev initrd/host
	cp "$bb" initrd/bin/busybox
	"$bb" depmod -b "$work/kernel" "$kver"
	moddir=kernel/lib/modules/$kver
	for m in $mods; do
		line=$(grep -E "/$m\.ko[^:]*:" "$moddir/modules.dep")
		for f in $(echo "$line" | tr -d ':'); do
			mkdir -p "initrd/lib/modules/$kver/$(dirname "$f")"
			cp "$moddir/$f" "initrd/lib/modules/$kver/$f"
		done
	done
	"$bb" depmod -b "$work/initrd" "$kver"
	cat >initrd/init <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $mods; do modprobe \$m || echo "modprobe \$m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none hostroot /host
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mount -t tmpfs tmp /host$work/tmp
mount -t tmpfs run /host/run
chroot /host /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
	HOME=/root TMPDIR=$work/tmp /bin/sh $work/guest.sh
sync
poweroff -f
EOF
	chmod +x initrd/init
	(cd initrd && find . | "$bb" cpio -o -H newc 2>/dev/null | gzip -1 >../initrd.gz.new)
	mv initrd.gz.new initrd.gz
	echo "$mods" >initrd.mods
	rm -rf initrd busybox kernel/lib kernel/usr
fi

(cd "$pkgdir" && go test "${race[@]}" -c -o "$work/$test_bin" .)
test_env=(${VM_TEST_ENV:-})
if [ "${VM_TEST_DRIVER:-0}" = 1 ]; then
	(cd "$pkgdir" && go build -race -o "$work/modeguard" github.com/modeguard/modeguard/cmd/modeguard)
	test_env+=("MODEGUARD_TEST_BINARY=$work/modeguard")
fi
mkdir -p tmp
{
	echo "cd '$pkgdir'"
	echo 'ip link set lo up'
	for e in "${test_env[@]}"; do printf 'export %q\n' "$e"; done
	printf '%q ' "$work/$test_bin" -test.v -test.count=1 "$@"
	echo
	echo 'status=$?'
	echo 'echo "--- loop devices left:"; losetup -a'
	echo "echo \"--- mounts left under TMPDIR:\"; grep ' $work/tmp/' /proc/self/mountinfo"
	echo 'echo "projquota-vm-exit: $status"'
} >guest.sh

timeout "$vm_timeout" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m 4096 -smp 2 \
	-nographic -no-reboot -kernel "kernel/boot/vmlinuz-$kver" -initrd initrd.gz \
	-append "console=ttyS0 quiet panic=-1" \
	-virtfs local,path=/,mount_tag=hostroot,security_model=passthrough,id=hostroot,multidevs=remap \
	</dev/null | tee vm.log | tr -d '\r'

status=$(tr -d '\r' <vm.log | sed -n 's/^projquota-vm-exit: \([0-9]*\)$/\1/p' | tail -1)
if [ -z "$status" ]; then
	echo "test/vm/projquota.sh: the VM stopped without reporting the tests' exit status (see $work/vm.log)" >&2
	exit 2
fi
exit "$status"

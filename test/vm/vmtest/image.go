package vmtest

import (
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// CacheDir holds the kernels and initramfs images Start prepares, one
// directory per kernel package and init script version, kept across runs.
const CacheDir = "/var/tmp/modeguard-vm"

// bootModules are the modules init loads, with their dependencies loaded
// first (worked out from each module's .modinfo when the image is built).
// virtio_blk and ext4 serve a node disk (Options.NodeDiskMB; ext4 asks the
// crypto API for crc32c at mount, a soft dependency), loop the
// block backend's volumes, target_core_file and iscsi_target_mod the LIO
// iSCSI target serving image files (with configfs, mounted by init),
// iscsi_tcp and sd_mod the iSCSI initiator and the disks it finds,
// overlay and veth what a Kubernetes node needs (containerd's overlayfs
// snapshotter; the pods' network: see hack/local-cluster/vm-node.sh), xfs
// the filesystem with reflinks a block pool on the node disk's ext4 keeps
// (--block-pool-filesystem=auto; btrfs would load raid6_pq, whose
// benchmark at load is slow under emulation): the host's modprobe cannot
// load this kernel's modules.
var bootModules = []string{"virtio_pci", "virtio_net", "9pnet_virtio", "9p", "nfsv4", "virtio_blk", "crc32c_generic", "ext4", "loop",
	"target_core_mod", "target_core_file", "iscsi_target_mod", "iscsi_tcp", "sd_mod", "overlay", "veth", "xfs"}

// initScript is /init of the initramfs: busybox sh, run as PID 1. It stays
// PID 1 while the agent runs (busybox sh reaps orphans while it waits) and
// powers the VM off when the agent exits. Everything that differs between
// VMs comes from the kernel command line, whose unknown name=value words the
// kernel hands to init as environment variables: mgname (the VM's name),
// mgaddr (its address/prefix on the bridge), mgwork (the cluster's work
// directory on the host, which holds the agent and <mgname>/local) and
// mgdisk (1: <mgname>/local is the ext4 node disk /dev/vda, kept across a
// reboot, not a tmpfs).
const initScript = `#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
say() { read up _ </proc/uptime; echo "mgvm $mgname: [$up] $*"; }
for m in $(cat /modules/order); do
	insmod /modules/$m.ko || say "insmod $m failed"
done
say "modules loaded"
ip link set lo up
ip addr add "$mgaddr" dev eth0 || say "no address on eth0"
ip link set eth0 up || say "eth0 does not come up"
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none hostroot /host; then
	say "mounting the host's root over 9p failed"
	poweroff -f
fi
say "host root mounted"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t configfs configfs /host/sys/kernel/config || say "no configfs"
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs -o mode=1777 shm /host/dev/shm
# The host's /run must not see what runs here (e.g. libmount's utab).
mount -t tmpfs -o mode=0755 run /host/run
local="$mgwork/$mgname/local"
if [ "$mgdisk" = 1 ]; then
	n=0
	while [ ! -b /dev/vda ] && [ $n -lt 50 ]; do sleep 0.1; n=$((n+1)); done
	if ! mount -t ext4 /dev/vda "/host$local"; then
		say "mounting the node disk failed"
		poweroff -f
	fi
	say "node disk mounted"
else
	mount -t tmpfs -o mode=0755 local "/host$local" || say "no tmpfs at $local"
fi
mkdir -p "/host$local/tmp"
chmod 1777 "/host$local/tmp"
# The host's root becomes the namespace's "/" (what switch_root does), not a chroot's:
# a mount namespace copied from this one then has it at its root, so a container's
# pivot_root lays the container's root over "/", where a process entering the
# namespace (runc exec, kubectl exec) finds it; under a chroot at /host it would find
# the initramfs. busybox stays reachable for the last steps, in the VM's own /run.
cp /bin/busybox /host/run/mgvm-busybox
cd /host
mount --move /host / || { say "moving the host's root to / failed"; poweroff -f; }
say "starting the agent"
chroot . /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
	HOME=/root TMPDIR="$local/tmp" "$mgwork/agent" -name "$mgname" -listen ":` + agentPortString + `"
say "the agent exited with status $?"
/run/mgvm-busybox sync
/run/mgvm-busybox poweroff -f
`

// imageVersion changes whenever what goes into the image changes.
func imageVersion() string {
	h := sha256.New()
	h.Write([]byte("v1\x00" + initScript + "\x00" + strings.Join(bootModules, ",")))
	return hex.EncodeToString(h.Sum(nil))[:10]
}

// Image is a bootable kernel and initramfs (PrepareImage).
type Image struct {
	Kernel string // vmlinux (uncompressed, PVH entry) or, failing that, vmlinuz
	Initrd string // uncompressed newc cpio
}

// errSkip marks a missing tool: Start skips the test rather than failing it.
type errSkip struct{ msg string }

func (e errSkip) Error() string { return e.msg }

// PrepareImage returns the cached image for the kernel that
// linux-image-amd64 depends on now, building it first when missing. Builds
// by parallel processes are serialised with a lock file. Its error is an
// errSkip when a tool is missing (Start then skips the test).
func PrepareImage(logf func(string, ...any)) (Image, error) {
	if err := os.MkdirAll(CacheDir, 0o755); err != nil {
		return Image{}, err
	}
	lock, err := os.OpenFile(filepath.Join(CacheDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return Image{}, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return Image{}, fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)

	kpkg, err := kernelPackage()
	if err != nil {
		// Without package lists, any image built before will do.
		if img, ok := newestCached(); ok {
			logf("vmtest: %v; using the cached %s", err, filepath.Dir(img.Kernel))
			return img, nil
		}
		return Image{}, err
	}
	dir := filepath.Join(CacheDir, kpkg+"-"+imageVersion())
	img := Image{Kernel: filepath.Join(dir, "vmlinux"), Initrd: filepath.Join(dir, "initrd.cpio")}
	if _, err := os.Stat(filepath.Join(dir, "ready")); err == nil {
		if _, err := os.Stat(img.Kernel); err != nil {
			img.Kernel = filepath.Join(dir, "vmlinuz")
		}
		// In use: see the removal of other images below.
		now := time.Now()
		_ = os.Chtimes(filepath.Join(dir, "ready"), now, now)
		return img, nil
	}
	for _, tool := range []string{"apt-get", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			return Image{}, errSkip{fmt.Sprintf("no cached VM image in %s and no %s to make one", CacheDir, tool)}
		}
	}
	logf("vmtest: building the VM image for %s in %s", kpkg, dir)
	tmp, err := os.MkdirTemp(CacheDir, ".build-")
	if err != nil {
		return Image{}, err
	}
	defer os.RemoveAll(tmp)
	if err := buildImage(tmp, kpkg); err != nil {
		return Image{}, err
	}
	if err := os.RemoveAll(dir); err != nil {
		return Image{}, err
	}
	if err := os.Rename(filepath.Join(tmp, "out"), dir); err != nil {
		return Image{}, err
	}
	if _, err := os.Stat(img.Kernel); err != nil {
		img.Kernel = filepath.Join(dir, "vmlinuz")
	}
	if err := os.WriteFile(filepath.Join(dir, "ready"), nil, 0o644); err != nil {
		return Image{}, err
	}
	// Images of other kernels or init scripts are not kept (about 75 MB
	// each), unless one was used within the last hour: a checkout with
	// another init script or module list (another branch) may be running
	// VMs from it now.
	old, _ := filepath.Glob(filepath.Join(CacheDir, "linux-image-*"))
	for _, o := range old {
		if o == dir {
			continue
		}
		if fi, err := os.Stat(filepath.Join(o, "ready")); err == nil && time.Since(fi.ModTime()) < time.Hour {
			continue
		}
		logf("vmtest: removing the outdated VM image %s", o)
		os.RemoveAll(o)
	}
	return img, nil
}

// kernelPackage is the linux-image-<version>-amd64 package that
// linux-image-amd64 depends on, updating the package lists once if needed.
func kernelPackage() (string, error) {
	if _, err := exec.LookPath("apt-cache"); err != nil {
		return "", errSkip{"apt-cache is not installed"}
	}
	find := func() string {
		out, _ := exec.Command("apt-cache", "depends", "linux-image-amd64").Output()
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") &&
				len(f[1]) > len("linux-image-") && f[1][len("linux-image-")] >= '0' && f[1][len("linux-image-")] <= '9' {
				return f[1]
			}
		}
		return ""
	}
	if p := find(); p != "" {
		return p, nil
	}
	if out, err := exec.Command("apt-get", "update", "-qq").CombinedOutput(); err != nil {
		return "", fmt.Errorf("apt-get update: %v: %s", err, out)
	}
	if p := find(); p != "" {
		return p, nil
	}
	return "", errSkip{"apt-cache knows no linux-image-amd64 kernel"}
}

func newestCached() (Image, bool) {
	dirs, _ := filepath.Glob(filepath.Join(CacheDir, "linux-image-*-"+imageVersion()))
	sort.Strings(dirs)
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "ready")); err != nil {
			continue
		}
		img := Image{Kernel: filepath.Join(dirs[i], "vmlinux"), Initrd: filepath.Join(dirs[i], "initrd.cpio")}
		if _, err := os.Stat(img.Kernel); err != nil {
			img.Kernel = filepath.Join(dirs[i], "vmlinuz")
		}
		return img, true
	}
	return Image{}, false
}

func run(dir, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// buildImage downloads the kernel and busybox-static packages into tmp,
// unpacks them and leaves tmp/out/{vmlinux or vmlinuz,initrd.cpio}.
func buildImage(tmp, kpkg string) error {
	if err := run(tmp, "apt-get", "download", "-qq", kpkg, "busybox-static"); err != nil {
		return err
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "*.deb"))
	x := filepath.Join(tmp, "x")
	for _, d := range debs {
		if err := run(tmp, "dpkg-deb", "-x", d, x); err != nil {
			return err
		}
	}
	kver := strings.TrimPrefix(kpkg, "linux-image-")
	out := filepath.Join(tmp, "out")
	if err := os.Mkdir(out, 0o755); err != nil {
		return err
	}
	vmlinuz := filepath.Join(x, "boot", "vmlinuz-"+kver)
	config, _ := os.ReadFile(filepath.Join(x, "boot", "config-"+kver))
	// An uncompressed kernel boots much faster under TCG (no decompression
	// in the guest); qemu loads it only through its PVH entry point.
	if bytes.Contains(config, []byte("\nCONFIG_PVH=y\n")) {
		if err := extractVmlinux(vmlinuz, filepath.Join(out, "vmlinux")); err != nil {
			os.Remove(filepath.Join(out, "vmlinux"))
		}
	}
	if _, err := os.Stat(filepath.Join(out, "vmlinux")); err != nil {
		if err := copyFile(vmlinuz, filepath.Join(out, "vmlinuz"), 0o644); err != nil {
			return err
		}
	}

	modDir := filepath.Join(x, "lib", "modules", kver)
	order, err := moduleOrder(modDir, bootModules)
	if err != nil {
		return err
	}
	w := &cpioWriter{}
	for _, d := range []string{"bin", "dev", "proc", "sys", "host", "modules"} {
		w.dir(d)
	}
	w.charDev("dev/console", 0o600, 5, 1)
	busybox, err := os.ReadFile(filepath.Join(x, "bin", "busybox"))
	if err != nil {
		return fmt.Errorf("busybox-static: %w", err)
	}
	w.file("bin/busybox", 0o755, busybox)
	w.file("init", 0o755, []byte(initScript))
	var names []string
	for _, m := range order {
		data, err := os.ReadFile(m.path)
		if err != nil {
			return err
		}
		w.file("modules/"+m.name+".ko", 0o644, data)
		names = append(names, m.name)
	}
	w.file("modules/order", 0o644, []byte(strings.Join(names, "\n")+"\n"))
	return os.WriteFile(filepath.Join(out, "initrd.cpio"), w.finish(), 0o644)
}

// extractVmlinux writes the ELF kernel packed in a bzImage: the setup
// header says where the compressed payload is, an external decompressor
// unpacks it.
func extractVmlinux(bzImage, dst string) error {
	data, err := os.ReadFile(bzImage)
	if err != nil {
		return err
	}
	if len(data) < 0x250 || string(data[0x202:0x206]) != "HdrS" {
		return errors.New("not a bzImage")
	}
	setupSects := int(data[0x1f1])
	if setupSects == 0 {
		setupSects = 4
	}
	off := (setupSects+1)*512 + int(binary.LittleEndian.Uint32(data[0x248:]))
	n := int(binary.LittleEndian.Uint32(data[0x24c:]))
	if off < 0 || n <= 0 || off+n > len(data) {
		return errors.New("bzImage payload out of range")
	}
	payload := data[off : off+n]
	var cmd *exec.Cmd
	switch {
	case bytes.HasPrefix(payload, []byte("\xfd7zXZ\x00")):
		cmd = exec.Command("xz", "-dc", "--single-stream")
	case bytes.HasPrefix(payload, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		cmd = exec.Command("zstd", "-dc")
	case bytes.HasPrefix(payload, []byte{0x1f, 0x8b}):
		cmd = exec.Command("gzip", "-dc")
	default:
		return fmt.Errorf("unknown kernel compression %x", payload[:4])
	}
	f, err := os.Create(dst)
	if err != nil {
		return err
	}
	defer f.Close()
	var stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(payload), f, &stderr
	// Trailing bytes after the stream (the appended size) make some
	// decompressors complain; the ELF check below is what counts.
	_ = cmd.Run()
	if err := f.Sync(); err != nil {
		return err
	}
	ef, err := elf.Open(dst)
	if err != nil {
		return fmt.Errorf("decompressed kernel: %v (%s)", err, bytes.TrimSpace(stderr.Bytes()))
	}
	defer ef.Close()
	for _, p := range ef.Progs {
		if p.Type == elf.PT_NOTE {
			return nil
		}
	}
	return errors.New("decompressed kernel has no notes (no PVH entry)")
}

type module struct{ name, path string }

// moduleOrder lists want and everything they depend on, each module after
// its dependencies, reading "depends=" from every module's .modinfo.
func moduleOrder(modDir string, want []string) ([]module, error) {
	paths := map[string]string{}
	err := filepath.WalkDir(modDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			paths[modName(strings.TrimSuffix(d.Name(), ".ko"))] = p
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var order []module
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string, from string) error
	visit = func(name, from string) error {
		name = modName(name)
		switch state[name] {
		case 1:
			return fmt.Errorf("module dependency cycle at %s", name)
		case 2:
			return nil
		}
		p, ok := paths[name]
		if !ok {
			return fmt.Errorf("module %s (needed by %s) is not in %s (built in?)", name, from, modDir)
		}
		state[name] = 1
		deps, err := moduleDepends(p)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d, name); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, module{name: name, path: p})
		return nil
	}
	for _, w := range want {
		if err := visit(w, "init"); err != nil {
			return nil, err
		}
	}
	return order, nil
}

func modName(s string) string { return strings.ReplaceAll(s, "-", "_") }

func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("%s has no .modinfo", path)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, err
	}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			var deps []string
			for _, d := range strings.Split(string(v), ",") {
				if d != "" {
					deps = append(deps, d)
				}
			}
			return deps, nil
		}
	}
	return nil, nil
}

func copyFile(src, dst string, perm os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// cpioWriter builds an uncompressed "newc" cpio archive, the format the
// kernel unpacks as initramfs.
type cpioWriter struct {
	buf bytes.Buffer
	ino int
}

func (w *cpioWriter) entry(name string, mode uint32, rdevMajor, rdevMinor int, data []byte) {
	w.ino++
	nlink := 1
	if mode&unix.S_IFMT == unix.S_IFDIR {
		nlink = 2
	}
	fmt.Fprintf(&w.buf, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		w.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	w.buf.WriteString(name)
	w.buf.WriteByte(0)
	w.pad()
	w.buf.Write(data)
	w.pad()
}

func (w *cpioWriter) pad() {
	for w.buf.Len()%4 != 0 {
		w.buf.WriteByte(0)
	}
}

func (w *cpioWriter) dir(name string) { w.entry(name, unix.S_IFDIR|0o755, 0, 0, nil) }
func (w *cpioWriter) file(name string, perm uint32, data []byte) {
	w.entry(name, unix.S_IFREG|perm, 0, 0, data)
}
func (w *cpioWriter) charDev(name string, perm uint32, major, minor int) {
	w.entry(name, unix.S_IFCHR|perm, major, minor, nil)
}

func (w *cpioWriter) finish() []byte {
	w.entry("TRAILER!!!", 0, 0, 0, nil)
	return w.buf.Bytes()
}

package accessmode

import "fmt"

// AccessType is how a volume is handed to a workload.
type AccessType string

const (
	Mount AccessType = "mount" // a filesystem, mounted at the target path
	Block AccessType = "block" // the raw device, bound at the target path
)

// Backend names a storage backend.
type Backend string

const (
	BackendBlock Backend = "block" // sparse images attached as loop devices
	BackendNFS   Backend = "nfs"   // one ganesha export per volume
)

// Serves reports whether backend b can honour mode m for access type t
// without letting two writers corrupt the data, and if not, why and what to
// use instead.
func Serves(b Backend, t AccessType, m Mode) error {
	if !Valid(m) {
		return fmt.Errorf("access mode %v is not a defined CSI access mode", m)
	}
	switch b {
	case BackendBlock:
		if t == Block {
			return nil // a raw device: the workloads coordinate writes themselves
		}
		if t != Mount {
			return fmt.Errorf("access type %q is not one of mount, block", t)
		}
		if l, _ := limitsOf(m); l.nodes > 1 && l.writerNodes > 0 {
			return fmt.Errorf("backend block cannot serve %s with access type mount: a local filesystem (ext4/xfs) mounted on several nodes with a writer among them gets corrupted; use backend nfs (StorageClass parameter backend=nfs or backend=auto), or access type block", Name(m))
		}
		return nil
	case BackendNFS:
		if t == Block {
			return fmt.Errorf("backend nfs serves filesystems only; for access type block use backend block")
		}
		if t != Mount {
			return fmt.Errorf("access type %q is not one of mount, block", t)
		}
		return nil
	}
	return fmt.Errorf("unknown backend %q; accepted: block, nfs", b)
}

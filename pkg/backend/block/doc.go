// Package block is the backend that keeps every volume as a sparse image
// file in a per-zone pool directory and hands it to a node as a loop device,
// formatted with ext4 or xfs for access type mount.
//
// # Pool layout
//
// A pool is a directory given as --block-pool ZONE=DIR. Inside it:
//
//	DIR/volumes/<file name>.json     the backend.Volume, JSON, mode 0600
//	DIR/volumes/<file name>.img      the volume's sparse image, mode 0600
//	DIR/snapshots/<file name>.json   the backend.Snapshot, JSON, mode 0600
//	DIR/snapshots/<file name>.img    the snapshot's image (a sparse or reflink copy)
//	DIR/{volumes,snapshots}/.<name>.tmp-*   work in progress, never read
//
// where <file name> is volumeid.ID.FileName() of the object's id, so the
// id alone locates its files and a path can only ever be built from an id
// that volumeid.Parse accepted.
//
// # Who writes what
//
// Only the controller writes. It creates an image under a temporary name,
// fills it, fsyncs it, renames it into place, and only then writes the
// metadata; deletion removes the metadata first. So at every instant a
// metadata file names a complete image, and after a crash the leftovers are
// temporary files and images without metadata, which NewController removes.
// Metadata is replaced by atomic rename (fsutil.WriteJSONAtomic), which lets
// node processes, several of them on one machine, read it without locks.
//
// # Access modes
//
// The servers apply the access-mode rules before calling in here; this
// backend makes the outcome physical. Stage refuses a node the controller
// has not recorded as attached, and a read-only stage gets a read-only loop
// device, so the kernel itself refuses writes (EROFS) whatever the mount
// flags say. Volumes whose every mode is read-only are formatted at
// creation, because no node may ever write to them to format them later.
package block

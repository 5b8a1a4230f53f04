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
//	DIR/templates/ext4-<bytes>-v1.img        a formatted filesystem new ext4
//	                                         volumes of that size copy (template.go)
//
// where <file name> is volumeid.ID.FileName() of the object's id, so the
// id alone locates its files and a path can only ever be built from an id
// that volumeid.Parse accepted.
//
// DIR above is the pool root. It is the --block-pool directory itself,
// unless that directory's filesystem has no reflinks: then the driver keeps
// a filesystem with reflinks in it (KeepPools, keptpool.go), a btrfs where
// the machine has btrfs or with --block-pool-filesystem=btrfs (unless the
// directory is on btrfs), an xfs where it has none or with
// --block-pool-filesystem=xfs, and the root is that filesystem, mounted
// inside the directory:
//
//	DIR/kept-pool.img          sparse xfs image (mkfs.xfs -m reflink=1) or
//	                           btrfs image (mkfs.btrfs -m single -d single),
//	                           as large as DIR's filesystem, never resized
//	                           nor mounted as the other filesystem
//	DIR/kept/                  where it is mounted (-o discard): the root
//	DIR/.kept-pool.lock*       lock files of the processes that mount it
//
// Every process that uses the pool (controller, storage target, node
// plugins, the same --block-pool-filesystem in each) resolves DIR the same
// way, so they all find the same volumes: whoever comes first makes and
// attaches the image, the others mount the loop device already bound to it
// (two devices over one image would corrupt it), each in its own mount
// namespace. A directory that has reflinks, that holds volumes or
// snapshots from before (they stay where they are), or whose filesystem is
// under xfs's 300 MiB minimum is its own root; one holding a kept image is
// never used as its own root.
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
// creation, because no node may ever write to them to format them later;
// so are all empty ext4 volumes, whose filesystem is a copy of a template
// (template.go) that costs less than a mkfs at the first stage.
//
// # Snapshots and clones of volumes in use
//
// A snapshot (and a clone, CreateVolume from a volume) is crash-consistent:
// the copy is the image as it was at one instant, holding every write the
// workload had acknowledged (fsync'd) before the call, as if the node had
// lost power then. How, depends on the pool's filesystem:
//
//   - With reflinks (xfs made with reflink=1, the default of current
//     xfsprogs; btrfs), the copy is one FICLONE: the kernel flushes the
//     image's dirty pages and clones its extents under the inode's lock,
//     an instant single point in time that costs no space until either
//     side changes. Guest fsyncs reach the image file before they return
//     (the loop device flushes into it), so they are all in the clone.
//   - A pool directory without reflinks (ext4, tmpfs, xfs made with
//     reflink=0) gets a btrfs or an xfs with reflinks kept in it (see Pool layout),
//     so the copy is the same FICLONE there. It costs one loop device and
//     one mount per pool and process namespace, and space on the
//     directory's filesystem only as blocks are written (the image is
//     sparse; the discard mount option punches the blocks of deleted
//     images back out of it).
//   - Where there is still no reflink (a pool that held volumes before it
//     could be kept, --block-pool-filesystem=direct, a filesystem under
//     300 MiB), a byte copy is only a point in time if nothing writes the
//     image while it runs. A volume attached read-write to any node (the
//     controller's record), or bound read-write to a loop device on the
//     controller's machine (the kernel's word), is refused with
//     FAILED_PRECONDITION saying so and how to get a kept pool; once
//     detached it copies.
//
// A group snapshot (CreateSnapshotGroup) needs every member as of one
// instant, not each as of its own. A new pool on btrfs keeps its images in
// a subvolume of their own (DIR/volumes), so one read-only snapshot of it
// captures them all at the commit of one transaction, and each member is
// a reflink of its image there (group.go, btrfs.go); a kept btrfs is such a
// pool, laid out when it is new like any other. Elsewhere members are
// taken one after the other, and a group of more than one volume being
// written is refused.
//
// Freezing the filesystem on the node that mounts it (FIFREEZE) was the
// other way to make a byte copy a point in time. It was not chosen: CSI
// gives the controller no call to reach that node, a copy may outlast the
// CO's deadline while every writer on the volume stays blocked, and a
// controller that dies mid-copy would leave the volume frozen. Keeping a
// filesystem with reflinks for the pool needs none of that: the clone is
// the instant, on the controller's side alone.
//
// A crash-consistent copy of a filesystem may keep acknowledged writes only
// in its journal. Before a restored or cloned filesystem volume is handed
// out, the controller mounts the new image read/write once and unmounts it
// (replayJournal), so the journal is replayed into the filesystem. Volumes
// of read-only modes are then mounted read-only without noload/norecovery
// and show everything; only read-only stages of writable volumes (the
// readers of MULTI_NODE_SINGLE_WRITER) skip a journal that a live writer
// elsewhere still owns.
//
// # Transports: loop devices here, iSCSI across machines
//
// A node reaches a volume's image through a loop device on the image in a
// pool directory that every node of the zone sees at the same path (one
// machine, kind). Across machines the image stays on its zone's storage
// target and the node reaches it over the network: package lio serves each
// volume from the kernel's LIO iSCSI target, package served keeps each
// volume's access list equal to its attachments on a storage target
// (--roles target), and package iscsi logs the node in with open-iscsi and
// finds the volume's disk by its session and serial.
//
// The node tells the two apart by the volume context: a volume a target
// serves over iSCSI says so (transport=iscsi, with its target, portal and
// serial), and Node stages it with a login rather than a loop device.
// Each transport is one type behind one interface (transport.go,
// transport_loop.go, transport_iscsi.go); what is done with the device
// once it is there, Node does the same way for both. The target enforces who may reach it, so the node
// checks the disk it got instead: found by the serial derived from the
// volume id, at least the size in the publish context, and write-protected
// exactly when the attachment is read-only. A read-only stage of a
// writable attachment sets the disk's kernel read-only flag; a read-only
// raw block publish of a read/write stage gets a read-only loop device over
// the disk, as over an image. Every later question (unstage, check,
// health, whether a mount is the volume's) is answered from the kernel's
// sessions and the disks' serials, so a session a crash left is found and
// ended, and a stage a reboot lost is seen as gone. The target serves each
// image through a loop device of its own, so that an expansion (image,
// then device) reaches the nodes at their rescan.
//
// iSCSI through LIO was chosen over NVMe over TCP for what the access
// modes need at the server:
//
//   - LIO maps a LUN write-protected per initiator (the mapped LUN's
//     write_protect): the readers of ROX and of MULTI_NODE_SINGLE_WRITER
//     get DATA PROTECT from the target on every write, even one sent
//     around their own kernel's read-only flag, as NFS readers get a
//     read-only export. nvmet in Linux 6.1 has no read-only per host or per
//     namespace: the same would need a namespace per access level (a
//     second, read-only namespace of the same image, served to the
//     readers), which the kernel target cannot mark read-only either; the
//     node would be trusted to stay read-only.
//   - Removing a node's ACL ends its sessions before the removal returns:
//     that is the fence every ControllerUnpublishVolume makes. Removing a
//     host from an nvmet subsystem's allowed_hosts leaves its connected
//     controllers up; the fence would have to delete the subsystem's port
//     link (every host's connections) or the subsystem itself.
//   - LIO has CHAP per initiator, so an IQN alone is not an identity;
//     Debian 12's kernel builds NVMe in-band authentication out, and an
//     NVMe host NQN is whatever the host says it is.
//
// A network fence (csi-addons NetworkFence, package netfence) is the same
// fence made without the CO: the fenced node's attachments stay recorded,
// marked fenced, and the target leaves it off the access list, which ends
// its sessions. Over the loop transport nothing on the storage side can
// fence a node, so SetAttachments refuses a fenced attachment with that
// reason, and the fence call fails for such a volume.
//
// What NVMe/TCP does better (no iscsid on the node, one write to
// /dev/nvme-fabrics to connect, native multipath) does not outweigh a
// read-only mode the target cannot enforce.
//
// Loop devices always have 512-byte sectors: with direct I/O the kernel
// would take the image file's direct-I/O alignment instead, and on xfs a
// file that shares extents with a snapshot asks for 4096, which a
// filesystem made with 1 KiB blocks or 512-byte sectors cannot mount on.
package block

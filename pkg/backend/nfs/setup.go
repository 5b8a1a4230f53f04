package nfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/backend/nfs/imagestore"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
	"github.com/modeguard/modeguard/pkg/fsutil"
)

// Options are the controller's NFS flags.
type Options struct {
	// Storage is how sizes are limited: "quota" (xfs project quotas),
	// "images" (one loop-mounted image per volume) or "auto" (quota
	// where the kernel's xfs supports it, images otherwise).
	Storage string
	// ImageFilesystem is what the image storage formats new volumes
	// with: "xfs" (the default) or "ext4" (see imagestore.Filesystem).
	ImageFilesystem string
	// ExportRoot is where volume data lives on the server: a prjquota xfs
	// mount point, or a directory in which the driver keeps a pool image
	// of PoolImageSize bytes and mounts it.
	ExportRoot    string
	PoolImageSize int64
	// Server is the address nodes mount from; Port is ganesha's NFS port.
	Server string
	Port   int
	// GaneshaDBus, when set, is the D-Bus address of a ganesha someone else
	// runs; ExportConfigDir must then be a directory its configuration
	// includes with %dir. Otherwise the driver runs its own ganesha with
	// its runtime files in GaneshaDir.
	GaneshaDBus     string
	ExportConfigDir string
	GaneshaDir      string
	ListenAddress   string
	// ControlFailed, when set, is told each operation on ganesha that
	// fails (see Config).
	ControlFailed func(operation string)
	// PauseBudget bounds how long the driver's own ganesha is held still
	// for the copy of a volume in use (Config.PauseBudget); it must be
	// shorter than ganesha's NFSv4 lease.
	PauseBudget time.Duration
	// Paused, when set, is told each pause (see Config).
	Paused func(took time.Duration, outcome string)
}

// Setup prepares the pool, starts or reaches ganesha, and returns the
// controller with the function that stops what Setup started.
func Setup(ctx context.Context, o Options) (*Controller, func(), error) {
	if o.ExportRoot == "" || o.Server == "" {
		return nil, nil, errors.New("nfs: --nfs-export-root and --nfs-server are both required")
	}
	// A client that hears nothing from the server for a lease may take it
	// for a restart and reclaim its state; a pause must end well before.
	if o.PauseBudget < 0 || o.PauseBudget >= ganesha.DefaultLeaseLifetime {
		return nil, nil, fmt.Errorf("nfs: --nfs-pause-budget=%v: want less than the NFSv4 lease ganesha grants, %v (0 for the default)",
			o.PauseBudget, ganesha.DefaultLeaseLifetime)
	}
	var stops []func()
	stop := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	storage, err := openStorage(ctx, o)
	if err != nil {
		return nil, nil, err
	}
	stops = append(stops, func() {
		if err := storage.Release(); err != nil {
			klog.ErrorS(err, "Releasing the NFS storage")
		}
	})
	exportDir := o.ExportConfigDir
	if o.GaneshaDBus != "" && exportDir == "" {
		stop()
		return nil, nil, errors.New("nfs: with --nfs-ganesha-dbus, --nfs-export-config-dir must name the directory ganesha includes")
	}
	if exportDir == "" {
		exportDir = filepath.Join(o.GaneshaDir, "exports")
	}
	// Everything ganesha reads at start is put right before it starts.
	c, err := NewController(ctx, Config{
		Storage: storage, ExportDir: exportDir, Server: o.Server, Port: o.Port, ControlFailed: o.ControlFailed,
		PauseBudget: o.PauseBudget, Paused: o.Paused,
	})
	if err != nil {
		stop()
		return nil, nil, err
	}
	var exporter Exporter
	if o.GaneshaDBus != "" {
		control, err := ganesha.Dial(o.GaneshaDBus)
		if err != nil {
			stop()
			return nil, nil, fmt.Errorf("nfs: reaching ganesha at %s: %w", o.GaneshaDBus, err)
		}
		stops = append(stops, func() { control.Close() })
		exporter = control
	} else {
		// StartServer first stops a ganesha an earlier, killed controller
		// left running on the same directory.
		srv, err := ganesha.StartServer(ctx, ganesha.ServerConfig{
			Dir: o.GaneshaDir, ExportDir: exportDir, Port: o.Port, ListenAddress: o.ListenAddress,
		})
		if err != nil {
			stop()
			return nil, nil, fmt.Errorf("nfs: starting ganesha: %w", err)
		}
		stops = append(stops, func() {
			if err := srv.Stop(); err != nil {
				klog.ErrorS(err, "Stopping ganesha")
			}
		})
		exporter = srv.Control()
		c.cfg.WhyRefused = srv.LogAbout
		// Only a ganesha of the driver's own can be held still; another's
		// (--nfs-ganesha-dbus) cannot, and copies of volumes in use are
		// then refused.
		c.cfg.Pause = srv.Pause
	}
	if err := c.Start(ctx, exporter); err != nil {
		stop()
		return nil, nil, err
	}
	return c, stop, nil
}

// storageRecordName is the file in the export root that says which storage
// holds its volumes: a later start must read them the same way.
const storageRecordName = ".modeguard-nfs-storage.json"

type storageRecord struct {
	Storage string `json:"storage"`
}

// chooseStorage decides the storage from what was asked (--nfs-storage),
// what the export root records ("" when nothing is recorded yet) and
// whether this kernel has xfs quota support. auto takes the recorded
// storage, else quota where the kernel supports it; an explicit choice
// that contradicts the record is refused rather than misreading the
// volumes already there.
func chooseStorage(asked, recorded string, quotaSupported bool) (string, error) {
	switch asked {
	case "", "auto", "quota", "images":
	default:
		return "", fmt.Errorf("nfs: --nfs-storage=%q is not one of auto, quota, images", asked)
	}
	switch recorded {
	case "", "quota", "images":
	default:
		return "", fmt.Errorf("nfs: the export root records storage %q (%s), which this driver does not know", recorded, storageRecordName)
	}
	chosen := asked
	switch {
	case recorded != "" && (asked == "" || asked == "auto" || asked == recorded):
		chosen = recorded
	case recorded != "":
		return "", fmt.Errorf("nfs: the export root holds %s storage (recorded in %s) and --nfs-storage=%s would misread its volumes; "+
			"start with --nfs-storage=%s or auto, or move the volumes off and remove the record", recorded, storageRecordName, asked, recorded)
	case asked == "" || asked == "auto":
		chosen = "images"
		if quotaSupported {
			chosen = "quota"
		}
	}
	if chosen == "quota" && !quotaSupported {
		return "", fmt.Errorf("nfs: the export root's volumes are in quota storage (xfs project quotas), and this kernel has no xfs quota support (CONFIG_XFS_QUOTA); " +
			"run the controller on a kernel with it")
	}
	return chosen, nil
}

// recordedStorage reads the export root's record, or infers the storage
// of an export root made before records were kept from what each storage
// leaves there ("" for a fresh root).
func recordedStorage(root string) (string, error) {
	var rec storageRecord
	err := fsutil.ReadJSON(filepath.Join(root, storageRecordName), &rec)
	switch {
	case err == nil:
		return rec.Storage, nil
	case !errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("nfs: reading %s: %w", storageRecordName, err)
	}
	if _, err := os.Stat(filepath.Join(root, imagestore.ImagesDirName)); err == nil {
		return "images", nil
	}
	if _, err := os.Stat(filepath.Join(root, projquota.MountDirName)); err == nil {
		return "quota", nil
	}
	return "", nil
}

// openStorage picks (chooseStorage), opens and records the storage.
func openStorage(ctx context.Context, o Options) (Storage, error) {
	recorded, err := recordedStorage(o.ExportRoot)
	if err != nil {
		return nil, err
	}
	mode, err := chooseStorage(o.Storage, recorded, projquota.KernelSupportsQuota())
	if err != nil {
		return nil, err
	}
	klog.InfoS("NFS storage chosen", "storage", mode, "asked", o.Storage, "recorded", recorded)
	storage, err := openStorageOf(ctx, mode, o)
	if err != nil {
		return nil, err
	}
	if recorded == "" || recorded != mode {
		if err := fsutil.WriteJSONAtomic(filepath.Join(o.ExportRoot, storageRecordName), storageRecord{Storage: mode}); err != nil {
			_ = storage.Release()
			return nil, fmt.Errorf("nfs: recording the storage choice: %w", err)
		}
	}
	return storage, nil
}

func openStorageOf(ctx context.Context, mode string, o Options) (Storage, error) {
	switch mode {
	case "quota":
		pool, release, err := projquota.Prepare(ctx, o.ExportRoot, o.PoolImageSize)
		if err != nil {
			return nil, fmt.Errorf("nfs: preparing the quota pool: %w", err)
		}
		return NewQuotaStorage(pool, release), nil
	case "images":
		newFS := imagestore.XFS
		if o.ImageFilesystem != "" {
			f, err := imagestore.ParseFilesystem(o.ImageFilesystem)
			if err != nil {
				return nil, fmt.Errorf("nfs: --nfs-image-filesystem: %w", err)
			}
			newFS = f
		}
		store, err := imagestore.Open(ctx, o.ExportRoot, newFS)
		if err != nil {
			return nil, fmt.Errorf("nfs: opening the image store: %w", err)
		}
		return NewImageStorage(store), nil
	}
	return nil, fmt.Errorf("nfs: unknown storage %q", mode)
}

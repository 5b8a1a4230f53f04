package nfs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"k8s.io/klog/v2"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha"
	"github.com/modeguard/modeguard/pkg/backend/nfs/imagestore"
	"github.com/modeguard/modeguard/pkg/backend/nfs/projquota"
)

// Options are the controller's NFS flags.
type Options struct {
	// Storage is how sizes are limited: "quota" (xfs project quotas),
	// "images" (one loop-mounted xfs image per volume) or "auto" (quota
	// where the kernel's xfs supports it, images otherwise).
	Storage string
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
}

// Setup prepares the pool, starts or reaches ganesha, and returns the
// controller with the function that stops what Setup started.
func Setup(ctx context.Context, o Options) (*Controller, func(), error) {
	if o.ExportRoot == "" || o.Server == "" {
		return nil, nil, errors.New("nfs: --nfs-export-root and --nfs-server are both required")
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
	}
	if err := c.Start(ctx, exporter); err != nil {
		stop()
		return nil, nil, err
	}
	return c, stop, nil
}

// openStorage picks and opens the storage the options ask for.
func openStorage(ctx context.Context, o Options) (Storage, error) {
	mode := o.Storage
	if mode == "" || mode == "auto" {
		mode = "images"
		if projquota.KernelSupportsQuota() {
			mode = "quota"
		}
		klog.InfoS("NFS storage chosen", "storage", mode, "reason", "--nfs-storage=auto and xfs quota support is "+map[bool]string{true: "present", false: "absent"}[mode == "quota"])
	}
	switch mode {
	case "quota":
		pool, release, err := projquota.Prepare(ctx, o.ExportRoot, o.PoolImageSize)
		if err != nil {
			return nil, fmt.Errorf("nfs: preparing the quota pool: %w", err)
		}
		return NewQuotaStorage(pool, release), nil
	case "images":
		store, err := imagestore.Open(ctx, o.ExportRoot)
		if err != nil {
			return nil, fmt.Errorf("nfs: opening the image store: %w", err)
		}
		return NewImageStorage(store), nil
	}
	return nil, fmt.Errorf("nfs: --nfs-storage=%q is not one of auto, quota, images", o.Storage)
}

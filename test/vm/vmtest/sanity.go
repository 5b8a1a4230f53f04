package vmtest

import (
	"context"
	"fmt"
	"strings"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// SanityConfig is csi-sanity's configuration for the node plugin in vm:
// its endpoint, dialled through the cluster's network namespace, and
// target and staging paths on the VM's own storage, which sanity creates,
// checks and removes through the VM, where the plugin mounts. The caller
// sets the controller's address and the volumes' parameters.
func (v *VM) SanityConfig(ctx context.Context) sanity.TestConfig {
	run := func(name string, args ...string) (string, error) {
		out, code, err := v.Run(ctx, name, args...)
		if err != nil {
			return out, err
		}
		if code != 0 {
			return out, fmt.Errorf("%s %s in %s: exit %d: %s", name, strings.Join(args, " "), v.Name, code, out)
		}
		return out, nil
	}
	mkdir := func(p string) (string, error) { _, err := run("mkdir", "-p", p); return p, err }
	remove := func(p string) error { _, err := run("rm", "-rf", p); return err }

	cfg := sanity.NewTestConfig()
	cfg.Address = "passthrough:///" + v.NodeEndpoint()
	cfg.DialOptions = []grpc.DialOption{grpc.WithContextDialer(v.c.Dialer()),
		grpc.WithTransportCredentials(insecure.NewCredentials())}
	cfg.TargetPath = v.Path("sanity", "target")
	cfg.StagingPath = v.Path("sanity", "staging")
	cfg.CreateTargetDir, cfg.CreateStagingDir = mkdir, mkdir
	cfg.RemoveTargetPath, cfg.RemoveStagingPath = remove, remove
	cfg.CheckPath = func(p string) (sanity.PathKind, error) {
		out, err := run("stat", "-c", "%F", p)
		switch {
		case err != nil && strings.Contains(out, "No such file"):
			return sanity.PathIsNotFound, nil
		case err != nil:
			return sanity.PathIsOther, err
		case strings.Contains(out, "directory"):
			return sanity.PathIsDir, nil
		case strings.Contains(out, "regular"):
			return sanity.PathIsFile, nil
		}
		return sanity.PathIsOther, nil
	}
	return cfg
}

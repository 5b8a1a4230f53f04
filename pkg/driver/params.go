package driver

import (
	"slices"
	"sort"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/backend"
)

// StorageClass parameter keys.
const (
	ParamBackend    = "backend"
	ParamFsType     = "fsType"
	ParamRootSquash = "rootSquash"
)

// Backend choices for ParamBackend.
const (
	BackendAuto = "auto"
)

// Keys with this prefix are set by Kubernetes' sidecars (PVC name, namespace,
// fstype, secret names) and are accepted without being interpreted.
const kubernetesParamPrefix = "csi.storage.k8s.io/"

var acceptedParams = []string{ParamBackend, ParamFsType, ParamRootSquash}

// Supported filesystems, in order of preference.

// DefaultFsType is used when neither the capability nor the parameters name one.
const DefaultFsType = "ext4"

// Params are a StorageClass's parameters, parsed and checked up front.
type Params struct {
	Backend string // block, nfs or auto
	FsType  string // empty: decided by the capability or the default
	// RootSquash maps root on the clients to an anonymous user (NFS). On
	// by default: a container running as root must not own the export.
	RootSquash bool
}

// ParseParams rejects unknown keys and bad values with InvalidArgument,
// naming what is accepted.
func ParseParams(in map[string]string) (Params, error) {
	p := Params{Backend: BackendAuto, RootSquash: true}
	keys := make([]string, 0, len(in))
	for k := range in {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := in[k]
		switch {
		case strings.HasPrefix(k, kubernetesParamPrefix):
			if k == kubernetesParamPrefix+"fstype" && v != "" {
				if err := setFsType(&p, k, v); err != nil {
					return Params{}, err
				}
			}
		case k == ParamBackend:
			if !slices.Contains([]string{"block", "nfs", BackendAuto}, v) {
				return Params{}, status.Errorf(codes.InvalidArgument,
					"parameter %s=%q is not accepted; accepted values: block, nfs, auto", k, v)
			}
			p.Backend = v
		case k == ParamRootSquash:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return Params{}, status.Errorf(codes.InvalidArgument,
					"parameter %s=%q is not accepted; accepted values: true, false", k, v)
			}
			p.RootSquash = b
		case k == ParamFsType:
			if err := setFsType(&p, k, v); err != nil {
				return Params{}, err
			}
		default:
			return Params{}, status.Errorf(codes.InvalidArgument,
				"parameter %q is not known; accepted keys: %s, and any key starting with %q",
				k, strings.Join(acceptedParams, ", "), kubernetesParamPrefix)
		}
	}
	return p, nil
}

// setFsType records a filesystem named by either of the two keys that can
// name one, refusing two different answers.
func setFsType(p *Params, key, fs string) error {
	if fs == "" {
		return status.Errorf(codes.InvalidArgument, "%s is empty; accepted: %s", key, strings.Join(backend.FsTypes, ", "))
	}
	if err := backend.CheckFsType(fs); err != nil {
		return err
	}
	if p.FsType != "" && p.FsType != fs {
		return status.Errorf(codes.InvalidArgument,
			"parameters name two filesystems, %s and %s (%s); name one", p.FsType, fs, key)
	}
	p.FsType = fs
	return nil
}

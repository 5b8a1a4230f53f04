package driver

// StorageClass parameters and mutable parameters: their keys, the values
// each accepts, and their parsing into what a backend is asked for.

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
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

// mutableParams are the keys a VolumeAttributesClass may set (CSI
// mutable_parameters, at CreateVolume and ControllerModifyVolume), each
// with the backend it means something for.
var mutableParams = []mutableParam{
	{backend.AttrReadAheadKiB, accessmode.BackendBlock, fmt.Sprintf("an integer from 0 to %d", maxReadAheadKiB), parseReadAhead},
	{backend.AttrRootSquash, accessmode.BackendNFS, "true, false", parseBool},
}

type mutableParam struct {
	key     string
	backend accessmode.Backend
	accepts string // for messages
	// parse checks a value and returns its canonical form.
	parse func(string) (string, bool)
}

// maxReadAheadKiB bounds the read-ahead a volume may ask of a node's
// device: 16 MiB, far above what any workload gains from.
const maxReadAheadKiB = 16384

func parseReadAhead(v string) (string, bool) {
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil || n > maxReadAheadKiB {
		return "", false
	}
	return strconv.FormatUint(n, 10), true
}

func parseBool(v string) (string, bool) {
	b, err := strconv.ParseBool(v)
	if err != nil {
		return "", false
	}
	return strconv.FormatBool(b), true
}

// describeMutable lists the mutable keys, with their backends.
func describeMutable() string {
	var out []string
	for _, m := range mutableParams {
		out = append(out, fmt.Sprintf("%s (%s)", m.key, m.backend))
	}
	return strings.Join(out, ", ")
}

// ParseMutableParams checks mutable parameters for a volume of backend b
// and returns them in canonical form, or nil for none. It refuses with
// InvalidArgument, naming the key: an unknown key, a parameter fixed at
// creation, a key of another backend, a value out of range.
func ParseMutableParams(b accessmode.Backend, in map[string]string) (map[string]string, error) {
	if len(in) == 0 {
		return nil, nil
	}
	keys := slices.Sorted(maps.Keys(in))
	out := make(map[string]string, len(in))
	for _, k := range keys {
		i := slices.IndexFunc(mutableParams, func(m mutableParam) bool { return m.key == k })
		switch {
		case i < 0 && (slices.Contains(acceptedParams, k) || strings.HasPrefix(k, kubernetesParamPrefix)):
			return nil, status.Errorf(codes.InvalidArgument,
				"parameter %q is fixed when a volume is created and cannot be changed; mutable parameters: %s", k, describeMutable())
		case i < 0:
			return nil, status.Errorf(codes.InvalidArgument,
				"mutable parameter %q is not known; mutable parameters: %s", k, describeMutable())
		}
		m := mutableParams[i]
		if m.backend != b {
			return nil, status.Errorf(codes.InvalidArgument,
				"mutable parameter %q applies to %s volumes, and this is a %s volume; its mutable parameters: %s",
				k, m.backend, b, mutableOf(b))
		}
		v, ok := m.parse(in[k])
		if !ok {
			return nil, status.Errorf(codes.InvalidArgument,
				"mutable parameter %s=%q is not accepted; accepted values: %s", k, in[k], m.accepts)
		}
		out[k] = v
	}
	return out, nil
}

// mutableOf lists the mutable keys of backend b.
func mutableOf(b accessmode.Backend) string {
	var out []string
	for _, m := range mutableParams {
		if m.backend == b {
			out = append(out, m.key)
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}

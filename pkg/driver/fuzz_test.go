package driver

import (
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/test/testfiles"
)

// FuzzParseParams: ParseParams either refuses with InvalidArgument and the
// zero Params, or returns values from the documented sets, each taken from
// the key that names it, and every key it let through is a documented one
// or Kubernetes' own.
func FuzzParseParams(f *testing.F) {
	for _, s := range [][6]string{
		{"backend", "block", "fsType", "xfs", "rootSquash", "false"},
		{"backend", "auto", "csi.storage.k8s.io/fstype", "ext4", "csi.storage.k8s.io/pvc/name", "data-0"},
		{"fsType", "xfs", "csi.storage.k8s.io/fstype", "ext4", "", ""},
		{"backend", "Block", "fsType", "EXT4", "rootSquash", "maybe"},
		{"rootSquash", "1", "csi.storage.k8s.io/fstype", "", "Backend", "nfs"},
		{"csi.storage.k8s.io", "x", "csi.storage.k8s.io.evil/x", "x", "backend", "nfs"},
		{"backend", "nfs\x00", "fsType", "ext4\n", "rootSquash", " true"},
	} {
		f.Add(s[0], s[1], s[2], s[3], s[4], s[5])
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2, k3, v3 string) {
		in := map[string]string{k1: v1, k2: v2, k3: v3}
		p, err := ParseParams(in)
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("ParseParams(%q): code %v, want InvalidArgument (%v)", in, status.Code(err), err)
			}
			if p != (Params{}) {
				t.Fatalf("ParseParams(%q) failed (%v) but returned %+v", in, err, p)
			}
			return
		}
		if again, err := ParseParams(in); err != nil || again != p {
			t.Fatalf("ParseParams(%q) = %+v, then %+v, %v", in, p, again, err)
		}
		if !slices.Contains([]string{"block", "nfs", BackendAuto}, p.Backend) {
			t.Fatalf("ParseParams(%q): backend %q", in, p.Backend)
		}
		if p.FsType != "" && !slices.Contains(backend.FsTypes, p.FsType) {
			t.Fatalf("ParseParams(%q): fsType %q", in, p.FsType)
		}
		for k := range in {
			if !slices.Contains(acceptedParams, k) && !strings.HasPrefix(k, kubernetesParamPrefix) {
				t.Fatalf("ParseParams(%q) accepted the key %q", in, k)
			}
		}
		wantBackend := BackendAuto
		if v, ok := in[ParamBackend]; ok {
			wantBackend = v
		}
		wantSquash := true
		if v, ok := in[ParamRootSquash]; ok {
			wantSquash, _ = strconv.ParseBool(v)
		}
		wantFs := in[ParamFsType]
		if wantFs == "" {
			wantFs = in[kubernetesParamPrefix+"fstype"]
		}
		if want := (Params{Backend: wantBackend, FsType: wantFs, RootSquash: wantSquash}); p != want {
			t.Fatalf("ParseParams(%q) = %+v, want %+v", in, p, want)
		}
	})
}

// unsafeFlag reports whether a mount flag holds what parseCapability
// refuses: a double quote or a control character.
func unsafeFlag(f string) bool {
	if selinuxLabel.MatchString(f) {
		return false // the one quoted form: an SELinux context the kubelet passes
	}
	return strings.ContainsFunc(f, func(r rune) bool { return r == '"' || r < 0x20 || r == 0x7f })
}

// selinuxLabel is written here again rather than taken from the driver: the
// fuzzer checks the rule, it does not borrow it.
var selinuxLabel = regexp.MustCompile(`^(context|fscontext|defcontext|rootcontext)="[A-Za-z0-9_.:,-]+"$`)

// FuzzParseCapability: a capability parseCapability accepts has a defined
// mode and a filesystem from the supported set, and its mount flags are
// such that mount(8) splits them, and the options the node backends put
// after them ("ro" last of all on a read-only stage), exactly where the
// driver does: no flag can hide or inject another option. Flags never hold
// a double quote (but in the one form of an SELinux context with a quoted
// label), NUL, a line break or another control character, and a
// capability is refused for nothing else.
func FuzzParseCapability(f *testing.F) {
	f.Add(int32(accessmode.SingleNodeWriter), false, "ext4", uint8(1), "noatime", "", "")
	f.Add(int32(accessmode.MultiNodeReaderOnly), false, "", uint8(3), "vers=4.1", "soft,timeo=100", "rw")
	f.Add(int32(accessmode.MultiNodeMultiWriter), true, "", uint8(0), "", "", "")
	f.Add(int32(accessmode.SingleNodeReaderOnly), false, "btrfs", uint8(1), "noatime", "", "")
	f.Add(int32(0), false, "ext4", uint8(0), "", "", "")
	f.Add(int32(8), true, "", uint8(0), "", "", "")
	f.Add(int32(accessmode.SingleNodeReaderOnly), false, "xfs", uint8(2), "noatime\x00", "nodev\nrw", "")
	f.Fuzz(func(t *testing.T, mode int32, block bool, fsType string, n uint8, f1, f2, f3 string) {
		flags := []string{f1, f2, f3}[:n%4]
		c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: accessmode.Mode(mode)}}
		if block {
			c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		} else {
			c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: flags}}
		}
		at, fs, m, err := parseCapability(c)
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("parseCapability(%v): code %v, want InvalidArgument (%v)", c, status.Code(err), err)
			}
			fsOK := block || fsType == "" || slices.Contains(backend.FsTypes, fsType)
			if accessmode.Valid(accessmode.Mode(mode)) && fsOK && (block || !slices.ContainsFunc(flags, unsafeFlag)) {
				t.Fatalf("parseCapability(%v) refused a good capability: %v", c, err)
			}
			return
		}
		if m != accessmode.Mode(mode) || !accessmode.Valid(m) {
			t.Fatalf("parseCapability(%v): mode %v", c, m)
		}
		if block {
			if at != accessmode.Block || fs != "" {
				t.Fatalf("parseCapability(%v) = %s, %q", c, at, fs)
			}
			return
		}
		if at != accessmode.Mount || fs != fsType || (fs != "" && !slices.Contains(backend.FsTypes, fs)) {
			t.Fatalf("parseCapability(%v) = %s, %q", c, at, fs)
		}
		for _, fl := range flags {
			if unsafeFlag(fl) {
				t.Fatalf("parseCapability accepted the mount flag %q", fl)
			}
		}
		optstr := strings.Join(append(slices.Clone(flags), "ro"), ",")
		got, ok := testfiles.MountSplit(optstr)
		if !ok || len(got) == 0 || got[len(got)-1] != "ro" || strings.Join(got[:len(got)-1], ",") != strings.Join(flags, ",") {
			t.Fatalf("parseCapability accepted the mount flags %q, which mount(8) reads as %q: the appended ro is not an option of its own", flags, got)
		}
	})
}

// FuzzParseMutableParams: ParseMutableParams either refuses with
// InvalidArgument and nothing, or returns exactly the keys it was given,
// each a mutable key of the volume's own backend, with a canonical value
// that parses again to itself: rootSquash "true" or "false", readAheadKiB
// a decimal within its bound that says the same number.
func FuzzParseMutableParams(f *testing.F) {
	for _, s := range [][5]string{
		{"block", "readAheadKiB", "512", "", ""},
		{"nfs", "rootSquash", "FALSE", "", ""},
		{"block", "readAheadKiB", "016384", "rootSquash", "true"},
		{"nfs", "rootSquash", "t", "backend", "block"},
		{"block", "readAheadKiB", "16385", "csi.storage.k8s.io/pvc/name", "x"},
		{"nfs", "XXX_FakeKey", "XXX_FakeValue", "readAheadKiB", "+1"},
		{"block", "readAheadKiB", " 1", "readAheadKiB\x00", "1"},
	} {
		f.Add(s[0] == "nfs", s[1], s[2], s[3], s[4])
	}
	f.Fuzz(func(t *testing.T, nfs bool, k1, v1, k2, v2 string) {
		b := accessmode.BackendBlock
		if nfs {
			b = accessmode.BackendNFS
		}
		in := map[string]string{k1: v1, k2: v2}
		got, err := ParseMutableParams(b, in)
		if err != nil {
			if status.Code(err) != codes.InvalidArgument || got != nil {
				t.Fatalf("ParseMutableParams(%s, %q) = %v, %v; want nothing and InvalidArgument", b, in, got, err)
			}
			return
		}
		if len(got) != len(in) {
			t.Fatalf("ParseMutableParams(%s, %q) = %v: not the keys it was given", b, in, got)
		}
		for k, v := range got {
			if _, given := in[k]; !given {
				t.Fatalf("ParseMutableParams(%s, %q) made up the key %q", b, in, k)
			}
			switch {
			case b == accessmode.BackendNFS && k == backend.AttrRootSquash:
				want, perr := strconv.ParseBool(in[k])
				if perr != nil || v != strconv.FormatBool(want) {
					t.Fatalf("rootSquash %q became %q", in[k], v)
				}
			case b == accessmode.BackendBlock && k == backend.AttrReadAheadKiB:
				n, perr := strconv.ParseUint(v, 10, 64)
				orig, oerr := strconv.ParseUint(in[k], 10, 64)
				if perr != nil || oerr != nil || n != orig || n > 16384 || strconv.FormatUint(n, 10) != v {
					t.Fatalf("readAheadKiB %q became %q", in[k], v)
				}
			default:
				t.Fatalf("ParseMutableParams accepted %q for a %s volume", k, b)
			}
		}
		if again, err := ParseMutableParams(b, got); err != nil || !maps.Equal(again, got) {
			t.Fatalf("the canonical form %v parses to %v, %v", got, again, err)
		}
	})
}

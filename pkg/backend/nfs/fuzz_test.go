package nfs

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/test/testfiles"
)

func optionKey(o string) string {
	k, _, _ := strings.Cut(o, "=")
	return k
}

// FuzzMountOptions: for mount flags the driver lets through
// (backend.CheckMountFlags) and the server and client addresses Stage
// passes, mount(8) and mount.nfs read exactly the options the driver
// built: the CO's, unchanged and first, then only options the CO left
// unset, so that every default, port, addr and clientaddr is set, by the
// CO or by the driver, never by both. A read-only stage has "ro" and no
// "rw", whatever the flags say.
func FuzzMountOptions(f *testing.F) {
	f.Add(uint8(0), "", "", "", uint16(2049), false, "10.99.0.1", "10.0.0.11")
	f.Add(uint8(2), "vers=4.1", "noatime", "", uint16(2049), false, "10.99.0.1", "")
	f.Add(uint8(1), "soft,timeo=100", "", "", uint16(20490), false, "fd00::1", "fd00::11")
	f.Add(uint8(1), `context="system_u:object_r:container_file_t:s0:c1,c2"`, "", "", uint16(2049), true, "10.99.0.1", "10.0.0.11")
	f.Add(uint8(1), "rw", "", "", uint16(2049), true, "10.99.0.1", "10.0.0.11")
	f.Add(uint8(3), "ro,rw", ",,", "nfsvers=4.0,addr=10.0.0.2", uint16(1), true, "::ffff:10.99.0.1", "")
	f.Add(uint8(1), "x-a=\"b,ro,c\"", "", "", uint16(2049), true, "10.99.0.1", "10.0.0.11")
	f.Add(uint8(1), "clientaddr=10.0.0.99,port=1", "", "", uint16(2050), false, "10.99.0.1", "10.0.0.11")
	f.Add(uint8(2), "ro", "defaults", "", uint16(2049), true, "10.99.0.1", "10.0.0.11")
	f.Fuzz(func(t *testing.T, n uint8, f1, f2, f3 string, port uint16, readOnly bool, server, client string) {
		flags := []string{f1, f2, f3}[:n%4]
		if backend.CheckMountFlags(flags) != nil || port == 0 {
			return
		}
		if a, err := netip.ParseAddr(server); server != "" && (err != nil || a.Zone() != "") {
			return
		}
		if a, err := netip.ParseAddr(client); client != "" && (err != nil || a.Zone() != "" || a.String() != client) {
			return
		}
		opts := mountOptions(flags, int(port), readOnly, server, client)
		optstr := strings.Join(opts, ",")
		if seen, ok := testfiles.MountSplit(optstr); !ok || !slices.Equal(seen, opts) {
			t.Fatalf("mountOptions(%q) = %q, which mount(8) reads as %q", flags, opts, seen)
		}
		var co []string
		set := map[string]bool{}
		for _, o := range backend.SplitMountOptions(strings.Join(flags, ",")) {
			if o != "" && o != "rw" {
				co = append(co, o)
				set[optionKey(o)] = true
			}
		}
		if set["nfsvers"] {
			set["vers"] = true
		}
		if len(opts) < len(co) || !slices.Equal(opts[:len(co)], co) {
			t.Fatalf("mountOptions(%q) = %q: the CO's options are not first and unchanged", flags, opts)
		}
		for _, o := range opts[len(co):] {
			if set[optionKey(o)] && o != "ro" {
				t.Fatalf("mountOptions(%q) = %q: %q overrides the CO's option", flags, opts, o)
			}
		}
		have := map[string]bool{}
		for _, o := range opts {
			have[optionKey(o)] = true
		}
		if have["nfsvers"] {
			have["vers"] = true
		}
		want := []string{}
		for _, d := range DefaultMountOptions {
			want = append(want, optionKey(d))
		}
		if port != 2049 {
			want = append(want, "port")
		}
		if server != "" {
			want = append(want, "addr")
		}
		if client != "" {
			want = append(want, "clientaddr")
		}
		for _, k := range want {
			if !have[k] {
				t.Fatalf("mountOptions(%q, %d, %t, %q, %q) = %q: no %s", flags, port, readOnly, server, client, opts, k)
			}
		}
		if !readOnly && slices.Contains(opts, "ro") && !slices.Contains(co, "ro") {
			t.Fatalf("read/write mount options %q have a \"ro\" the CO did not ask for", optstr)
		}
		if readOnly && (opts[len(opts)-1] != "ro" || slices.Contains(opts, "rw")) {
			t.Fatalf("read-only mount options %q", optstr)
		}
	})
}

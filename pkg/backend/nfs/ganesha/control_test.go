package ganesha

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// client builds a DisplayExport client entry as ganesha 4.3 sends it.
func client(match string, options uint32) []any {
	return []any{match, int32(0), byte(0), byte(255), int32(1), uint32(4294967294), uint32(4294967294), uint32(0), options, uint32(480)}
}

func TestParseDisplayExport(t *testing.T) {
	// Option words captured from ganesha 4.3 for CLIENT blocks with
	// Access_Type = RW / RO under root_squash, and RO with no_root_squash.
	const rw, ro, roNoSquash = 53490146, 53489826, 53489824
	body := []any{uint16(17), "/srv/v/pvc-17", "/pvc-17", "", [][]any{
		client("10.99.0.12/32", ro),
		client("10.99.0.11/32", rw),
		client("fd00::1/128", roNoSquash),
	}}
	info, err := parseDisplayExport(body)
	if err != nil {
		t.Fatal(err)
	}
	if info.ID != 17 || info.Path != "/srv/v/pvc-17" || info.Pseudo != "/pvc-17" {
		t.Errorf("info %+v", info)
	}
	want := []ClientInfo{
		{Match: "10.99.0.12/32", Address: netip.MustParseAddr("10.99.0.12"), Access: "RO", Squash: RootSquash},
		{Match: "10.99.0.11/32", Address: netip.MustParseAddr("10.99.0.11"), Access: "RW", Squash: RootSquash},
		{Match: "fd00::1/128", Address: netip.MustParseAddr("fd00::1"), Access: "RO", Squash: NoRootSquash},
	}
	if !slices.Equal(info.Clients, want) {
		t.Errorf("clients %+v, want %+v", info.Clients, want)
	}
	rules, ok := info.Rules()
	wantRules := []ClientRule{
		{Address: netip.MustParseAddr("10.99.0.11")},
		{Address: netip.MustParseAddr("10.99.0.12"), ReadOnly: true},
		{Address: netip.MustParseAddr("fd00::1"), ReadOnly: true},
	}
	if !ok || !slices.Equal(rules, wantRules) {
		t.Errorf("Rules() = %+v, %v", rules, ok)
	}
}

func TestRulesRefusesWhatAClientRuleCannotSay(t *testing.T) {
	for _, c := range []ClientInfo{
		{Match: "*", Access: "RW"},
		{Match: "10.0.0.0/24", Access: "RO"},
		{Match: "10.0.0.1/32", Address: netip.MustParseAddr("10.0.0.1"), Access: "None"},
		{Match: "10.0.0.1/32", Address: netip.MustParseAddr("10.0.0.1"), Access: "MDONLY"},
	} {
		if r, ok := (ExportInfo{Clients: []ClientInfo{c}}).Rules(); ok {
			t.Errorf("Rules accepted %+v: %+v", c, r)
		}
	}
}

func TestParseClientAccessAndSquash(t *testing.T) {
	tests := []struct {
		options uint32
		access  string
		squash  Squash
	}{
		{optReadAccess | optWriteAccess | optMDReadAccess | optMDWrite | optRootSquash, "RW", RootSquash},
		{optReadAccess | optMDReadAccess | optRootSquash, "RO", RootSquash},
		{optMDReadAccess | optMDWrite, "MDONLY", NoRootSquash},
		{optMDReadAccess, "MDONLY_RO", NoRootSquash},
		{0, "None", NoRootSquash},
		{optReadAccess | optAllAnonymous, "RO", "all_squash"},
		{optReadAccess | optRootIDSquash, "RO", "root_id_squash"},
	}
	for _, tc := range tests {
		ci, err := parseClient(client("10.0.0.0/24", tc.options))
		if err != nil {
			t.Fatal(err)
		}
		if ci.Access != tc.access || ci.Squash != tc.squash {
			t.Errorf("options %#x: %s %s, want %s %s", tc.options, ci.Access, ci.Squash, tc.access, tc.squash)
		}
		if ci.Address.IsValid() {
			t.Errorf("a /24 was read as a single address")
		}
	}
	ci, _ := parseClient(client("*", 0))
	if ci.Address.IsValid() || ci.Match != "*" {
		t.Errorf("wildcard read as %+v", ci)
	}
}

func TestParseRejectsMalformedReplies(t *testing.T) {
	bad := [][]any{
		nil,
		{uint16(1), "/a", "/b", ""},
		{"1", "/a", "/b", "", [][]any{}},
		{uint16(1), "/a", "/b", "", [][]any{{"10.0.0.1/32"}}},
		{uint16(1), "/a", "/b", "", [][]any{{int32(1), 1, 2, 3, 4, 5, 6, 7, 8, 9}}},
	}
	for i, b := range bad {
		if _, err := parseDisplayExport(b); err == nil {
			t.Errorf("case %d accepted", i)
		}
	}
}

func TestErrorClassification(t *testing.T) {
	notFound := &Error{Method: "RemoveExport", Name: "org.freedesktop.DBus.Error.InvalidArgs", Message: "lookup_export failed with Export id not found"}
	notRunning := &Error{Method: "ShowExports", Name: "org.freedesktop.DBus.Error.ServiceUnknown", Message: "The name org.ganesha.nfsd was not provided by any .service files"}
	parse := &Error{Method: "AddExport", Name: "org.freedesktop.DBus.Error.InvalidFileContent", Message: "0 export entries in /x added because (block validation) errors.\n"}
	wrapped := fmt.Errorf("removing: %w", notFound)
	if !IsNotFound(notFound) || !IsNotFound(wrapped) || IsNotFound(notRunning) || IsNotFound(parse) || IsNotFound(errors.New("export id not found")) {
		t.Errorf("IsNotFound misclassifies")
	}
	if !IsNotRunning(notRunning) || IsNotRunning(notFound) || IsNotRunning(nil) {
		t.Errorf("IsNotRunning misclassifies")
	}
	if got := parse.Error(); !strings.Contains(got, "AddExport") || !strings.Contains(got, "block validation") || strings.Contains(got, "\n [") {
		t.Errorf("Error() = %q", got)
	}
}

func TestServerConfigRendering(t *testing.T) {
	cfg, err := ServerConfig{Dir: "/run/mg", ExportDir: "/var/lib/mg/exports", Port: 20490, ListenAddress: "10.99.0.1",
		GaneshaBinary: "/bin/true", DBusBinary: "/bin/true"}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	conf := string(cfg.ganeshaConf())
	for _, want := range []string{
		"\tProtocols = 4;\n", "\tNFS_Port = 20490;\n", "\tBind_addr = 10.99.0.1;\n", "\tEnable_NLM = false;\n",
		"\tGraceless = false;\n", "\tLease_Lifetime = 20;\n", "\tGrace_Period = 30;\n",
		"\tRecoveryBackend = fs;\n", "\tRecoveryRoot = \"/run/mg/recovery\";\n",
		"\tOnly_Numeric_Owners = true;\n", "\tActive_krb5 = false;\n", "\tMount_Path_Pseudo = true;\n",
		"%dir \"/var/lib/mg/exports\"\n",
	} {
		if !strings.Contains(conf, want) {
			t.Errorf("ganesha.conf lacks %q:\n%s", want, conf)
		}
	}
	bus := string(cfg.busConf())
	for _, want := range []string{"<type>system</type>", "<listen>unix:path=/run/mg/bus.sock</listen>", "<auth>EXTERNAL</auth>", `<allow own="org.ganesha.nfsd"/>`} {
		if !strings.Contains(bus, want) {
			t.Errorf("bus.conf lacks %q", want)
		}
	}
}

func TestServerConfigRefusesBadValues(t *testing.T) {
	for _, cfg := range []ServerConfig{
		{},
		{Dir: `/run/m"g`},
		{Dir: "/run/mg", ExportDir: "/var/lib/a b"},
		{Dir: "/run/mg", Port: 70000},
		{Dir: "/run/mg", ListenAddress: "example.org"},
		{Dir: "/run/mg", ListenAddress: "fe80::1%eth0"},
		{Dir: "/run/mg", LogLevel: "NIV_EVENT; x"},
		{Dir: "/run/mg", GaneshaBinary: "/nonexistent/ganesha.nfsd"},
		{Dir: "/run/mg", NetNSPath: "/nonexistent/netns"},
		{Dir: "/" + strings.Repeat("d", 120)},
		{Dir: "/run/mg", LeaseLifetime: 1500 * time.Millisecond},
		{Dir: "/run/mg", LeaseLifetime: 30 * time.Second, GracePeriod: 20 * time.Second},
		{Dir: "/run/mg", GracePeriod: 10 * time.Second}, // shorter than the default lease
		{Dir: "/run/mg", GracePeriod: 181 * time.Second},
		{Dir: "/run/mg", LeaseLifetime: -time.Second},
	} {
		// Present binaries, so that only the value under test is wrong.
		if cfg.GaneshaBinary == "" {
			cfg.GaneshaBinary = "/bin/true"
		}
		cfg.DBusBinary = "/bin/true"
		if _, err := cfg.withDefaults(); err == nil {
			t.Errorf("accepted %+v", cfg)
		}
	}
}

func TestExportPathInFile(t *testing.T) {
	dir := t.TempDir()
	p := ExportFilePath(dir, 4)
	e := Export{ID: 4, Path: "/srv/a/Path_x", Pseudo: "/p", Comment: "Path x EXPORT"}
	if err := WriteExportFile(p, e); err != nil {
		t.Fatal(err)
	}
	if got, ok := exportPathInFile(p); !ok || got != e.Path {
		t.Errorf("exportPathInFile = %q, %v", got, ok)
	}
	data, _ := e.Render()
	two := filepath.Join(dir, "two.conf")
	if err := os.WriteFile(two, append(data, data...), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := exportPathInFile(two); ok {
		t.Errorf("a file with two exports was read as one")
	}
	if _, ok := exportPathInFile(filepath.Join(dir, "missing.conf")); ok {
		t.Errorf("a missing file was read")
	}
}

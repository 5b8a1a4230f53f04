package ganesha

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestRenderTypical(t *testing.T) {
	e := Export{
		ID:     42,
		Path:   "/srv/modeguard/volumes/pvc-1234",
		Pseudo: "/pvc-1234",
		Clients: []ClientRule{
			{Address: mustAddr("10.99.0.12"), ReadOnly: true},
			{Address: mustAddr("fd00:99::11")},
			{Address: mustAddr("10.99.0.11")},
		},
		Comment: "modeguard volume pvc-1234",
	}
	want := `# modeguard volume pvc-1234
EXPORT {
	Export_Id = 42;
	Path = "/srv/modeguard/volumes/pvc-1234";
	Pseudo = "/pvc-1234";
	Access_Type = None;
	Squash = root_squash;
	Protocols = 4;
	Transports = TCP;
	SecType = sys;
	FSAL {
		Name = VFS;
	}
	CLIENT {
		Clients = 10.99.0.11;
		Access_Type = RW;
		Squash = root_squash;
		Protocols = 4;
	}
	CLIENT {
		Clients = 10.99.0.12;
		Access_Type = RO;
		Squash = root_squash;
		Protocols = 4;
	}
	CLIENT {
		Clients = fd00:99::11;
		Access_Type = RW;
		Squash = root_squash;
		Protocols = 4;
	}
}
`
	got, err := e.Render()
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Errorf("Render:\n%s\nwant:\n%s", got, want)
	}
	checkStructure(t, e, got)
}

func TestRenderVariants(t *testing.T) {
	tests := []struct {
		name string
		e    Export
		want []string // lines that must appear
		not  []string // substrings that must not appear
	}{
		{
			name: "no clients grants nobody",
			e:    Export{ID: 1, Path: "/d", Pseudo: "/p"},
			want: []string{"\tAccess_Type = None;", "\tSquash = root_squash;"},
			not:  []string{"CLIENT", "#"},
		},
		{
			name: "no_root_squash reaches export and clients",
			e: Export{ID: 65535, Path: "/d", Pseudo: "/p", Squash: NoRootSquash,
				Clients: []ClientRule{{Address: mustAddr("192.0.2.1")}}},
			want: []string{"\tExport_Id = 65535;", "\tSquash = no_root_squash;", "\t\tSquash = no_root_squash;"},
			not:  []string{"Squash = root_squash"},
		},
		{
			name: "paths with allowed punctuation",
			e:    Export{ID: 7, Path: "/a_b/c-d/e.f/g:h", Pseudo: "/x.y/z_1"},
			want: []string{"\tPath = \"/a_b/c-d/e.f/g:h\";", "\tPseudo = \"/x.y/z_1\";"},
		},
		{
			name: "ipv6 written unquoted in canonical form",
			e: Export{ID: 3, Path: "/d", Pseudo: "/p",
				Clients: []ClientRule{{Address: mustAddr("2001:0db8:0000:0000:0000:0000:0000:0001"), ReadOnly: true}}},
			want: []string{"\t\tClients = 2001:db8::1;", "\t\tAccess_Type = RO;"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.e.Render()
			if err != nil {
				t.Fatal(err)
			}
			lines := strings.Split(string(got), "\n")
			for _, w := range tc.want {
				found := false
				for _, l := range lines {
					if l == w {
						found = true
					}
				}
				if !found {
					t.Errorf("missing line %q in:\n%s", w, got)
				}
			}
			for _, n := range tc.not {
				if n != "" && strings.Contains(string(got), n) {
					t.Errorf("unexpected %q in:\n%s", n, got)
				}
			}
			checkStructure(t, tc.e, got)
		})
	}
}

func TestRenderRefusesHostileValues(t *testing.T) {
	ok := Export{ID: 1, Path: "/data/vol1", Pseudo: "/vol1", Clients: []ClientRule{{Address: mustAddr("10.0.0.1")}}}
	with := func(f func(*Export)) Export {
		e := ok
		e.Clients = append([]ClientRule(nil), ok.Clients...)
		f(&e)
		return e
	}
	tests := []struct {
		name string
		e    Export
	}{
		{"id 0", with(func(e *Export) { e.ID = 0 })},
		{"empty path", with(func(e *Export) { e.Path = "" })},
		{"relative path", with(func(e *Export) { e.Path = "data/vol1" })},
		{"root path", with(func(e *Export) { e.Path = "/" })},
		{"dotdot path", with(func(e *Export) { e.Path = "/data/../etc" })},
		{"dotdot in name", with(func(e *Export) { e.Path = "/data/a..b" })},
		{"dot element", with(func(e *Export) { e.Path = "/data/./vol1" })},
		{"double slash", with(func(e *Export) { e.Path = "/data//vol1" })},
		{"trailing slash", with(func(e *Export) { e.Path = "/data/vol1/" })},
		{"quote in path", with(func(e *Export) { e.Path = `/data/vol1"; Access_Type = RW; x="` })},
		{"brace in path", with(func(e *Export) { e.Path = "/data/}EXPORT{" })},
		{"semicolon in path", with(func(e *Export) { e.Path = "/data/a;b" })},
		{"newline in path", with(func(e *Export) { e.Path = "/data/a\nCLIENT" })},
		{"space in path", with(func(e *Export) { e.Path = "/data/a b" })},
		{"hash in path", with(func(e *Export) { e.Path = "/data/a#b" })},
		{"backslash in path", with(func(e *Export) { e.Path = `/data/a\"` })},
		{"nul in path", with(func(e *Export) { e.Path = "/data/a\x00" })},
		{"unicode in path", with(func(e *Export) { e.Path = "/data/völ" })},
		{"long path", with(func(e *Export) { e.Path = "/" + strings.Repeat("a", MaxPathLen) })},
		{"empty pseudo", with(func(e *Export) { e.Pseudo = "" })},
		{"root pseudo", with(func(e *Export) { e.Pseudo = "/" })},
		{"relative pseudo", with(func(e *Export) { e.Pseudo = "vol1" })},
		{"dotdot pseudo", with(func(e *Export) { e.Pseudo = "/.." })},
		{"quote in pseudo", with(func(e *Export) { e.Pseudo = `/v"` })},
		{"brace in pseudo", with(func(e *Export) { e.Pseudo = "/v{" })},
		{"newline in comment", with(func(e *Export) { e.Comment = "x\nEXPORT { Export_Id = 2; }" })},
		{"carriage return in comment", with(func(e *Export) { e.Comment = "x\rEXPORT" })},
		{"brace in comment", with(func(e *Export) { e.Comment = "a}" })},
		{"semicolon in comment", with(func(e *Export) { e.Comment = "a;" })},
		{"quote in comment", with(func(e *Export) { e.Comment = `a"` })},
		{"long comment", with(func(e *Export) { e.Comment = strings.Repeat("a", MaxCommentLen+1) })},
		{"unknown squash", with(func(e *Export) { e.Squash = "all_squash" })},
		{"injected squash", with(func(e *Export) { e.Squash = "root_squash; Access_Type = RW" })},
		{"zero client", with(func(e *Export) { e.Clients = append(e.Clients, ClientRule{}) })},
		{"unspecified v4 client", with(func(e *Export) { e.Clients = []ClientRule{{Address: mustAddr("0.0.0.0")}} })},
		{"unspecified v6 client", with(func(e *Export) { e.Clients = []ClientRule{{Address: mustAddr("::")}} })},
		{"zoned client", with(func(e *Export) { e.Clients = []ClientRule{{Address: mustAddr("fe80::1%eth0")}} })},
		{"mapped client", with(func(e *Export) { e.Clients = []ClientRule{{Address: mustAddr("::ffff:10.0.0.1")}} })},
		{"duplicate client", with(func(e *Export) {
			e.Clients = []ClientRule{{Address: mustAddr("10.0.0.1")}, {Address: mustAddr("10.0.0.1"), ReadOnly: true}}
		})},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, err := tc.e.Render()
			if err == nil {
				t.Fatalf("Render accepted %+v:\n%s", tc.e, out)
			}
			if !errors.Is(err, ErrInvalidExport) {
				t.Errorf("error %v does not wrap ErrInvalidExport", err)
			}
			if out != nil {
				t.Errorf("Render returned output with an error")
			}
			path := filepath.Join(t.TempDir(), "x.conf")
			if err := WriteExportFile(path, tc.e); err == nil {
				t.Errorf("WriteExportFile accepted it")
			}
			if _, err := os.Stat(path); !os.IsNotExist(err) {
				t.Errorf("WriteExportFile left a file: %v", err)
			}
		})
	}
}

func TestRenderDeterministicClientOrder(t *testing.T) {
	a := []ClientRule{
		{Address: mustAddr("10.0.0.2"), ReadOnly: true},
		{Address: mustAddr("fd00::1")},
		{Address: mustAddr("10.0.0.10")},
		{Address: mustAddr("10.0.0.1")},
		{Address: mustAddr("::1"), ReadOnly: true},
	}
	first, err := Export{ID: 9, Path: "/d", Pseudo: "/p", Clients: a}.Render()
	if err != nil {
		t.Fatal(err)
	}
	// Every rotation and the reverse render the same bytes.
	for r := range a {
		perm := append(append([]ClientRule(nil), a[r:]...), a[:r]...)
		got, _ := Export{ID: 9, Path: "/d", Pseudo: "/p", Clients: perm}.Render()
		if string(got) != string(first) {
			t.Fatalf("rotation %d renders differently:\n%s\nvs\n%s", r, got, first)
		}
	}
	rev := make([]ClientRule, len(a))
	for i := range a {
		rev[len(a)-1-i] = a[i]
	}
	got, _ := Export{ID: 9, Path: "/d", Pseudo: "/p", Clients: rev}.Render()
	if string(got) != string(first) {
		t.Fatalf("reverse renders differently")
	}
	// Numeric, not lexical, order; IPv4 before IPv6.
	var order []string
	for _, l := range strings.Split(string(first), "\n") {
		if v, ok := strings.CutPrefix(l, "\t\tClients = "); ok {
			order = append(order, strings.TrimSuffix(v, ";"))
		}
	}
	want := []string{"10.0.0.1", "10.0.0.2", "10.0.0.10", "::1", "fd00::1"}
	if strings.Join(order, ",") != strings.Join(want, ",") {
		t.Errorf("client order %v, want %v", order, want)
	}
	// The caller's slice is not reordered.
	if a[0].Address != mustAddr("10.0.0.2") {
		t.Errorf("Render sorted the caller's slice")
	}
}

func TestWriteExportFile(t *testing.T) {
	dir := t.TempDir()
	e := Export{ID: 5, Path: "/d", Pseudo: "/p", Clients: []ClientRule{{Address: mustAddr("10.0.0.1")}}}
	path := ExportFilePath(dir, 5)
	if filepath.Base(path) != "export-5.conf" {
		t.Errorf("ExportFilePath = %s", path)
	}
	if err := WriteExportFile(path, e); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", st.Mode().Perm())
	}
	data, _ := os.ReadFile(path)
	want, _ := e.Render()
	if string(data) != string(want) {
		t.Errorf("file content differs from Render")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("directory holds %d entries, want only the export file", len(entries))
	}
	if Expression(5) != "EXPORT(Export_Id=5)" {
		t.Errorf("Expression(5) = %q", Expression(5))
	}
}

// checkStructure asserts the shape every accepted export must have: one
// top-level EXPORT block, balanced braces outside quotes, quotes only around
// the Path and Pseudo values, which are exactly e's, and nothing but single
// addresses as clients.
func checkStructure(t testing.TB, e Export, out []byte) {
	t.Helper()
	if err := structureError(e, out); err != nil {
		t.Fatalf("%v in:\n%s", err, out)
	}
}

func structureError(e Export, out []byte) error {
	s := string(out)
	if strings.ContainsAny(s, "*\r\x00\\") {
		return errors.New("forbidden character in output")
	}
	lines := strings.Split(strings.TrimSuffix(s, "\n"), "\n")
	var body []string
	for i, l := range lines {
		if strings.HasPrefix(l, "#") {
			if i != 0 || e.Comment == "" || l != "# "+e.Comment {
				return errors.New("unexpected comment line")
			}
			continue
		}
		if strings.Contains(l, "#") {
			return errors.New("'#' inside the block")
		}
		body = append(body, l)
	}
	depth, blocks := 0, 0
	var quoted []string
	for _, l := range body {
		// Quotes: none, or exactly two enclosing the value of Path/Pseudo.
		switch n := strings.Count(l, `"`); n {
		case 0:
		case 2:
			open := strings.Index(l, `"`)
			closeq := strings.LastIndex(l, `"`)
			if l[closeq+1:] != ";" {
				return errors.New("text after a quoted value")
			}
			key := strings.TrimSpace(l[:open])
			if key != "Path =" && key != "Pseudo =" {
				return errors.New("quoted value for an unexpected key")
			}
			quoted = append(quoted, l[open+1:closeq])
		default:
			return errors.New("unbalanced quotes")
		}
		for _, r := range l {
			switch r {
			case '{':
				if depth == 0 {
					blocks++
				}
				depth++
			case '}':
				depth--
				if depth < 0 {
					return errors.New("brace closes more than it opened")
				}
			}
		}
		if depth == 0 && l != "}" && !strings.HasPrefix(l, "EXPORT {") {
			return errors.New("text outside the EXPORT block")
		}
		if v, ok := strings.CutPrefix(l, "\t\tClients = "); ok {
			a, err := netip.ParseAddr(strings.TrimSuffix(v, ";"))
			if err != nil || !strings.HasSuffix(v, ";") {
				return errors.New("client is not a single address")
			}
			found := false
			for _, c := range e.Clients {
				if c.Address == a {
					found = true
				}
			}
			if !found {
				return errors.New("client not in the export")
			}
		}
	}
	if depth != 0 || blocks != 1 || body[0] != "EXPORT {" {
		return errors.New("not exactly one EXPORT block")
	}
	if len(quoted) != 2 || quoted[0] != e.Path || quoted[1] != e.Pseudo {
		return errors.New("path or pseudo changed on the way")
	}
	if got := strings.Count(s, "\tCLIENT {"); got != len(e.Clients) {
		return errors.New("CLIENT block count differs from the client count")
	}
	if strings.Count(s, "Access_Type = None;") != 1 {
		return errors.New("export-level Access_Type = None missing")
	}
	return nil
}

package ganesha

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/modeguard/modeguard/pkg/fsutil"
)

// Squash is an export's root squashing.
type Squash string

// The squash values Render accepts.
const (
	RootSquash   Squash = "root_squash" // the default when empty
	NoRootSquash Squash = "no_root_squash"
)

// ClientRule grants one address access to an export.
type ClientRule struct {
	Address  netip.Addr // one IPv4 or IPv6 address, no zone
	ReadOnly bool       // RO when true, RW otherwise
}

// Export is one volume's export.
type Export struct {
	ID      uint16 // 1..65535; 0 is ganesha's pseudo root
	Path    string // the directory exported, absolute
	Pseudo  string // where clients find it in the NFSv4 pseudo file system
	Squash  Squash // RootSquash when empty
	Clients []ClientRule
	Comment string // optional, written as a comment line above the block
}

// Limits on what Render accepts.
const (
	MaxPathLen    = 1024
	MaxCommentLen = 256
	MaxClients    = 1024
)

var (
	pathRe    = regexp.MustCompile(`^/[A-Za-z0-9_./:-]+$`)
	commentRe = regexp.MustCompile(`^[A-Za-z0-9 _.:/-]*$`)
)

// ErrInvalidExport is wrapped by every error Render returns for a value it
// refuses.
var ErrInvalidExport = errors.New("invalid export")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidExport, fmt.Sprintf(format, args...))
}

// checkPath accepts an absolute, clean path made of [A-Za-z0-9_./:-] only,
// without "..", and not "/" itself.
func checkPath(what, p string) error {
	switch {
	case len(p) > MaxPathLen:
		return invalid("%s is longer than %d bytes", what, MaxPathLen)
	case !pathRe.MatchString(p):
		return invalid("%s %q must be absolute and use only [A-Za-z0-9_./:-]", what, p)
	case strings.Contains(p, ".."):
		return invalid("%s %q contains \"..\"", what, p)
	case path.Clean(p) != p:
		return invalid("%s %q is not clean (empty or \".\" elements, or a trailing slash)", what, p)
	}
	return nil
}

// Validate reports whether Render would accept e, and why not.
func (e Export) Validate() error {
	if e.ID == 0 {
		return invalid("export id 0 is ganesha's pseudo root; ids are 1..65535")
	}
	if err := checkPath("path", e.Path); err != nil {
		return err
	}
	if err := checkPath("pseudo path", e.Pseudo); err != nil {
		return err
	}
	switch e.Squash {
	case "", RootSquash, NoRootSquash:
	default:
		return invalid("squash %q is neither %q nor %q", string(e.Squash), RootSquash, NoRootSquash)
	}
	if len(e.Comment) > MaxCommentLen {
		return invalid("comment is longer than %d bytes", MaxCommentLen)
	}
	if !commentRe.MatchString(e.Comment) {
		return invalid("comment %q may use only [A-Za-z0-9 _.:/-]", e.Comment)
	}
	if len(e.Clients) > MaxClients {
		return invalid("more than %d clients", MaxClients)
	}
	seen := make(map[netip.Addr]bool, len(e.Clients))
	for _, c := range e.Clients {
		a := c.Address
		switch {
		case !a.IsValid():
			return invalid("a client has no address")
		case a.Zone() != "":
			return invalid("client %s has a zone", a)
		case a.Is4In6():
			return invalid("client %s is an IPv4-mapped IPv6 address; give the IPv4 address", a)
		case a.IsUnspecified():
			return invalid("client %s is the unspecified address", a)
		case seen[a]:
			return invalid("client %s is listed twice", a)
		}
		seen[a] = true
	}
	return nil
}

// Render returns the export file for e: exactly one EXPORT block that grants
// nothing at export level (Access_Type = None) and one CLIENT block per
// client, sorted by address, with Access_Type = RW or RO. It refuses any
// value that could change the structure of the file (see Validate).
func (e Export) Render() ([]byte, error) {
	if err := e.Validate(); err != nil {
		return nil, err
	}
	squash := e.Squash
	if squash == "" {
		squash = RootSquash
	}
	clients := slices.Clone(e.Clients)
	slices.SortFunc(clients, func(a, b ClientRule) int { return a.Address.Compare(b.Address) })

	var b bytes.Buffer
	if e.Comment != "" {
		b.WriteString("# " + e.Comment + "\n")
	}
	b.WriteString("EXPORT {\n")
	b.WriteString("\tExport_Id = " + strconv.Itoa(int(e.ID)) + ";\n")
	b.WriteString("\tPath = \"" + e.Path + "\";\n")
	b.WriteString("\tPseudo = \"" + e.Pseudo + "\";\n")
	b.WriteString("\tAccess_Type = None;\n")
	b.WriteString("\tSquash = " + string(squash) + ";\n")
	b.WriteString("\tProtocols = 4;\n")
	b.WriteString("\tTransports = TCP;\n")
	b.WriteString("\tSecType = sys;\n")
	b.WriteString("\tFSAL {\n\t\tName = VFS;\n\t}\n")
	for _, c := range clients {
		access := "RW"
		if c.ReadOnly {
			access = "RO"
		}
		b.WriteString("\tCLIENT {\n")
		b.WriteString("\t\tClients = " + c.Address.String() + ";\n")
		b.WriteString("\t\tAccess_Type = " + access + ";\n")
		b.WriteString("\t\tSquash = " + string(squash) + ";\n")
		b.WriteString("\t\tProtocols = 4;\n")
		b.WriteString("\t}\n")
	}
	b.WriteString("}\n")
	return b.Bytes(), nil
}

// WriteExportFile renders e and replaces the file at path with it
// atomically (mode 0600). Nothing is written when Render refuses e.
func WriteExportFile(path string, e Export) error {
	data, err := e.Render()
	if err != nil {
		return err
	}
	return fsutil.WriteFileAtomic(path, data, 0o600)
}

// ExportFileName is a file name for export id, for callers that have no
// naming of their own: "export-<id>.conf".
func ExportFileName(id uint16) string {
	return "export-" + strconv.Itoa(int(id)) + ".conf"
}

// ExportFilePath is filepath.Join(dir, ExportFileName(id)).
func ExportFilePath(dir string, id uint16) string {
	return filepath.Join(dir, ExportFileName(id))
}

// Expression is the selector ganesha's AddExport and UpdateExport take to
// pick the block for id out of a file: "EXPORT(Export_Id=<id>)".
func Expression(id uint16) string {
	return "EXPORT(Export_Id=" + strconv.Itoa(int(id)) + ")"
}

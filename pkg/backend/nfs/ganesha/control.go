package ganesha

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/godbus/dbus/v5"
)

// The D-Bus names ganesha answers on.
const (
	BusName         = "org.ganesha.nfsd"
	ExportMgrPath   = "/org/ganesha/nfsd/ExportMgr"
	ExportMgrIface  = "org.ganesha.nfsd.exportmgr"
	AdminPath       = "/org/ganesha/nfsd/admin"
	AdminIface      = "org.ganesha.nfsd.admin"
	CacheMgrPath    = "/org/ganesha/nfsd/CacheMgr"
	CacheMgrIface   = "org.ganesha.nfsd.cachemgr"
	defaultCallWait = 30 * time.Second
)

// ErrClosed is returned by a Control after Close.
var ErrClosed = errors.New("ganesha: control closed")

// Error is an error ganesha (or the bus, on its behalf) returned for a call.
type Error struct {
	Method  string // e.g. "AddExport"
	Name    string // the D-Bus error name, e.g. org.freedesktop.DBus.Error.InvalidArgs
	Message string // ganesha's own message
}

func (e *Error) Error() string {
	msg := strings.TrimRight(e.Message, "\n")
	if msg == "" {
		msg = "(no message)"
	}
	return "ganesha " + e.Method + ": " + msg + " [" + e.Name + "]"
}

// IsNotFound reports whether err is ganesha saying that the export id it
// was asked about does not exist (RemoveExport, DisplayExport).
func IsNotFound(err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return false
	}
	return e.Name == "org.freedesktop.DBus.Error.InvalidArgs" &&
		strings.Contains(strings.ToLower(e.Message), "export id not found")
}

// IsNotRunning reports whether err means that no ganesha owns its name on
// the bus: it is not running, still starting, or restarting.
func IsNotRunning(err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return false
	}
	return e.Name == "org.freedesktop.DBus.Error.ServiceUnknown" ||
		e.Name == "org.freedesktop.DBus.Error.NameHasNoOwner"
}

// Control drives a running ganesha over D-Bus. It is safe for concurrent
// use. When the connection to the bus breaks (the bus restarted), the next
// call dials again.
type Control struct {
	address string

	mu     sync.Mutex
	conn   *dbus.Conn
	closed bool
}

// Dial connects to the bus at address (a D-Bus address such as
// "unix:path=/run/x/bus.sock") on a private connection, authenticates
// and says Hello. It does not require ganesha to be running yet.
func Dial(address string) (*Control, error) {
	if address == "" {
		return nil, errors.New("ganesha: empty D-Bus address")
	}
	c := &Control{address: address}
	conn, err := dial(address)
	if err != nil {
		return nil, err
	}
	c.conn = conn
	return c, nil
}

func dial(address string) (*dbus.Conn, error) {
	conn, err := dbus.Dial(address)
	if err != nil {
		return nil, fmt.Errorf("ganesha: dialing D-Bus %s: %w", address, err)
	}
	if err := conn.Auth(nil); err != nil {
		conn.Close()
		return nil, fmt.Errorf("ganesha: authenticating to D-Bus %s: %w", address, err)
	}
	if err := conn.Hello(); err != nil {
		conn.Close()
		return nil, fmt.Errorf("ganesha: Hello on D-Bus %s: %w", address, err)
	}
	return conn, nil
}

// Address is the D-Bus address the Control dials.
func (c *Control) Address() string { return c.address }

// Close closes the connection. Calls after Close return ErrClosed.
func (c *Control) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if c.conn != nil {
		err := c.conn.Close()
		c.conn = nil
		return err
	}
	return nil
}

// connection returns a live connection, dialing again if the last one broke.
func (c *Control) connection() (*dbus.Conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	if c.conn != nil && c.conn.Connected() {
		return c.conn, nil
	}
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
	conn, err := dial(c.address)
	if err != nil {
		return nil, err
	}
	c.conn = conn
	return conn, nil
}

// drop forgets conn if it is still the current connection.
func (c *Control) drop(conn *dbus.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == conn {
		c.conn.Close()
		c.conn = nil
	}
}

// call invokes an ExportMgr method and returns the reply body.
func (c *Control) call(ctx context.Context, method string, args ...any) ([]any, error) {
	return c.callOn(ctx, ExportMgrPath, ExportMgrIface, method, args...)
}

// callOn invokes method of iface on ganesha's object path and returns the
// reply body. D-Bus errors become *Error; a broken connection is dialed
// again once.
func (c *Control) callOn(ctx context.Context, path dbus.ObjectPath, iface, method string, args ...any) ([]any, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultCallWait)
		defer cancel()
	}
	for attempt := 0; ; attempt++ {
		conn, err := c.connection()
		if err != nil {
			return nil, err
		}
		call := conn.Object(BusName, path).CallWithContext(ctx, iface+"."+method, 0, args...)
		if call.Err == nil {
			return call.Body, nil
		}
		var dv dbus.Error
		var dp *dbus.Error
		switch {
		case errors.As(call.Err, &dv):
			return nil, &Error{Method: method, Name: dv.Name, Message: dv.Error()}
		case errors.As(call.Err, &dp):
			return nil, &Error{Method: method, Name: dp.Name, Message: dp.Error()}
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("ganesha %s: %w", method, ctx.Err())
		}
		if !conn.Connected() && attempt == 0 {
			c.drop(conn)
			continue
		}
		return nil, fmt.Errorf("ganesha %s: %w", method, call.Err)
	}
}

func (c *Control) callMessage(ctx context.Context, method, confPath string, id uint16) error {
	if id == 0 {
		return errors.New("ganesha: export id 0 is the pseudo root")
	}
	_, err := c.call(ctx, method, confPath, Expression(id))
	return err
}

// AddExport makes ganesha load the export with id from confPath. ganesha
// refuses an id it already serves.
func (c *Control) AddExport(ctx context.Context, confPath string, id uint16) error {
	return c.callMessage(ctx, "AddExport", confPath, id)
}

// UpdateExport makes ganesha replace the export with id by what confPath
// says about it.
func (c *Control) UpdateExport(ctx context.Context, confPath string, id uint16) error {
	return c.callMessage(ctx, "UpdateExport", confPath, id)
}

// RemoveExport makes ganesha stop serving export id. Remove the export file
// first, or a restart brings the export back. IsNotFound(err) is true when
// ganesha did not have it.
func (c *Control) RemoveExport(ctx context.Context, id uint16) error {
	_, err := c.call(ctx, "RemoveExport", id)
	return err
}

// ApplyExport makes ganesha serve exactly what confPath says about export
// id: UpdateExport when ganesha has the id, AddExport otherwise. ganesha
// cannot change an export's Path in place, so when the file names another
// directory than the one served, the export is removed and added again.
// If ganesha changed its mind in between (a restart loaded the file, or the
// export was removed), the other call is tried once.
func (c *Control) ApplyExport(ctx context.Context, confPath string, id uint16) error {
	if id == 0 {
		return errors.New("ganesha: export id 0 is the pseudo root")
	}
	// One DisplayExport answers both whether ganesha has the export and
	// which directory it serves, at the same cost however many exports
	// ganesha holds.
	info, err := c.Export(ctx, id)
	has := err == nil
	if err != nil && !IsNotFound(err) {
		return err
	}
	if has {
		if want, ok := exportPathInFile(confPath); ok && info.Path != want {
			if err := c.RemoveExport(ctx, id); err != nil && !IsNotFound(err) {
				return err
			}
			return c.AddExport(ctx, confPath, id)
		}
	}
	first, second := c.AddExport, c.UpdateExport
	if has {
		first, second = c.UpdateExport, c.AddExport
	}
	err = first(ctx, confPath, id)
	if err == nil {
		return nil
	}
	nowHas, herr := c.HasExport(ctx, id)
	if herr != nil || nowHas == has {
		return err
	}
	return second(ctx, confPath, id)
}

var pathLineRe = regexp.MustCompile(`(?m)^\s*Path\s*=\s*"([^"]*)"\s*;\s*$`)

// exportPathInFile finds the Path of the single export in a file Render
// wrote; false when the file is not of that shape.
func exportPathInFile(confPath string) (string, bool) {
	data, err := os.ReadFile(confPath)
	if err != nil {
		return "", false
	}
	m := pathLineRe.FindAllSubmatch(data, 2)
	if len(m) != 1 {
		return "", false
	}
	return string(m[0][1]), true
}

// ExportIDs lists the ids ganesha serves (ShowExports), without the pseudo
// root (id 0), in ascending order. One call, however many exports.
func (c *Control) ExportIDs(ctx context.Context) ([]uint16, error) {
	entries, err := c.showExports(ctx)
	if err != nil {
		return nil, err
	}
	ids := make([]uint16, 0, len(entries))
	for _, e := range entries {
		ids = append(ids, e.ID)
	}
	return ids, nil
}

// HasExport reports whether ganesha serves export id: one DisplayExport,
// whatever the number of exports.
func (c *Control) HasExport(ctx context.Context, id uint16) (bool, error) {
	_, err := c.Export(ctx, id)
	if IsNotFound(err) {
		return false, nil
	}
	return err == nil, err
}

// Ping succeeds when ganesha answers on the bus.
func (c *Control) Ping(ctx context.Context) error {
	_, err := c.call(ctx, "ShowExports")
	return err
}

// InGrace reports whether ganesha is in its grace period (the admin
// interface's get_grace). During grace ganesha answers OPEN and LOCK with
// NFS4ERR_GRACE unless they reclaim state a client held before the
// restart; the kernel client waits and retries, other clients may fail.
func (c *Control) InGrace(ctx context.Context) (bool, error) {
	body, err := c.callOn(ctx, AdminPath, AdminIface, "get_grace")
	if err != nil {
		return false, err
	}
	if len(body) < 2 {
		return false, fmt.Errorf("ganesha get_grace: reply has %d values, want 3", len(body))
	}
	in, ok1 := body[0].(bool)
	success, ok2 := body[1].(bool)
	if !ok1 || !ok2 {
		return false, fmt.Errorf("ganesha get_grace: unexpected reply types %T, %T", body[0], body[1])
	}
	if !success {
		return false, fmt.Errorf("ganesha get_grace: failed: %v", body[2:])
	}
	return in, nil
}

// WaitGraceEnded returns once ganesha answers that it is not in grace, or
// when ctx ends. A ganesha that is not (yet) on the bus is waited for.
func (c *Control) WaitGraceEnded(ctx context.Context) error {
	var last error
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		in, err := c.InGrace(pctx)
		cancel()
		switch {
		case err == nil && !in:
			return nil
		case errors.Is(err, ErrClosed):
			return err
		case err == nil:
			last = errors.New("still in grace")
		default:
			last = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("ganesha: waiting for the grace period to end: %w (last: %v)", ctx.Err(), last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ExportInfo is what ganesha reports about one export.
type ExportInfo struct {
	ID   uint16
	Path string // the exported directory
	// Pseudo is the NFSv4 pseudo path. ganesha reports it only when
	// NFS_CORE_PARAM has Mount_Path_Pseudo = true (the Server sets it);
	// otherwise it reports Path here.
	Pseudo  string
	Clients []ClientInfo // in ganesha's order
}

// ClientInfo is one CLIENT entry of an export as ganesha reports it.
type ClientInfo struct {
	Match   string     // as ganesha prints it: "10.0.0.1/32", "fd00::1/128", "*", a netgroup, ...
	Address netip.Addr // the single host Match names; invalid for a network, wildcard or name
	Access  string     // "RW", "RO", "MDONLY", "MDONLY_RO" or "None"
	Squash  Squash     // "root_squash", "no_root_squash", "root_id_squash" or "all_squash"
}

// Rules returns the clients as ClientRules sorted by address (the form
// Export takes), and false if any client is something a ClientRule cannot
// express: not a single host, or neither RW nor RO.
func (i ExportInfo) Rules() ([]ClientRule, bool) {
	rules := make([]ClientRule, 0, len(i.Clients))
	for _, c := range i.Clients {
		if !c.Address.IsValid() || (c.Access != "RW" && c.Access != "RO") {
			return nil, false
		}
		rules = append(rules, ClientRule{Address: c.Address, ReadOnly: c.Access == "RO"})
	}
	slices.SortFunc(rules, func(a, b ClientRule) int { return a.Address.Compare(b.Address) })
	return rules, true
}

type shownExport struct {
	ID   uint16
	Path string
}

// showExports calls ShowExports and keeps id and path of each export but
// the pseudo root. The statistics part of each entry differs between
// ganesha versions and is not decoded.
func (c *Control) showExports(ctx context.Context) ([]shownExport, error) {
	body, err := c.call(ctx, "ShowExports")
	if err != nil {
		return nil, err
	}
	if len(body) < 2 {
		return nil, fmt.Errorf("ganesha ShowExports: reply has %d values, want 2", len(body))
	}
	list, ok := body[1].([][]any)
	if !ok {
		return nil, fmt.Errorf("ganesha ShowExports: unexpected reply type %T", body[1])
	}
	var out []shownExport
	for _, entry := range list {
		if len(entry) < 2 {
			return nil, errors.New("ganesha ShowExports: short export entry")
		}
		id, ok1 := entry[0].(uint16)
		p, ok2 := entry[1].(string)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("ganesha ShowExports: unexpected entry types %T, %T", entry[0], entry[1])
		}
		if id == 0 {
			continue
		}
		out = append(out, shownExport{ID: id, Path: p})
	}
	slices.SortFunc(out, func(a, b shownExport) int { return int(a.ID) - int(b.ID) })
	return out, nil
}

// Export returns what ganesha serves as export id (DisplayExport).
// IsNotFound(err) is true when it has no such export.
func (c *Control) Export(ctx context.Context, id uint16) (ExportInfo, error) {
	body, err := c.call(ctx, "DisplayExport", id)
	if err != nil {
		return ExportInfo{}, err
	}
	return parseDisplayExport(body)
}

// Exports lists every export ganesha serves but the pseudo root, in
// ascending id order, with path, pseudo path and clients. It costs one
// D-Bus call per export; ExportIDs is the cheap listing.
func (c *Control) Exports(ctx context.Context) ([]ExportInfo, error) {
	shown, err := c.showExports(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]ExportInfo, 0, len(shown))
	for _, s := range shown {
		info, err := c.Export(ctx, s.ID)
		if IsNotFound(err) {
			continue // removed since ShowExports
		}
		if err != nil {
			return nil, err
		}
		out = append(out, info)
	}
	return out, nil
}

// Permission bits of ganesha 4.x (include/export_mgr.h, export_perms).
const (
	optRootIDSquash = 0x001
	optRootSquash   = 0x002
	optAllAnonymous = 0x004
	optReadAccess   = 0x020
	optWriteAccess  = 0x040
	optMDReadAccess = 0x080
	optMDWrite      = 0x100
)

func parseDisplayExport(body []any) (ExportInfo, error) {
	if len(body) < 5 {
		return ExportInfo{}, fmt.Errorf("ganesha DisplayExport: reply has %d values, want 5", len(body))
	}
	id, ok1 := body[0].(uint16)
	full, ok2 := body[1].(string)
	pseudo, ok3 := body[2].(string)
	clients, ok4 := body[4].([][]any)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return ExportInfo{}, fmt.Errorf("ganesha DisplayExport: unexpected reply types %T %T %T %T", body[0], body[1], body[2], body[4])
	}
	info := ExportInfo{ID: id, Path: full, Pseudo: pseudo}
	for _, cl := range clients {
		ci, err := parseClient(cl)
		if err != nil {
			return ExportInfo{}, err
		}
		info.Clients = append(info.Clients, ci)
	}
	return info, nil
}

// parseClient decodes one (siyyiuuuuu): match, cidr version, address byte,
// mask byte, cidr proto, anonymous uid, anonymous gid, attribute expiry,
// options, which options are set.
func parseClient(v []any) (ClientInfo, error) {
	if len(v) < 10 {
		return ClientInfo{}, fmt.Errorf("ganesha DisplayExport: client entry has %d values, want 10", len(v))
	}
	match, ok1 := v[0].(string)
	options, ok2 := v[8].(uint32)
	if !ok1 || !ok2 {
		return ClientInfo{}, fmt.Errorf("ganesha DisplayExport: unexpected client types %T, %T", v[0], v[8])
	}
	ci := ClientInfo{Match: match}
	if p, err := netip.ParsePrefix(match); err == nil && p.Bits() == p.Addr().BitLen() {
		ci.Address = p.Addr()
	} else if a, err := netip.ParseAddr(match); err == nil {
		ci.Address = a
	}
	r, w := options&optReadAccess != 0, options&optWriteAccess != 0
	mdr, mdw := options&optMDReadAccess != 0, options&optMDWrite != 0
	switch {
	case r && w:
		ci.Access = "RW"
	case r:
		ci.Access = "RO"
	case mdw:
		ci.Access = "MDONLY"
	case mdr:
		ci.Access = "MDONLY_RO"
	default:
		ci.Access = "None"
	}
	switch {
	case options&optAllAnonymous != 0:
		ci.Squash = "all_squash"
	case options&optRootSquash != 0:
		ci.Squash = RootSquash
	case options&optRootIDSquash != 0:
		ci.Squash = "root_id_squash"
	default:
		ci.Squash = NoRootSquash
	}
	return ci, nil
}

// Filesystem is one filesystem ganesha knows of: where it is mounted and
// the device number it found there.
type Filesystem struct {
	Path         string
	Major, Minor uint64
}

// Filesystems lists the filesystems ganesha has taken from the mount table
// for its exports (CacheMgr showfs): an export is served from the one that
// holds its path, so this is ganesha's own answer to which filesystem it
// exports, to hold against the mount table.
func (c *Control) Filesystems(ctx context.Context) ([]Filesystem, error) {
	body, err := c.callOn(ctx, CacheMgrPath, CacheMgrIface, "showfs")
	if err != nil {
		return nil, err
	}
	if len(body) < 2 {
		return nil, fmt.Errorf("ganesha showfs: reply has %d values, want 2", len(body))
	}
	list, ok := body[1].([][]any)
	if !ok {
		return nil, fmt.Errorf("ganesha showfs: unexpected reply type %T", body[1])
	}
	out := make([]Filesystem, 0, len(list))
	for _, entry := range list {
		if len(entry) < 3 {
			return nil, errors.New("ganesha showfs: short filesystem entry")
		}
		p, ok1 := entry[0].(string)
		major, ok2 := entry[1].(uint64)
		minor, ok3 := entry[2].(uint64)
		if !ok1 || !ok2 || !ok3 {
			return nil, fmt.Errorf("ganesha showfs: unexpected entry types %T, %T, %T", entry[0], entry[1], entry[2])
		}
		out = append(out, Filesystem{Path: p, Major: major, Minor: minor})
	}
	return out, nil
}

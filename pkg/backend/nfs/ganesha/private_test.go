package ganesha

import (
	"context"
	"encoding/xml"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/nfs/ganesha/ganeshatest"
)

// busConfig is the part of a dbus-daemon configuration that decides who
// may connect and what they may do.
type busConfig struct {
	Type     []string    `xml:"type"`
	Listen   []string    `xml:"listen"`
	Auth     []string    `xml:"auth"`
	Policies []busPolicy `xml:"policy"`
	Other    []xml.Name  `xml:",any"`
}

type busPolicy struct {
	Context string    `xml:"context,attr"`
	User    string    `xml:"user,attr"`
	Group   string    `xml:"group,attr"`
	Rules   []busRule `xml:",any"`
}

type busRule struct {
	XMLName xml.Name
	Attrs   []xml.Attr `xml:",any,attr"`
}

func (r busRule) attr(name string) (string, bool) {
	for _, a := range r.Attrs {
		if a.Name.Local == name {
			return a.Value, true
		}
	}
	return "", false
}

// TestBusConfigIsPrivate reads the private bus's configuration as
// dbus-daemon would and checks that it lets only root connect, only over
// the socket in the runtime directory, with no anonymous or password
// authentication, and that only root may own ganesha's name or call it.
func TestBusConfigIsPrivate(t *testing.T) {
	cfg := ServerConfig{Dir: "/run/mg"}
	var c busConfig
	if err := xml.Unmarshal(cfg.busConf(), &c); err != nil {
		t.Fatal(err)
	}
	if len(c.Other) > 0 {
		// e.g. <allow_anonymous/>, <include>, <includedir>, <servicedir>
		t.Errorf("unexpected elements %v", c.Other)
	}
	if len(c.Listen) != 1 || c.Listen[0] != "unix:path=/run/mg/"+BusSocketName {
		t.Errorf("listen %q, want only unix:path=/run/mg/%s (no TCP, no abstract socket)", c.Listen, BusSocketName)
	}
	if len(c.Auth) != 1 || c.Auth[0] != "EXTERNAL" {
		t.Errorf("auth %q, want only EXTERNAL (the peer's uid, from the kernel)", c.Auth)
	}
	if len(c.Type) != 1 || c.Type[0] != "system" {
		t.Errorf("type %q, want system", c.Type)
	}
	connectors := []string{}
	for _, p := range c.Policies {
		switch {
		case p.Context == "default" && p.User == "" && p.Group == "":
			deniesOwn, deniesCalls := false, false
			for _, r := range p.Rules {
				own, hasOwn := r.attr("own")
				send, hasSend := r.attr("send_type")
				switch r.XMLName.Local {
				case "allow":
					if u, ok := r.attr("user"); ok {
						connectors = append(connectors, u)
					}
					if _, ok := r.attr("group"); ok {
						t.Errorf("default policy lets a group connect: %v", r.Attrs)
					}
					if hasOwn || (hasSend && send == "method_call") {
						t.Errorf("default policy allows %v", r.Attrs)
					}
					if d, ok := r.attr("send_destination"); ok && d != "org.freedesktop.DBus" {
						t.Errorf("default policy lets anyone call %s", d)
					}
				case "deny":
					deniesOwn = deniesOwn || (hasOwn && own == "*")
					deniesCalls = deniesCalls || (hasSend && send == "method_call" && len(r.Attrs) == 1)
				}
			}
			if !deniesOwn || !deniesCalls {
				t.Errorf("default policy must deny owning any name and sending method calls (own: %v, calls: %v)", deniesOwn, deniesCalls)
			}
		case p.Context == "" && p.User == "root" && p.Group == "":
			for _, r := range p.Rules {
				own, _ := r.attr("own")
				dest, _ := r.attr("send_destination")
				if r.XMLName.Local != "allow" || len(r.Attrs) != 1 || (own != BusName && dest != BusName) {
					t.Errorf("root policy has %s %v; want only to own and call %s", r.XMLName.Local, r.Attrs, BusName)
				}
			}
		default:
			t.Errorf("unexpected policy context=%q user=%q group=%q", p.Context, p.User, p.Group)
		}
	}
	if len(connectors) != 1 || connectors[0] != "root" {
		t.Errorf("users allowed to connect: %q, want only root", connectors)
	}
}

// TestServerRuntimeIsPrivate runs the private bus and ganesha and checks
// what reaches the control bus: the runtime directory is root's alone
// (dbus-daemon makes its socket 0777 and leaves access to the directory),
// its configuration and logs are 0600, another user cannot connect to the
// bus, and, with the directory opened for the experiment, the bus itself
// still turns that user away while root gets through.
func TestServerRuntimeIsPrivate(t *testing.T) {
	requireGanesha(t)
	ganeshatest.RequireCommands(t, "dbus-send")
	net := ganeshatest.Setup(t, ganeshatest.Options{Nodes: 0})
	// A base every user may traverse, so that only the runtime directory's
	// own mode stands between another user and the socket.
	base, err := os.MkdirTemp("", "mg-bus-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	runDir, exportDir := filepath.Join(base, "run"), filepath.Join(base, "exports")
	// Made too open beforehand: StartServer must close it.
	if err := os.Mkdir(runDir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(runDir, 0o777); err != nil {
		t.Fatal(err)
	}
	srv := startServer(t, net, runDir, exportDir)
	sock := filepath.Join(runDir, BusSocketName)

	for _, d := range []string{runDir, filepath.Join(runDir, RecoveryDirName), exportDir} {
		fi, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().Perm() != 0o700 || st.Uid != 0 {
			t.Errorf("%s: %v uid %d, want drwx------ owned by root", d, fi.Mode(), st.Uid)
		}
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("bus socket %s: %v %v", sock, fi, err)
	}
	for _, f := range []string{GaneshaConfName, BusConfName, BusPIDName, BusOutName, GaneshaOutName} {
		fi, err := os.Stat(filepath.Join(runDir, f))
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s is %v, want -rw-------", f, fi.Mode())
		}
	}

	// dbus-send --bus registers (Hello) and asks the bus for its names.
	listNames := func(uid uint32) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, "dbus-send", "--bus="+srv.DBusAddress(), "--print-reply", "--reply-timeout=5000",
			"--dest=org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus.ListNames")
		if uid != 0 {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
		}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	const nobody = 65534
	if out, err := listNames(nobody); err == nil {
		t.Errorf("user %d reached the control bus:\n%s", nobody, out)
	} else if !strings.Contains(out, "Permission denied") {
		t.Errorf("user %d refused, but not by the directory's mode: %v\n%s", nobody, err, out)
	}

	// Traversable directory: the bus's policy is what refuses now.
	if err := os.Chmod(runDir, 0o711); err != nil {
		t.Fatal(err)
	}
	out, err := listNames(nobody)
	if cerr := os.Chmod(runDir, 0o700); cerr != nil {
		t.Fatal(cerr)
	}
	if err == nil {
		t.Errorf("with the directory traversable, user %d got an answer from the bus:\n%s", nobody, out)
	} else if strings.Contains(out, "Permission denied") {
		t.Errorf("user %d was refused by the file system although the directory was traversable:\n%s", nobody, out)
	}
	t.Logf("user %d, directory traversable: %v: %s", nobody, err, strings.TrimSpace(out))
	if out, err := listNames(0); err != nil || !strings.Contains(out, `"`+BusName+`"`) {
		t.Errorf("root could not list the bus's names (the probe itself is broken): %v\n%s", err, out)
	}
}

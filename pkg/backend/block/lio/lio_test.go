package lio

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The names and secrets that reach configfs are checked first: a volume
// name becomes a directory and part of an IQN, an image path goes into a
// comma-separated control string, a secret is one line of text.
func TestCheckLUN(t *testing.T) {
	good := LUN{Name: "vol-1", Image: "/pool/volumes/vol-1.img", Size: 1 << 20, Serial: "6d672d766f6c2d310000000000000001"}
	for _, tc := range []struct {
		name string
		edit func(*LUN)
		want string // "" for accepted
	}{
		{"good", func(*LUN) {}, ""},
		{"upper case name", func(l *LUN) { l.Name = "Vol" }, "volume name"},
		{"name with a slash", func(l *LUN) { l.Name = "a/b" }, "volume name"},
		{"name starting with a dash", func(l *LUN) { l.Name = "-a" }, "volume name"},
		{"empty name", func(l *LUN) { l.Name = "" }, "volume name"},
		{"64-byte name", func(l *LUN) { l.Name = strings.Repeat("a", 64) }, "volume name"},
		{"63-byte name", func(l *LUN) { l.Name = strings.Repeat("a", 63) }, ""},
		{"relative image", func(l *LUN) { l.Image = "pool/a.img" }, "image"},
		{"image with dot-dot", func(l *LUN) { l.Image = "/pool/../etc/a.img" }, "image"},
		{"image with a comma", func(l *LUN) { l.Image = "/pool/a,fd_dev_size=1" }, "image"},
		{"image with a newline", func(l *LUN) { l.Image = "/pool/a\n.img" }, "image"},
		{"zero size", func(l *LUN) { l.Size = 0 }, "size"},
		{"size not in sectors", func(l *LUN) { l.Size = 1000 }, "size"},
		{"serial of a name", func(l *LUN) { l.Serial = "mg-vol-1" }, "serial"},
		{"upper case serial", func(l *LUN) { l.Serial = "6D672D766F6C2D310000000000000001" }, "serial"},
		{"31-digit serial", func(l *LUN) { l.Serial = strings.Repeat("a", 31) }, "serial"},
		{"33-digit serial", func(l *LUN) { l.Serial = strings.Repeat("a", 33) }, "serial"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := good
			tc.edit(&l)
			err := checkLUN(l)
			wantError(t, err, tc.want)
		})
	}
}

func TestCheckInitiator(t *testing.T) {
	good := Initiator{IQN: "iqn.2026-11.io.example.node:worker-1", User: "worker-1", Secret: "twelve-chars"}
	for _, tc := range []struct {
		name string
		edit func(*Initiator)
		want string
	}{
		{"good", func(*Initiator) {}, ""},
		{"IQN without a unique part", func(i *Initiator) { i.IQN = "iqn.2026-11.io.example" }, ""},
		{"upper case IQN", func(i *Initiator) { i.IQN = "iqn.2026-11.io.Example:a" }, "not an IQN"},
		{"month 13", func(i *Initiator) { i.IQN = "iqn.2026-13.io.example:a" }, "not an IQN"},
		{"EUI name", func(i *Initiator) { i.IQN = "eui.02004567A425678D" }, "not an IQN"},
		{"IQN with a slash", func(i *Initiator) { i.IQN = "iqn.2026-11.io.example:a/../b" }, "not an IQN"},
		{"IQN too long", func(i *Initiator) { i.IQN = "iqn.2026-11.io.example:" + strings.Repeat("a", 201) }, "not an IQN"},
		{"empty user", func(i *Initiator) { i.User = "" }, "CHAP user"},
		{"user with a space", func(i *Initiator) { i.User = "a b" }, "CHAP user"},
		{"short secret", func(i *Initiator) { i.Secret = "eleven-char" }, "CHAP secret"},
		{"secret with a newline", func(i *Initiator) { i.Secret = "twelve-chars\nauthentication=0" }, "CHAP secret"},
		{"secret with a blank", func(i *Initiator) { i.Secret = "twelve chars" }, "CHAP secret"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			i := good
			tc.edit(&i)
			err := checkInitiator(i)
			wantError(t, err, tc.want)
			if err != nil && strings.Contains(err.Error(), i.Secret) {
				t.Fatalf("the error shows the secret: %v", err)
			}
		})
	}
}

func TestNewChecksItsConfig(t *testing.T) {
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "core"), 0o755); err != nil {
		t.Fatal(err)
	}
	portal := netip.MustParseAddrPort("10.0.0.1:3260")
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"good", Config{Root: root, Prefix: "iqn.2026-11.io.example", Portal: portal}, ""},
		{"prefix with a unique part", Config{Root: root, Prefix: "iqn.2026-11.io.example:x", Portal: portal}, "prefix"},
		{"no prefix", Config{Root: root, Portal: portal}, "prefix"},
		{"no portal", Config{Root: root, Prefix: "iqn.2026-11.io.example"}, "portal"},
		{"port 0", Config{Root: root, Prefix: "iqn.2026-11.io.example", Portal: netip.MustParseAddrPort("10.0.0.1:0")}, "portal"},
		{"no LIO", Config{Root: filepath.Join(root, "absent"), Prefix: "iqn.2026-11.io.example", Portal: portal}, "no LIO target"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg)
			wantError(t, err, tc.want)
		})
	}
}

func TestPortalDirectoryNames(t *testing.T) {
	for addr, want := range map[string]string{
		"10.0.0.1:3260":  "10.0.0.1:3260",
		"[fd00::1]:3260": "[fd00::1]:3260",
	} {
		tg := &Target{cfg: Config{Portal: netip.MustParseAddrPort(addr)}}
		if got := tg.portal(); got != want {
			t.Errorf("portal(%s) = %q, want %q", addr, got, want)
		}
	}
}

// wantError fails t unless err is nil for want "" or mentions want.
func wantError(t *testing.T, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Fatalf("refused: %v", err)
	case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
		t.Fatalf("error %v, want one about %s", err, want)
	}
}

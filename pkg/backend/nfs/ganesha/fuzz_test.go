package ganesha

import (
	"net/netip"
	"strings"
	"testing"
)

// hostile reports whether s holds anything that could change the structure
// of a ganesha config file if it reached it verbatim.
func hostile(s string) bool {
	return strings.ContainsAny(s, "\"{};#\n\r\\*\x00'=,()") || strings.Contains(s, "..")
}

// FuzzRenderNoInjection: whatever Render accepts is exactly one EXPORT
// block with intact brace and quote structure, carrying the given values
// unchanged; whatever holds a hostile character is refused.
func FuzzRenderNoInjection(f *testing.F) {
	f.Add(uint16(1), "/data/vol1", "/vol1", "", "modeguard volume a", "10.99.0.11", false, []byte{10, 99, 0, 12}, true)
	f.Add(uint16(0), "/data/vol1", "/vol1", "root_squash", "", "", false, []byte{}, false)
	f.Add(uint16(7), `/data/v"; Access_Type = RW; x="`, "/v", "", "", "10.0.0.1", false, []byte{}, false)
	f.Add(uint16(8), "/data/v", "/v}\nEXPORT {", "no_root_squash", "", "fd00::1", true, []byte{}, false)
	f.Add(uint16(9), "/data/../etc", "/v", "", "x\n}", "::ffff:1.2.3.4", false, []byte{1, 2, 3, 4, 5}, true)
	f.Add(uint16(10), "/a", "/b", "all_squash", "#", "fe80::1%eth0", false, []byte{0, 0, 0, 0}, false)
	f.Fuzz(func(t *testing.T, id uint16, path, pseudo, squash, comment, client string, clientRO bool, raw []byte, rawRO bool) {
		e := Export{ID: id, Path: path, Pseudo: pseudo, Squash: Squash(squash), Comment: comment}
		if a, err := netip.ParseAddr(client); err == nil {
			e.Clients = append(e.Clients, ClientRule{Address: a, ReadOnly: clientRO})
		}
		// raw bytes become more clients: 4 bytes an IPv4, 16 an IPv6.
		for len(raw) >= 4 && len(e.Clients) < 8 {
			if len(raw) >= 16 && raw[0]&1 == 1 {
				e.Clients = append(e.Clients, ClientRule{Address: netip.AddrFrom16([16]byte(raw[:16])), ReadOnly: rawRO})
				raw = raw[16:]
			} else {
				e.Clients = append(e.Clients, ClientRule{Address: netip.AddrFrom4([4]byte(raw[:4])), ReadOnly: rawRO})
				raw = raw[4:]
			}
		}
		out, err := e.Render()
		if hostile(path) || hostile(pseudo) || hostile(squash) || hostile(comment) {
			if err == nil {
				t.Fatalf("hostile value accepted: %+v\n%s", e, out)
			}
			return
		}
		if err != nil {
			return
		}
		if e.ID == 0 {
			t.Fatalf("id 0 accepted")
		}
		if err := structureError(e, out); err != nil {
			t.Fatalf("%v in:\n%s", err, out)
		}
		again, err := e.Render()
		if err != nil || string(again) != string(out) {
			t.Fatalf("Render is not deterministic")
		}
	})
}

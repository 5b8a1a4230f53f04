package remote

import (
	"crypto/tls"
	"encoding/json"
	"io"
	"net/http"

	"github.com/modeguard/modeguard/pkg/backend"
)

func jsonRoundTrip(w *wireSnapshot) (*wireSnapshot, error) {
	data, err := json.Marshal(w)
	if err != nil {
		return nil, err
	}
	var out wireSnapshot
	return &out, json.Unmarshal(data, &out)
}

func jsonDecode(r io.Reader, v any) error { return json.NewDecoder(r).Decode(v) }

// insecureForTest is a client that checks nothing and sends no
// certificate: what a stranger on the network would be.
func insecureForTest() *tls.Config { return &tls.Config{InsecureSkipVerify: true} }

// leasedHandler serves c under l, with the fence list in memory.
func leasedHandler(c backend.Controller, l *lease) http.Handler {
	f, _ := newFenceRecord("")
	return handler(c, l, f)
}

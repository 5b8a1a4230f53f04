package remote

import (
	"context"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/backend/block"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
	"github.com/modeguard/modeguard/test/certs"
)

func newCA(t *testing.T, name string) *testCA { return &testCA{certs.NewCA(t, name)} }

// testCA hands out remote.TLSFiles.
type testCA struct{ *certs.CA }

func (c *testCA) issue(name string, use x509.ExtKeyUsage, peerCA string) TLSFiles {
	return TLSFiles(c.Issue(name, use, peerCA))
}

// serveTLS serves c's API on loopback with mutual TLS and returns the
// address.
func serveTLS(t *testing.T, c backend.Controller, files TLSFiles) string {
	t.Helper()
	cfg, err := files.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: Handler(c), TLSConfig: cfg, ErrorLog: log.New(io.Discard, "", 0)}
	go srv.ServeTLS(lis, "", "")
	t.Cleanup(func() { srv.Close() })
	return lis.Addr().String()
}

func blockController(t *testing.T) *block.Controller {
	t.Helper()
	ctrl, err := block.NewController(map[string]string{"zone-a": t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	return ctrl
}

func id(t *testing.T, kind volumeid.Kind, name string) volumeid.ID {
	t.Helper()
	v, err := volumeid.New(accessmode.BackendBlock, "zone-a", kind, volumeid.KeyFor("test", kind, name))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func hold(t *testing.T, c *Client, holder string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Hold(ctx, holder, func(why string) { t.Logf("waiting: %s", why) }); err != nil {
		t.Fatal(err)
	}
}

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("%s: %v, want %v", what, err, code)
	}
}

// Every method reaches the target's block controller and comes back
// as the controller itself answers, errors with their codes.
func TestClientIsTheTargetsController(t *testing.T) {
	authority := newCA(t, "modeguard")
	ctrl := blockController(t)
	addr := serveTLS(t, ctrl, authority.issue("127.0.0.1", x509.ExtKeyUsageServerAuth, authority.File))
	ctx := context.Background()
	c, err := Dial(ctx, Target{Address: addr, TLS: authority.issue("controller", x509.ExtKeyUsageClientAuth, authority.File)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hold(t, c, "controller-1")
	if c.Backend() != accessmode.BackendBlock || !reflect.DeepEqual(c.Zones(), []string{"zone-a"}) || c.MinimumSize() != ctrl.MinimumSize() {
		t.Fatalf("the client serves %s %v %d", c.Backend(), c.Zones(), c.MinimumSize())
	}

	vid := id(t, volumeid.Volume, "vol-1")
	spec := backend.VolumeSpec{ID: vid, Name: "vol-1", CapacityBytes: 16 << 20, AccessType: accessmode.Block,
		Modes: []accessmode.Mode{accessmode.SingleNodeWriter}, MutableParameters: map[string]string{"readAheadKiB": "256"}}
	created, err := c.CreateVolume(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	direct, err := ctrl.Volume(ctx, vid)
	if err != nil || !reflect.DeepEqual(created, direct) {
		t.Fatalf("created over the API %+v; the target has %+v (%v)", created, direct, err)
	}
	if got, err := c.Volume(ctx, vid); err != nil || !reflect.DeepEqual(got, direct) {
		t.Fatalf("Volume = %+v, %v; want %+v", got, err, direct)
	}
	_, err = c.Volume(ctx, id(t, volumeid.Volume, "missing"))
	wantCode(t, "a missing volume", err, codes.NotFound)
	_, err = c.CreateVolume(ctx, backend.VolumeSpec{ID: id(t, volumeid.Volume, "huge"), Name: "huge", CapacityBytes: 1 << 60,
		AccessType: accessmode.Block, Modes: []accessmode.Mode{accessmode.SingleNodeWriter}})
	wantCode(t, "a volume beyond the pool", err, codes.ResourceExhausted)

	att := []accessmode.Attachment{{Node: nodeid.MustParse("worker-1@zone-a@@@iqn.2026-11.io.example:worker-1"), Mode: accessmode.SingleNodeWriter}}
	if v, err := c.SetAttachments(ctx, vid, att); err != nil || !reflect.DeepEqual(v.Attachments, att) {
		t.Fatalf("SetAttachments = %+v, %v", v, err)
	}
	if on, err := c.VolumesOn(ctx, "worker-1"); err != nil || len(on) != 1 || on[0].ID != vid.String() {
		t.Fatalf("VolumesOn(worker-1) = %v, %v", on, err)
	}
	if !c.NodeExpansionRequired(direct) {
		t.Fatal("a raw block volume needs no node after growing, says the client")
	}
	if v, err := c.ExpandVolume(ctx, vid, 32<<20); err != nil || v.CapacityBytes != 32<<20 {
		t.Fatalf("ExpandVolume = %+v, %v", v, err)
	}
	if v, err := c.ModifyVolume(ctx, vid, map[string]string{"readAheadKiB": "1024"}); err != nil || v.MutableParameters["readAheadKiB"] != "1024" {
		t.Fatalf("ModifyVolume = %+v, %v", v, err)
	}
	if creating, err := c.Creating(ctx, vid); err != nil || creating {
		t.Fatalf("Creating(a volume made) = %v, %v", creating, err)
	}
	if h, err := c.VolumeHealth(ctx, vid); err != nil || h.Abnormal {
		t.Fatalf("VolumeHealth = %+v, %v", h, err)
	}
	if pools, err := c.Pools(ctx); err != nil || len(pools) != 1 || pools[0].CommittedBytes != 32<<20 {
		t.Fatalf("Pools = %+v, %v", pools, err)
	}
	if capacity, err := c.Capacity(ctx, "zone-a"); err != nil || capacity <= 0 {
		t.Fatalf("Capacity = %d, %v", capacity, err)
	}

	if _, err := c.SetAttachments(ctx, vid, nil); err != nil {
		t.Fatal(err)
	}
	// (A snapshot of a volume attached for writing is refused on a pool
	// without reflinks, as the target's temporary directory may be.)
	sid := id(t, volumeid.Snapshot, "snap-1")
	snap, err := c.CreateSnapshot(ctx, sid, "snap-1", vid)
	if err != nil {
		t.Fatal(err)
	}
	directSnap, err := ctrl.Snapshot(ctx, sid)
	if err != nil || !reflect.DeepEqual(snap.ID, directSnap.ID) || snap.Cutting != directSnap.Cutting || snap.SizeBytes != 32<<20 {
		t.Fatalf("CreateSnapshot = %+v; the target has %+v (%v)", snap, directSnap, err)
	}
	if list, err := c.ListSnapshots(ctx); err != nil || len(list) != 1 || list[0].ID != sid.String() {
		t.Fatalf("ListSnapshots = %v, %v", list, err)
	}
	if err := c.DeleteSnapshot(ctx, sid); err != nil {
		t.Fatal(err)
	}
	_, err = c.Snapshot(ctx, sid)
	wantCode(t, "a deleted snapshot", err, codes.NotFound)

	if err := c.DeleteVolume(ctx, vid); err != nil {
		t.Fatal(err)
	}
	if list, err := c.ListVolumes(ctx); err != nil || len(list) != 0 {
		t.Fatalf("ListVolumes after the delete = %v, %v", list, err)
	}
}

// A snapshot whose data is still being copied is reported so over the API
// too: its record leaves that out, the wire must not.
func TestWireSnapshotKeepsCutting(t *testing.T) {
	in := &backend.Snapshot{ID: "snap", SizeBytes: 1, Cutting: true}
	w, _ := toWireSnapshot(in, nil)
	data, err := jsonRoundTrip(w)
	if err != nil {
		t.Fatal(err)
	}
	out, _ := fromWireSnapshot(data, nil)
	if !reflect.DeepEqual(in, out) {
		t.Fatalf("%+v came back as %+v", in, out)
	}
}

// Only a client with a certificate of the target's CA, made for client
// authentication, gets an answer; and the controller talks only to a
// target whose certificate that CA made for the address it dialled.
func TestMutualTLSRefusesStrangers(t *testing.T) {
	authority := newCA(t, "modeguard")
	other := newCA(t, "other")
	ctrl := blockController(t)
	addr := serveTLS(t, ctrl, authority.issue("127.0.0.1", x509.ExtKeyUsageServerAuth, authority.File))
	ctx := context.Background()
	for name, files := range map[string]TLSFiles{
		"another CA's client":              other.issue("controller", x509.ExtKeyUsageClientAuth, authority.File),
		"a server certificate as a client": authority.issue("controller", x509.ExtKeyUsageServerAuth, authority.File),
		"a client trusting another CA":     authority.issue("controller", x509.ExtKeyUsageClientAuth, other.File),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := Dial(ctx, Target{Address: addr, TLS: files})
			wantCode(t, name, err, codes.Unavailable)
		})
	}
	t.Run("no client certificate", func(t *testing.T) {
		_, err := Dial(ctx, Target{Address: addr})
		if err == nil || !errors.Is(err, errNoTLS) {
			t.Fatalf("Dial without files: %v", err)
		}
		// And a client that sends none anyway is refused by the target.
		resp, err := (&http.Client{Transport: &http.Transport{TLSClientConfig: insecureForTest()}}).Post("https://"+addr+"/v1/Info", "application/json", strings.NewReader("{}"))
		if err == nil {
			resp.Body.Close()
			t.Fatalf("the target answered a client without a certificate: %s", resp.Status)
		}
	})
	t.Run("a target named otherwise", func(t *testing.T) {
		wrong := serveTLS(t, ctrl, authority.issue("target.zone-b", x509.ExtKeyUsageServerAuth, authority.File))
		_, err := Dial(ctx, Target{Address: wrong, TLS: authority.issue("controller", x509.ExtKeyUsageClientAuth, authority.File)})
		wantCode(t, "a target whose certificate names another host", err, codes.Unavailable)
	})
}

// On one host the API is a unix socket.
func TestUnixSocket(t *testing.T) {
	addr := serveUnix(t, Handler(blockController(t)))
	c := dial(t, addr)
	hold(t, c, "controller-1")
	if list, err := c.ListVolumes(context.Background()); err != nil || len(list) != 0 {
		t.Fatalf("ListVolumes = %v, %v", list, err)
	}
	if _, err := Dial(context.Background(), Target{Address: "unix://relative.sock"}); err == nil {
		t.Fatal("a relative socket path was taken")
	}
	// A request the API does not know is refused with INVALID_ARGUMENT.
	req, err := http.NewRequest(http.MethodPost, "http://target/v1/Volume", strings.NewReader(`{"id":{"Backend":"block"},"extra":1}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(holderHeader, "controller-1")
	resp, err := (&http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", strings.TrimPrefix(addr, "unix://"))
	}}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var env envelope
	if err := jsonDecode(resp.Body, &env); err != nil || env.Error == nil || env.Error.Code != codes.InvalidArgument {
		t.Fatalf("an unknown field: %+v, %v", env, err)
	}
}

// A target of an older version does not serve Creating. Not knowing
// whether a volume is being created there is no "no" (a retry of that
// creation would make a second volume in another zone): the client says
// UNAVAILABLE, which the CO retries, and names the cause.
func TestOlderTargetCannotTellCreations(t *testing.T) {
	older := http.NewServeMux()
	older.HandleFunc("/v1/Creating", http.NotFound)
	older.Handle("/", Handler(blockController(t)))
	c := dial(t, serveUnix(t, older))
	hold(t, c, "controller-1")
	_, err := c.Creating(context.Background(), id(t, volumeid.Volume, "vol-1"))
	wantCode(t, "Creating on a target that does not serve it", err, codes.Unavailable)
	if !strings.Contains(err.Error(), "older") {
		t.Fatalf("the refusal does not say why: %v", err)
	}
}

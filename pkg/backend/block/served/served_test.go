package served

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
	"github.com/modeguard/modeguard/pkg/nodeid"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

// The access list is made of what each attached node reports (its
// initiator name) and of the secret the target holds for it; a node
// without either is refused with a message saying which and why.
func TestInitiatorsOfAttachments(t *testing.T) {
	dir := t.TempDir()
	for node, secret := range map[string]string{"worker-1": "secret-of-worker-1\n", "worker-3": "short\n"} {
		if err := os.WriteFile(filepath.Join(dir, node), []byte(secret), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	c := &Controller{chapDir: dir}
	got, err := c.initiators([]accessmode.Attachment{
		{Node: nodeid.MustParse("worker-1@zone-a@10.0.0.1@64@iqn.2026-11.io.example:worker-1"), Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true},
	})
	want := []lio.Initiator{{IQN: "iqn.2026-11.io.example:worker-1", ReadOnly: true, User: "worker-1", Secret: "secret-of-worker-1"}}
	if err != nil || len(got) != 1 || got[0] != want[0] {
		t.Fatalf("initiators = %+v, %v; want %+v", got, err, want)
	}
	// A fenced node is left off the list, whatever it reports.
	got, err = c.initiators([]accessmode.Attachment{
		{Node: nodeid.MustParse("worker-1@zone-a@10.0.0.1@64@iqn.2026-11.io.example:worker-1"), Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true},
		{Node: nodeid.MustParse("worker-2@zone-a@10.0.0.2@64@iqn.2026-11.io.example:worker-2"), Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true, Fenced: true},
		{Node: nodeid.MustParse("worker-4@zone-a@10.0.0.4"), Mode: accessmode.MultiNodeReaderOnly, ReadOnly: true, Fenced: true},
	})
	if err != nil || len(got) != 1 || got[0] != want[0] {
		t.Fatalf("initiators with fenced nodes = %+v, %v; want %+v", got, err, want)
	}
	for _, tc := range []struct{ name, nodeID, want string }{
		{"no initiator name", "worker-1@zone-a@10.0.0.1@64", "--iscsi-initiator-name-file"},
		{"no secret", "worker-2@zone-a@@@iqn.2026-11.io.example:worker-2", "no CHAP secret"},
		{"a short secret", "worker-3@zone-a@@@iqn.2026-11.io.example:worker-3", "12 to 255"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.initiators([]accessmode.Attachment{{Node: nodeid.MustParse(tc.nodeID), Mode: accessmode.SingleNodeWriter}})
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want FAILED_PRECONDITION about %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "short") {
				t.Fatalf("the error shows the secret: %v", err)
			}
		})
	}
}

// Every volume gets a serial of its own that LIO's world-wide name keeps
// apart, and a LUN name LIO takes.
func TestNamesOfAVolume(t *testing.T) {
	seen := map[string]bool{}
	for _, zone := range []string{"zone-a", "zone-b"} {
		for _, name := range []string{"pvc-1", "pvc-2"} {
			id, err := volumeid.New(accessmode.BackendBlock, zone, volumeid.Volume, volumeid.KeyFor("modeguard.csi.dev", volumeid.Volume, name))
			if err != nil {
				t.Fatal(err)
			}
			s, n := Serial(id), lunName(id)
			if len(s) != 32 || seen[s[:25]] || seen[n] {
				t.Fatalf("%s: serial %s, LUN %s: not unique", id, s, n)
			}
			seen[s[:25]], seen[n] = true, true
		}
	}
}

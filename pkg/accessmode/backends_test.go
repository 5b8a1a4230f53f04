package accessmode

import (
	"strings"
	"testing"
)

// TestServes is the driver's matrix of what each backend can honour. "y":
// served; "-": refused. A local filesystem on a block device must never be
// mounted read/write on one node while mounted anywhere else.
func TestServes(t *testing.T) {
	cols := []Mode{SNW, SNRO, MNRO, MNSW, MNMW, SNSW, SNMW}
	rows := []struct {
		backend Backend
		access  AccessType
		cells   string
		mention string // every refusal's message contains it
	}{
		//                              SNW  SNRO MNRO MNSW MNMW SNSW SNMW
		{BackendBlock, Mount, "         y    y    y    -    -    y    y", "nfs"},
		{BackendBlock, Block, "         y    y    y    y    y    y    y", ""},
		{BackendNFS, Mount, "           y    y    y    y    y    y    y", ""},
		{BackendNFS, Block, "           -    -    -    -    -    -    -", "block"},
	}
	for _, r := range rows {
		cells := strings.Fields(r.cells)
		if len(cells) != len(cols) {
			t.Fatalf("%s/%s: %d cells, want %d", r.backend, r.access, len(cells), len(cols))
		}
		for i, m := range cols {
			err := Serves(r.backend, r.access, m)
			switch want := cells[i] == "y"; {
			case want && err != nil:
				t.Errorf("Serves(%s, %s, %v) = %v, want served", r.backend, r.access, m, err)
			case !want && err == nil:
				t.Errorf("Serves(%s, %s, %v) = nil, want refused", r.backend, r.access, m)
			case !want && !strings.Contains(err.Error(), r.mention):
				t.Errorf("Serves(%s, %s, %v) = %q, want a message that mentions %q", r.backend, r.access, m, err, r.mention)
			}
		}
	}
}

func TestServesBlockMountRefusalExplains(t *testing.T) {
	for _, m := range []Mode{MNSW, MNMW} {
		err := Serves(BackendBlock, Mount, m)
		if err == nil {
			t.Fatalf("Serves(block, mount, %v) = nil", m)
		}
		for _, s := range []string{Name(m), "backend=nfs", "access type block"} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("Serves(block, mount, %v) = %q: does not mention %q", m, err, s)
			}
		}
	}
}

func TestServesRefusesWhatItDoesNotKnow(t *testing.T) {
	tests := []struct {
		name    string
		backend Backend
		access  AccessType
		mode    Mode
		mention string
	}{
		{"unknown backend", "ceph", Mount, SNW, `"ceph"`},
		{"empty backend", "", Mount, SNW, "block, nfs"},
		{"capitalised backend", "NFS", Mount, SNW, "block, nfs"},
		{"unknown access type on block", BackendBlock, "filesystem", SNW, `"filesystem"`},
		{"unknown access type on nfs", BackendNFS, "", MNMW, "mount, block"},
		{"invalid mode on block/block", BackendBlock, Block, Mode(0), "not a defined"},
		{"invalid mode on nfs/mount", BackendNFS, Mount, Mode(8), "not a defined"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Serves(tt.backend, tt.access, tt.mode)
			if err == nil {
				t.Fatalf("Serves(%q, %q, %d) = nil, want an error", tt.backend, tt.access, tt.mode)
			}
			if !strings.Contains(err.Error(), tt.mention) {
				t.Errorf("error %q does not mention %s", err, tt.mention)
			}
		})
	}
}

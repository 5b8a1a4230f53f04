package block

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/modeguard/modeguard/pkg/accessmode"
	"github.com/modeguard/modeguard/pkg/backend"
	"github.com/modeguard/modeguard/pkg/volumeid"
)

func TestParsePoolsRejectsBadConfiguration(t *testing.T) {
	dir := t.TempDir()
	poolA := filepath.Join(dir, "a")
	poolB := filepath.Join(dir, "b")
	file := filepath.Join(dir, "file")
	link := filepath.Join(dir, "link-to-a")
	for _, d := range []string{poolA, poolB} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(poolA, link); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name    string
		pools   map[string]string
		wantErr string // "" means accepted
	}{
		{"no pools", map[string]string{}, "no block pools"},
		{"zone with a slash", map[string]string{"a/b": poolA}, "not a valid zone"},
		{"empty zone", map[string]string{"": poolA}, "not a valid zone"},
		{"empty directory", map[string]string{"a": ""}, "empty directory"},
		{"missing directory", map[string]string{"a": filepath.Join(dir, "nope")}, "no such file"},
		{"file instead of directory", map[string]string{"a": file}, "not a directory"},
		{"two zones one directory", map[string]string{"a": poolA, "b": link}, "share the directory"},
		{"two zones two directories", map[string]string{"zone-b": poolB, "zone-a": poolA}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pools, zones, err := parsePools(tt.pools)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				if strings.Join(zones, ",") != "zone-a,zone-b" {
					t.Fatalf("zones = %v, want sorted [zone-a zone-b]", zones)
				}
				if pools["zone-a"].dir != poolA {
					t.Fatalf("pool dir = %s, want %s", pools["zone-a"].dir, poolA)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestPoolPathsFollowTheDocumentedLayout(t *testing.T) {
	p := &pool{zone: "zone-a", dir: "/pools/a"}
	key := strings.Repeat("ab", 16)
	vol, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Volume, key)
	snap, _ := volumeid.New(accessmode.BackendBlock, "zone-a", volumeid.Snapshot, key)
	otherZone, _ := volumeid.New(accessmode.BackendBlock, "zone-b", volumeid.Volume, key)

	tests := []struct {
		name    string
		build   func() (string, error)
		want    string
		wantErr bool
	}{
		{"volume metadata", func() (string, error) { return p.metaPath(vol) }, "/pools/a/volumes/block_zone-a_vol-" + key + ".json", false},
		{"volume image", func() (string, error) { return p.imagePath(vol) }, "/pools/a/volumes/block_zone-a_vol-" + key + ".img", false},
		{"snapshot metadata", func() (string, error) { return p.metaPath(snap) }, "/pools/a/snapshots/block_zone-a_snap-" + key + ".json", false},
		{"snapshot image", func() (string, error) { return p.imagePath(snap) }, "/pools/a/snapshots/block_zone-a_snap-" + key + ".img", false},
		{"id of another zone", func() (string, error) { return p.imagePath(otherZone) }, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.build()
			if tt.wantErr {
				if err == nil {
					t.Fatalf("got %s, want an error", got)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

func TestIDForFileAcceptsOnlyThisPoolsFileNames(t *testing.T) {
	p := &pool{zone: "zone_a", dir: "/pools/a"}
	key := strings.Repeat("0f", 16)
	tests := []struct {
		name   string
		kind   volumeid.Kind
		file   string
		suffix string
		ok     bool
	}{
		{"volume metadata", volumeid.Volume, "block_zone_a_vol-" + key + ".json", ".json", true},
		{"volume image", volumeid.Volume, "block_zone_a_vol-" + key + ".img", ".img", true},
		{"snapshot image", volumeid.Snapshot, "block_zone_a_snap-" + key + ".img", ".img", true},
		{"snapshot name in volumes", volumeid.Volume, "block_zone_a_snap-" + key + ".img", ".img", false},
		{"other zone", volumeid.Volume, "block_zone-b_vol-" + key + ".img", ".img", false},
		{"upper-case key", volumeid.Volume, "block_zone_a_vol-" + strings.ToUpper(key) + ".img", ".img", false},
		{"short key", volumeid.Volume, "block_zone_a_vol-0f.img", ".img", false},
		{"nfs backend", volumeid.Volume, "nfs_zone_a_vol-" + key + ".img", ".img", false},
		{"temporary file", volumeid.Volume, ".block_zone_a_vol-" + key + ".img.tmp-123", ".img", false},
		{"wrong suffix", volumeid.Volume, "block_zone_a_vol-" + key + ".json", ".img", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, ok := p.idForFile(tt.kind, tt.file, tt.suffix)
			if ok != tt.ok {
				t.Fatalf("ok = %v, want %v", ok, tt.ok)
			}
			if ok && id.FileName()+tt.suffix != tt.file {
				t.Fatalf("id %s does not name %s", id, tt.file)
			}
		})
	}
}

func TestCapacityArithmetic(t *testing.T) {
	tests := []struct {
		name     string
		free     int64
		volumes  [][2]int64 // capacity, allocated
		reserved int64
		want     int64
	}{
		{"empty pool offers all free space", 1000, nil, 0, 1000},
		{"sparse volume counts in full", 1000, [][2]int64{{300, 0}}, 0, 700},
		{"allocated part is already out of free space", 1000, [][2]int64{{300, 100}}, 0, 800},
		{"fully written volume promises nothing more", 1000, [][2]int64{{300, 300}}, 0, 1000},
		{"over-allocated image (metadata blocks) is not a credit", 1000, [][2]int64{{300, 400}}, 0, 1000},
		{"several volumes add up", 1000, [][2]int64{{300, 0}, {200, 50}}, 0, 550},
		{"reservations in flight count", 1000, [][2]int64{{300, 0}}, 200, 500},
		{"over-committed pool floors at zero", 1000, [][2]int64{{800, 0}, {800, 0}}, 0, 0},
		{"no free space at all", 0, nil, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var promised []int64
			for _, v := range tt.volumes {
				promised = append(promised, outstanding(v[0], v[1]))
			}
			if got := spare(tt.free, promised, tt.reserved); got != tt.want {
				t.Fatalf("spare = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestMountOptions(t *testing.T) {
	const writable, neverWritten = true, false
	tests := []struct {
		name     string
		fsType   string
		readOnly bool
		writable bool
		flags    []string
		want     string
	}{
		{"ext4 read/write keeps the CO's flags", "ext4", false, writable, []string{"noatime"}, "noatime"},
		{"ext4 reader of a writable volume skips the live journal", "ext4", true, writable, nil, "ro,noload"},
		{"ext4 read-only volume hides nothing", "ext4", true, neverWritten, nil, "ro"},
		{"xfs read/write tolerates duplicate UUIDs", "xfs", false, writable, nil, "nouuid"},
		{"xfs reader of a writable volume skips log recovery", "xfs", true, writable, []string{"noatime"}, "noatime,nouuid,ro,norecovery"},
		{"xfs read-only volume hides nothing", "xfs", true, neverWritten, nil, "nouuid,ro"},
		{"ro comes after a stray rw", "ext4", true, writable, []string{"rw"}, "rw,ro,noload"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := strings.Join(mountOptions(tt.fsType, tt.readOnly, tt.writable, tt.flags), ","); got != tt.want {
				t.Fatalf("options = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestFormatsAtCreateOnlyWhenNoNodeMayWrite(t *testing.T) {
	ro := []accessmode.Mode{accessmode.MultiNodeReaderOnly, accessmode.SingleNodeReaderOnly}
	tests := []struct {
		name   string
		access accessmode.AccessType
		modes  []accessmode.Mode
		source bool
		want   bool
	}{
		{"read-only modes, mount", accessmode.Mount, ro, false, true},
		{"one writable mode", accessmode.Mount, append(ro, accessmode.SingleNodeWriter), false, false},
		{"read-only but block", accessmode.Block, ro, false, false},
		{"read-only but copied from a source", accessmode.Mount, ro, true, false},
		{"no modes", accessmode.Mount, nil, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var src *backend.Source
			if tt.source {
				src = &backend.Source{SnapshotID: "x"}
			}
			if got := formatsAtCreate(tt.access, tt.modes, src); got != tt.want {
				t.Fatalf("formatsAtCreate = %v, want %v", got, tt.want)
			}
		})
	}
}

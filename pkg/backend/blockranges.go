package backend

import "github.com/modeguard/modeguard/pkg/volumeid"

// BlockRangesRequest asks for one page of a snapshot's block metadata (the
// CSI SnapshotMetadata service): with Base the zero ID, the ranges of
// Target that hold data; with Base set, the ranges whose data may differ
// between Base and Target, two snapshots of one volume.
type BlockRangesRequest struct {
	Base   volumeid.ID `json:"base"`
	Target volumeid.ID `json:"target"`
	// From is the first byte of interest: no range ends at or before it,
	// and one that spans it is cut to begin there.
	From int64 `json:"from"`
	// Limit is the most ranges the page may hold (at least 1).
	Limit int `json:"limit"`
}

// Delta reports whether the request compares two snapshots.
func (r BlockRangesRequest) Delta() bool { return r.Base != volumeid.ID{} }

// BlockRange is Length bytes at Offset of a snapshot's image.
type BlockRange struct {
	Offset int64 `json:"offset"`
	Length int64 `json:"length"`
}

// End is the first byte after the range.
func (r BlockRange) End() int64 { return r.Offset + r.Length }

// BlockRanges is one page of block metadata: ranges in ascending order,
// none overlapping or touching another (adjacent ones are merged).
type BlockRanges struct {
	// CapacityBytes is the size of the target snapshot's volume.
	CapacityBytes int64        `json:"capacityBytes"`
	Ranges        []BlockRange `json:"ranges"`
	// Done says the page ends the answer; otherwise the next page is asked
	// From the End of the last range.
	Done bool `json:"done"`
}

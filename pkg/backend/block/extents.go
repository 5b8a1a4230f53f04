package block

// Where an image's data lies, and where two images' data may differ, read
// from the filesystem's extent map (FIEMAP), or, where the filesystem has
// none (tmpfs), from SEEK_DATA and SEEK_HOLE. Nothing here reads data.

import (
	"errors"
	"os"
	"slices"
	"unsafe"

	"github.com/modeguard/modeguard/pkg/backend"
	"golang.org/x/sys/unix"
)

// The FIEMAP ioctl (linux/fiemap.h), which golang.org/x/sys/unix does not
// carry.
const (
	fsIocFiemap = 0xC020660B // _IOWR('f', 11, struct fiemap)
	// fiemapFlagSync flushes the file's dirty pages first, so that blocks
	// waiting for delayed allocation show as extents.
	fiemapFlagSync = 0x1

	fiemapExtentLast = 0x1
	// Flags under which fe_physical is no address that identifies the
	// data: not yet allocated, stored encoded, packed with other files'
	// data, or held in the inode.
	fiemapExtentUnknown    = 0x2
	fiemapExtentDelalloc   = 0x4
	fiemapExtentEncoded    = 0x8
	fiemapExtentNotAligned = 0x100
	fiemapExtentDataInline = 0x200
	fiemapExtentDataTail   = 0x400
	noPhysicalIdentity     = fiemapExtentUnknown | fiemapExtentDelalloc | fiemapExtentEncoded |
		fiemapExtentNotAligned | fiemapExtentDataInline | fiemapExtentDataTail

	// fiemapBatch is how many extents one ioctl returns at most.
	fiemapBatch = 256
)

// fiemapExtent and fiemap are struct fiemap_extent and struct fiemap of
// linux/fiemap.h, field for field; every field is naturally aligned, so Go
// lays them out as C does.
type fiemapExtent struct {
	logical  uint64
	physical uint64
	length   uint64
	_        [2]uint64
	flags    uint32
	_        [3]uint32
}

type fiemap struct {
	start         uint64
	length        uint64
	flags         uint32
	mappedExtents uint32
	extentCount   uint32
	_             uint32
	extents       [fiemapBatch]fiemapExtent
}

// extent is a run of a file's bytes that the filesystem stores together.
type extent struct {
	logical, length int64
	// physical is where on the pool's device the run lies; it identifies
	// the data only when known is true.
	physical int64
	known    bool
}

func (e extent) end() int64 { return e.logical + e.length }

// errNoExtentMap: the filesystem does not answer FIEMAP.
var errNoExtentMap = errors.New("the filesystem has no extent map")

// extentsIn lists f's extents that overlap [start, end), cut to it, in
// ascending order: from FIEMAP, or, where the filesystem has no extent map,
// from SEEK_DATA/SEEK_HOLE with no physical addresses.
func extentsIn(f *os.File, start, end int64) ([]extent, error) {
	out, err := fiemapExtents(f, start, end)
	if errors.Is(err, errNoExtentMap) {
		return dataRuns(f, start, end)
	}
	return out, err
}

func fiemapExtents(f *os.File, start, end int64) ([]extent, error) {
	var out []extent
	m := new(fiemap)
	for pos := start; pos < end; {
		*m = fiemap{start: uint64(pos), length: uint64(end - pos), flags: fiemapFlagSync, extentCount: fiemapBatch}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(m)))
		switch errno {
		case 0:
		case unix.EOPNOTSUPP, unix.ENOTTY:
			return nil, errNoExtentMap
		default:
			return nil, &os.PathError{Op: "FIEMAP", Path: f.Name(), Err: errno}
		}
		if m.mappedExtents == 0 {
			break
		}
		for _, fe := range m.extents[:m.mappedExtents] {
			e := extent{logical: int64(fe.logical), length: int64(fe.length), physical: int64(fe.physical),
				known: fe.flags&noPhysicalIdentity == 0}
			if e, ok := clip(e, start, end); ok {
				out = append(out, e)
			}
		}
		last := m.extents[m.mappedExtents-1]
		next := int64(last.logical + last.length)
		if last.flags&fiemapExtentLast != 0 || next <= pos {
			break
		}
		pos = next
	}
	return out, nil
}

// dataRuns lists f's data within [start, end) as SEEK_DATA and SEEK_HOLE
// find it; physical addresses are unknown.
func dataRuns(f *os.File, start, end int64) ([]extent, error) {
	var out []extent
	fd := int(f.Fd())
	for pos := start; pos < end; {
		data, err := unix.Seek(fd, pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) || err == nil && data >= end {
			break
		}
		if err != nil {
			return nil, &os.PathError{Op: "SEEK_DATA", Path: f.Name(), Err: err}
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, &os.PathError{Op: "SEEK_HOLE", Path: f.Name(), Err: err}
		}
		hole = min(hole, end)
		out = append(out, extent{logical: data, length: hole - data})
		pos = hole
	}
	return out, nil
}

// clip cuts e to [start, end); false when nothing of it is left.
func clip(e extent, start, end int64) (extent, bool) {
	if e.logical < start {
		cut := start - e.logical
		e.logical, e.length, e.physical = start, e.length-cut, e.physical+cut
	}
	if e.end() > end {
		e.length = end - e.logical
	}
	return e, e.length > 0
}

// differing is where base and target may hold different data: bytes
// stored in one and a hole in the other, and bytes stored in both at
// different physical addresses or at addresses that say nothing (no extent
// map, or extents flagged so). Equal addresses mean one shared block: both
// images exist, so a block cannot belong to both unless a reflink clone
// shares it, and a shared block is never written in place. Where the pool
// has no reflinks, no block is shared and every stored byte of either image
// counts as changed: a superset of the true change, never less. With base
// nil, it is everything target stores. Both lists are ascending and
// non-overlapping; so is the answer, with touching ranges merged.
func differing(base, target []extent) []backend.BlockRange {
	cuts := make([]int64, 0, 2*(len(base)+len(target)))
	for _, list := range [][]extent{base, target} {
		for _, e := range list {
			cuts = append(cuts, e.logical, e.end())
		}
	}
	slices.Sort(cuts)
	cuts = slices.Compact(cuts)
	var out []backend.BlockRange
	b, t := 0, 0
	for i := 0; i+1 < len(cuts); i++ {
		from, to := cuts[i], cuts[i+1]
		for b < len(base) && base[b].end() <= from {
			b++
		}
		for t < len(target) && target[t].end() <= from {
			t++
		}
		inBase := b < len(base) && base[b].logical <= from
		inTarget := t < len(target) && target[t].logical <= from
		var changed bool
		switch {
		case inBase && inTarget:
			be, te := base[b], target[t]
			changed = !be.known || !te.known || be.physical-be.logical != te.physical-te.logical
		default:
			changed = inBase || inTarget
		}
		if changed {
			out = appendRange(out, backend.BlockRange{Offset: from, Length: to - from})
		}
	}
	return out
}

// appendRange appends r to ascending ranges, merging it into the last one
// when they touch.
func appendRange(ranges []backend.BlockRange, r backend.BlockRange) []backend.BlockRange {
	if n := len(ranges); n > 0 && ranges[n-1].End() >= r.Offset {
		ranges[n-1].Length = max(ranges[n-1].End(), r.End()) - ranges[n-1].Offset
		return ranges
	}
	return append(ranges, r)
}

package backend

import (
	"maps"
	"strconv"
)

// Mutable parameter keys (Volume.MutableParameters), one per backend that
// has something to change while a volume lives.
const (
	// AttrRootSquash (NFS): "true" maps root on the clients to an
	// anonymous user, "false" lets root be root. The export changes live.
	AttrRootSquash = "rootSquash"
	// AttrReadAheadKiB (block): the read-ahead of the volume's device on a
	// node, in KiB, set when a node stages the volume.
	AttrReadAheadKiB = "readAheadKiB"
)

// Attribute is the volume's value for a key: its mutable parameter if set,
// else the parameter it was created with.
func (v *Volume) Attribute(key string) (string, bool) {
	if val, ok := v.MutableParameters[key]; ok {
		return val, true
	}
	val, ok := v.Parameters[key]
	return val, ok
}

// RootSquash reports whether the volume's NFS clients have root squashed.
// Only a value that clearly says false turns squashing off: anything
// ParseBool cannot read (the driver refuses it, but a record may come from
// elsewhere) keeps the safe default.
func (v *Volume) RootSquash() bool {
	if val, ok := v.Attribute(AttrRootSquash); ok {
		if b, err := strconv.ParseBool(val); err == nil && !b {
			return false
		}
	}
	return true
}

// ReadAheadKiB is the read-ahead a node sets on the volume's device, and
// false when the volume does not name one (the kernel's default stays) or
// names one that is not a number.
func (v *Volume) ReadAheadKiB() (uint64, bool) {
	val, ok := v.Attribute(AttrReadAheadKiB)
	if !ok {
		return 0, false
	}
	kib, err := strconv.ParseUint(val, 10, 32)
	return kib, err == nil
}

// WithMutable returns the volume's mutable parameters with changes applied
// over them (a new map; nil when there are none).
func WithMutable(current, changes map[string]string) map[string]string {
	if len(current)+len(changes) == 0 {
		return nil
	}
	out := maps.Clone(current)
	if out == nil {
		out = map[string]string{}
	}
	maps.Copy(out, changes)
	return out
}

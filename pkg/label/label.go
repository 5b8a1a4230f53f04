// Package label checks Kubernetes label values, which zones and node keys
// are. It imports nothing of this module, so that the packages of volume
// ids and of node ids can both check by it without depending on each other.
package label

import "regexp"

// valuePattern is a label value of at most 63 characters: alphanumeric at
// both ends, '-', '_' and '.' inside.
var valuePattern = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$`)

// ValidValue reports whether v is a non-empty Kubernetes label value.
func ValidValue(v string) bool { return valuePattern.MatchString(v) }

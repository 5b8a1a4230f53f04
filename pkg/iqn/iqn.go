// Package iqn checks iSCSI qualified names (RFC 3720 3.2.6.3.1). It imports
// nothing of this module: a node id carries its node's initiator name and
// the iSCSI backend logs in and serves under such names, and both check
// them by the same rule.
package iqn

import "regexp"

// MaxLength is the longest name RFC 3720 allows.
const MaxLength = 223

// Form says in words what Valid accepts, for messages.
const Form = "iqn.YYYY-MM.reversed.domain[:unique], lower case"

// pattern is iqn.YYYY-MM.reversed-domain[:unique], lower case.
var pattern = regexp.MustCompile(`^iqn\.[0-9]{4}-(0[1-9]|1[0-2])\.[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*(:[a-z0-9.:-]+)?$`)

// Valid tells whether s is an iSCSI qualified name as RFC 3720 writes it
// (lower case; the only form both LIO and open-iscsi take verbatim).
func Valid(s string) bool { return len(s) <= MaxLength && pattern.MatchString(s) }

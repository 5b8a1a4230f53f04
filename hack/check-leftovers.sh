#!/usr/bin/env bash
# Fails when tests left loop devices or mounts of the driver's behind: a test
# that leaks here leaks in CI and on a user's node too.
set -u
status=0
loops=$(losetup -a 2>/dev/null | grep -E 'modeguard|/pools?/' || true)
if [ -n "$loops" ]; then
  echo "leftover loop devices:"; echo "$loops"; status=1
fi
mounts=$(grep -E 'modeguard' /proc/mounts || true)
if [ -n "$mounts" ]; then
  echo "leftover mounts:"; echo "$mounts"; status=1
fi
[ "$status" = 0 ] && echo "no leftover loop devices or mounts"
exit "$status"

# Sourced by undeploy.sh and down.sh: the loop devices bound to a file on a
# pool's filesystem (the xfs images pool-<zone>.img of deploy.sh), whatever
# path the kernel names the file by. A device bound through a mount that is
# gone (a node plugin's container since restarted) is named relative to that
# mount's root ("/volumes/..."), so a check by path prefix would miss it.

# pool_bound_loops MG: one device per line.
pool_bound_loops() {
  local mg=${1%/} pools
  pools=$(losetup --list --noheadings -O MAJ:MIN,BACK-FILE 2>/dev/null \
    | awk -v p="$mg/pool-" '{ f = $2 } index(f, p) == 1 { print $1 }')
  [[ -n "$pools" ]] || return 0
  losetup --list --noheadings -O NAME,BACK-MAJ:MIN 2>/dev/null \
    | awk -v pools="$pools" 'BEGIN { n = split(pools, a, "\n"); for (i = 1; i <= n; i++) p[a[i]] = 1 } ($2 in p) { print $1 }'
}

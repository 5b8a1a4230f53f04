# Sourced by undeploy.sh and down.sh: the loop devices bound to a file on a
# pool's filesystem (the btrfs images pool-<zone>.img of deploy.sh, mounted
# at pools/<zone>), whatever path the kernel names the file by. A device
# bound through a mount that is gone (a node plugin's container since
# restarted) is named relative to that mount's root ("/volumes/..."), so a
# check by path prefix would miss it; it is found by the device of its
# backing file instead. On xfs that is the pool's loop device; on btrfs each
# subvolume has an anonymous device of its own (the volumes live in the
# subvolume volumes/), so every subvolume of a mounted pool is asked.

# pool_bound_loops MG: one device per line.
pool_bound_loops() {
  local mg=${1%/} devs="" name majmin file zone mnt sub
  while read -r name majmin file; do
    [[ "$file" == "$mg/pool-"*.img ]] || continue
    devs+="$majmin"$'\n'
    zone=${file#"$mg/pool-"}; zone=${zone%.img}
    mnt="$mg/pools/$zone"
    findmnt -n -o SOURCE --mountpoint "$mnt" 2>/dev/null | grep -qxF "$name" || continue
    [[ "$(stat -f -c %T "$mnt")" == btrfs ]] || continue
    devs+="$(stat -c '%Hd:%Ld' "$mnt")"$'\n'
    while read -r sub; do
      [[ -n "$sub" ]] && devs+="$(stat -c '%Hd:%Ld' "$mnt/$sub" 2>/dev/null)"$'\n'
    done < <(btrfs subvolume list "$mnt" 2>/dev/null | sed -E 's/^.* path //')
  done < <(losetup --list --noheadings -O NAME,MAJ:MIN,BACK-FILE 2>/dev/null)
  [[ -n "$devs" ]] || return 0
  losetup --list --noheadings -O NAME,BACK-MAJ:MIN 2>/dev/null \
    | awk -v devs="$devs" 'BEGIN { n = split(devs, a, "\n"); for (i = 1; i <= n; i++) if (a[i] != "") p[a[i]] = 1 } ($2 in p) { print $1 }'
}

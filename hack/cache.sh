#!/usr/bin/env bash
# The machine's cache of build artifacts that do not change with the commit
# (Kubernetes' binaries, e2e.test, the CSI sidecars, base images, tools),
# kept outside the clone so that a fresh clone on a machine that built them
# before reuses them. Each artifact is a directory of the cache named by
# what it is and a key: the hash of everything it is built from (the
# scripts that build it, their pinned versions and module files, the Go
# toolchain). Change any of them and the key changes, so the artifact is
# built anew into a new entry; entries of other keys not used for 14 days
# are removed.
#
# A build script sources this file and calls
#   cache_dir NAME DIR INPUT...
# which makes DIR (a path in _build/) a symlink to the entry, creating it
# empty when it is new. The script then builds what is missing in DIR as it
# always did, and finds there what an earlier run built. INPUT is a file
# whose content goes into the key, or a literal word (a version). The entry
# is locked while the script runs, so two clones cannot build into one
# entry at once.
#
# MODEGUARD_CACHE is the cache's directory (/var/cache/modeguard); "off"
# keeps DIR a plain directory of the clone.

cache_root=${MODEGUARD_CACHE:-/var/cache/modeguard}

# cache_key INPUT...: the hash of the inputs and the Go toolchain.
cache_key() {
	{
		go version 2>/dev/null || echo "no go"
		local in
		for in in "$@"; do
			if [[ -f $in ]]; then
				printf 'file %s\n' "$(basename "$in")"
				cat "$in"
			else
				printf 'word %s\n' "$in"
			fi
		done
	} | sha256sum | cut -c1-16
}

cache_dir() {
	local name=$1 dir=$2
	shift 2
	if [[ $cache_root == off ]]; then
		[[ -L $dir ]] && rm -f "$dir"
		mkdir -p "$dir"
		return 0
	fi
	local key entry
	key=$(cache_key "$@")
	entry=$cache_root/$name/$key
	mkdir -p "$entry" "$(dirname "$dir")"
	# Held until the script exits: the descriptor is inherited by nothing
	# that outlives it.
	exec {cache_lock_fd}>"$entry/.lock"
	flock "$cache_lock_fd"
	touch "$entry/.used"
	if [[ -L $dir || ! -e $dir ]]; then
		ln -sfn "$entry" "$dir"
	elif [[ -d $dir ]]; then
		# Built into the clone before the cache existed: keep it, as the
		# entry when that is new.
		if [[ -z $(ls -A "$entry" | grep -v '^\.lock$\|^\.used$') ]]; then
			cp -a "$dir/." "$entry/"
		fi
		rm -rf "$dir"
		ln -sfn "$entry" "$dir"
	fi
	# Other keys of this artifact, unused for two weeks, go.
	local used
	while IFS= read -r used; do
		[[ $(dirname "$used") == "$entry" ]] || rm -rf "$(dirname "$used")"
	done < <(find "$cache_root/$name" -mindepth 2 -maxdepth 2 -name .used ! -newermt '-14 days' 2>/dev/null)
	printf '[cache] %s: %s (key %s)\n' "$name" "$entry" "$key" >&2
}

# ours_exe PID: whether the process runs one of the local cluster's binaries:
# one under _build, or in an entry of the machine's cache that a directory
# of _build links to (hack/cache.sh), where Kubernetes' binaries are. A
# recorded PID counts only while this holds (guards against PID reuse).
# Sourced; needs BUILD.
ours_exe() {
  local exe d
  exe=$(readlink "/proc/$1/exe" 2>/dev/null) || return 1
  for d in "$BUILD" "$BUILD"/*/ "$BUILD"/images/*/; do
    d=$(readlink -f "$d" 2>/dev/null) || continue
    [[ -n $d && "$exe" == "$d/"* ]] && return 0
  done
  return 1
}

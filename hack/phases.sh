#!/usr/bin/env bash
# Runs make targets as named phases, one after the other, and ends with a
# table of them: how long each took, how much of the machine's CPU it left
# idle (a phase that leaves much idle mostly waits: on emulation's timers,
# grace periods, a cluster), and how it ended. Every phase runs, even after
# one failed, so that one log shows every failure and where all the time
# went; the exit status is 1 if any phase failed.
#
# Usage: hack/phases.sh TITLE NAME=TARGET [NAME=TARGET...]
# Environment: MAKE (make), PHASES_FILE (also write the table there).
set -uo pipefail

title=$1
shift
MAKE=${MAKE:-make}

# cpu_sample prints "idle total" jiffies of all CPUs (iowait counts as idle).
cpu_sample() {
	awk '/^cpu / { idle = $5 + $6; total = 0; for (i = 2; i <= NF; i++) total += $i; print idle, total; exit }' /proc/stat
}

names=() secs=() idles=() results=()
failed=0
start_all=$(date +%s)
for phase in "$@"; do
	name=${phase%%=*} target=${phase#*=}
	printf '\n=== phase %s (make %s) started %s\n' "$name" "$target" "$(date +%T)"
	read -r idle0 total0 < <(cpu_sample)
	t0=$(date +%s)
	if $MAKE --no-print-directory "$target"; then
		result=ok
	else
		result=FAILED
		failed=1
	fi
	t1=$(date +%s)
	read -r idle1 total1 < <(cpu_sample)
	idle=-
	if ((total1 > total0)); then
		idle=$(((idle1 - idle0) * 100 / (total1 - total0)))%
	fi
	names+=("$name") secs+=($((t1 - t0))) idles+=("$idle") results+=("$result")
	printf '=== phase %s %s after %d s\n' "$name" "$result" $((t1 - t0))
done
total=$(($(date +%s) - start_all))

minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

table() {
	printf '\n%s: phases (commit %s, %s)\n' "$title" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" "$(date -u +%FT%TZ)"
	printf '%-16s %9s %8s %9s  %s\n' phase seconds minutes 'cpu idle' result
	for i in "${!names[@]}"; do
		printf '%-16s %9d %8s %9s  %s\n' "${names[$i]}" "${secs[$i]}" "$(minutes "${secs[$i]}")" "${idles[$i]}" "${results[$i]}"
	done
	printf '%-16s %9d %8s\n' total "$total" "$(minutes "$total")"
}
table
if [[ -n ${PHASES_FILE:-} ]]; then
	table >"$PHASES_FILE"
fi
exit $failed

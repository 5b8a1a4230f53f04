#!/usr/bin/env bash
# Runs make targets as named phases, one after the other, and ends with a
# table of them: how long each took, how much of the machine's CPU it left
# idle (a phase that leaves much idle mostly waits: on emulation's timers,
# grace periods, a cluster), and how it ended. Every phase runs, even after
# one failed, so that one log shows every failure and where all the time
# went; the exit status is 1 if any phase failed.
#
# A phase written bg:NAME=TARGET starts in the background and goes on
# beside the phases that follow (builds that only need the CPU the tests
# leave idle); wait:NAME waits for it there and prints its output. Its row
# in the table gives its own duration (and the CPU left idle from its
# start until it was waited for); the wait's row how long the phases after
# it waited for it.
#
# Usage: hack/phases.sh TITLE PHASE...   PHASE: NAME=TARGET | bg:NAME=TARGET | wait:NAME
# Environment: MAKE (make), PHASES_FILE (also write the table there).
set -uo pipefail

title=$1
shift
MAKE=${MAKE:-make}

# cpu_sample prints "idle total" jiffies of all CPUs (iowait counts as idle).
cpu_sample() {
	awk '/^cpu / { idle = $5 + $6; total = 0; for (i = 2; i <= NF; i++) total += $i; print idle, total; exit }' /proc/stat
}
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

names=() secs=() idles=() results=()
failed=0
# record NAME SECONDS IDLE RESULT
record() {
	names+=("$1") secs+=("$2") idles+=("$3") results+=("$4")
	[[ $4 == ok ]] || failed=1
}
idle_since() { # IDLE0 TOTAL0 -> percent idle since then
	local idle1 total1
	read -r idle1 total1 < <(cpu_sample)
	if ((total1 > $2)); then echo "$(((idle1 - $1) * 100 / (total1 - $2)))%"; else echo -; fi
}

declare -A bg_pid bg_log bg_start bg_idle0 bg_total0
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
start_all=$(date +%s)
for phase in "$@"; do
	case $phase in
	bg:*)
		spec=${phase#bg:} name=${spec%%=*} target=${spec#*=}
		printf '\n=== phase %s (make %s) started %s in the background\n' "$name" "$target" "$(date +%T)"
		bg_log[$name]=$workdir/$name.log
		bg_start[$name]=$(date +%s)
		read -r "bg_idle0[$name]" "bg_total0[$name]" < <(cpu_sample)
		# Its own end is written down when it comes, not when it is
		# waited for.
		( $MAKE --no-print-directory "$target" >"${bg_log[$name]}" 2>&1
		  rc=$?
		  date +%s >"$workdir/$name.end"
		  exit $rc ) &
		bg_pid[$name]=$!
		continue
		;;
	wait:*)
		name=${phase#wait:}
		printf '\n=== waiting for phase %s since %s\n' "$name" "$(date +%T)"
		t0=$(date +%s)
		if wait "${bg_pid[$name]}"; then result=ok; else result=FAILED; fi
		t1=$(date +%s)
		end=$(cat "$workdir/$name.end" 2>/dev/null || echo "$t1")
		printf '=== output of phase %s:\n' "$name"
		cat "${bg_log[$name]}"
		printf '=== phase %s %s after %d s\n' "$name" "$result" $((end - bg_start[$name]))
		record "$name (bg)" $((end - bg_start[$name])) "$(idle_since "${bg_idle0[$name]}" "${bg_total0[$name]}")" "$result"
		record "wait $name" $((t1 - t0)) - ok
		continue
		;;
	esac
	name=${phase%%=*} target=${phase#*=}
	printf '\n=== phase %s (make %s) started %s\n' "$name" "$target" "$(date +%T)"
	read -r idle0 total0 < <(cpu_sample)
	t0=$(date +%s)
	if $MAKE --no-print-directory "$target"; then result=ok; else result=FAILED; fi
	t1=$(date +%s)
	record "$name" $((t1 - t0)) "$(idle_since "$idle0" "$total0")" "$result"
	printf '=== phase %s %s after %d s\n' "$name" "$result" $((t1 - t0))
done
total=$(($(date +%s) - start_all))

table() {
	printf '\n%s: phases (commit %s, %s)\n' "$title" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" "$(date -u +%FT%TZ)"
	printf '%-18s %9s %8s %9s  %s\n' phase seconds minutes 'cpu idle' result
	for i in "${!names[@]}"; do
		printf '%-18s %9d %8s %9s  %s\n' "${names[$i]}" "${secs[$i]}" "$(minutes "${secs[$i]}")" "${idles[$i]}" "${results[$i]}"
	done
	printf '%-18s %9d %8s\n' total "$total" "$(minutes "$total")"
}
table
if [[ -n ${PHASES_FILE:-} ]]; then
	table >"$PHASES_FILE"
fi
exit $failed

#!/usr/bin/env python3
"""Per-suite counts of a Ginkgo JUnit report of the external storage suites.

Usage: summary.py junit.xml [--failed] [--skipped]

Prints one row per suite (passed, failed, skipped) and the totals; with
--failed / --skipped also the names of those specs, with the reason the
report gives for a skip (what docs/conformance.md explains).
"""
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

NAME = re.compile(r"\[Testpattern: ([^\]]*)\] (\S+) (.*)")


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    root = ET.parse(argv[0]).getroot()
    counts = defaultdict(Counter)
    listed = defaultdict(list)
    for tc in root.iter("testcase"):
        m = NAME.search(tc.get("name", ""))
        if not m:
            continue  # the suite's own before/after nodes
        pattern, suite, spec = m.groups()
        if tc.find("failure") is not None or tc.find("error") is not None:
            state = "failed"
        elif tc.find("skipped") is not None:
            state = "skipped"
        else:
            state = "passed"
        reason = ""
        sk = tc.find("skipped")
        if sk is not None:
            message = (sk.get("message") or "").strip()
            if message in ("", "skipped"):
                continue  # filtered out by --focus/--skip: never started
            reason = message.replace("skipped - ", "", 1)
        counts[suite][state] += 1
        listed[state].append(f"{suite} [{pattern}] {spec}" + (f"  -- {reason}" if reason else ""))
    total = Counter()
    print(f"{'suite':24} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for suite in sorted(counts):
        c = counts[suite]
        total.update(c)
        print(f"{suite:24} {c['passed']:7} {c['failed']:7} {c['skipped']:8}")
    print(f"{'total':24} {total['passed']:7} {total['failed']:7} {total['skipped']:8}")
    for state in ("failed", "skipped"):
        if f"--{state}" in argv:
            print(f"\n{state}:")
            for line in sorted(listed[state]):
                print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

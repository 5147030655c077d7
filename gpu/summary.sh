#!/usr/bin/env bash
# Summarise a test log of .gpu/run.sh (default $OUT/gpu-run.log): the totals over every test
# executable, each failed test and its panic line (cut to 300 characters), and the SKIP lines
# (which VMM_REQUIRE_GPU=1 turns into failures). Short enough to read in a tool's output tail.
#   bash gpu/summary.sh [LOG]
log=${1:-${OUT:-/tmp/gpu-out}/gpu-run.log}
grep -aE '^test result' "$log" | awk '{p+=$4; f+=$6; i+=$8} END {printf "passed %d failed %d ignored %d\n", p, f, i}'
grep -aE '^=== ' "$log" | wc -l | sed 's/^/executables and examples run: /'
grep -aE '^test .* FAILED$|^    [a-z_:0-9]+$' "$log" | cut -c1-200 | sort -u | head -40
grep -aE 'panicked at|^Error|FAILED \(|^FAIL:|^ERROR:' "$log" | cut -c1-300 | head -30
grep -aE '^SKIP' "$log" | cut -c1-200 | sort | uniq -c | head -20
grep -aE 'gpu run exit status' "$log"

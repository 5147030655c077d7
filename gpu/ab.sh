#!/usr/bin/env bash
# Runs on the GPU machine: a same-lease A/B of two staged bench executables, alternating which
# runs first in each round, so drift falls on both alike. Each run writes its own criterion
# directory and vmm-bench-report.json (in its parent: what every build writes) under
# $OUT/ab/<build>-<round>/; compare.py (beside this
# script) prints, per figure, both builds' medians in every round and the ratio of their medians.
# Stage with `AB_BASE=<exe> bash gpu/stage.sh`; run `bash .gpu/run.sh` once (it unpacks), or
# `tar -C .gpu -xzf .gpu/executables.tar.gz`, then:
# Usage: bash .gpu/ab.sh NEW_EXE BASE_EXE ROUNDS [criterion args, e.g. --warm-up-time 1 FILTER]
set -uo pipefail
new=$1 base=$2 rounds=$3; shift 3
out=${OUT:-/tmp/gpu-out}/ab; mkdir -p "$out"
export VMM_REQUIRE_GPU=1
maj=$(awk '/nvidia-caps-imex-channels/ {print $1}' /proc/devices 2>/dev/null)
if [ -n "$maj" ] && [ "$(id -u)" = 0 ] && [ ! -e /dev/nvidia-caps-imex-channels/channel0 ]; then
  mkdir -p /dev/nvidia-caps-imex-channels && mknod /dev/nvidia-caps-imex-channels/channel0 c "$maj" 0
fi
for round in $(seq 1 "$rounds"); do
  if [ $((round % 2)) = 1 ]; then order="new base"; else order="base new"; fi
  for build in $order; do
    exe=$new; [ "$build" = base ] && exe=$base
    dir="$out/$build-$round"; mkdir -p "$dir"
    echo "=== round $round: $build ($exe) $(date +%T)"
    CRITERION_HOME="$dir/criterion" "$exe" --bench "$@" > "$dir/log" 2>&1 || echo "exit status $? ($build, round $round)"
    grep -E '^\| |SKIP' "$dir/log" | head -80
  done
done

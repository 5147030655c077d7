#!/usr/bin/env bash
# Runs on the GPU machine, as .gpu/run.sh (gpu/stage.sh puts it there): every staged test
# executable (and, if asked, every bench executable) with GPU skips turned into failures.
# Logs go to $OUT (default /tmp/gpu-out): gpu-run.log, and criterion.tar.gz after benches.
# Usage: bash .gpu/run.sh [tests|benches|peers|all] [args passed to each executable]
#   tests: libtest args (a name filter, --test-threads N); benches: criterion args; peers: the
#   raw-driver floor and the Python peers from anchors/, staged only where the team's shared/
#   directory was present (nvcc and python3 needed here).
set -uo pipefail
what=${1:-tests}; shift || true
case "$what" in tests|benches|peers|all) ;; *) echo "usage: bash .gpu/run.sh [tests|benches|peers|all] [args]" >&2; exit 2;; esac
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
export VMM_REQUIRE_GPU=1 RUST_BACKTRACE=1
# Fabric handles need an IMEX channel; the GPU test machine has the driver's major but no node. As root,
# create channel0 (a device node only; no GPU setting changes).
maj=$(awk '/nvidia-caps-imex-channels/ {print $1}' /proc/devices 2>/dev/null)
if [ -n "$maj" ] && [ "$(id -u)" = 0 ] && [ ! -e /dev/nvidia-caps-imex-channels/channel0 ]; then
  mkdir -p /dev/nvidia-caps-imex-channels && mknod /dev/nvidia-caps-imex-channels/channel0 c "$maj" 0
fi
cd "$(dirname "$0")"
# stage.sh ships the executables gzipped.
if [ -f executables.tar.gz ]; then
  rm -rf tests benches examples base && tar -xzf executables.tar.gz
fi
{
  echo "commit $(cat COMMIT 2>/dev/null)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  status=0
  if [ "$what" = tests ] || [ "$what" = all ]; then
    # VMM_GPU_TESTS (a glob over tests/, e.g. '*memd*' or 'gpu_regions-test') runs fewer.
    for t in tests/${VMM_GPU_TESTS:-*}; do
      [ -x "$t" ] || continue
      echo "=== $t"
      "$t" "$@" || status=1
    done
    # The fabric example over mutual TLS: Rust to Rust, Rust to Python, Python to Rust (from the
    # repository root, where examples/python and python/ are).
    if [ -x examples/fabric_tcp ]; then
      for peer in "--peer rust" "--peer python" "--python-exports"; do
        echo "=== examples/fabric_tcp $peer"
        # shellcheck disable=SC2086
        (cd .. && .gpu/examples/fabric_tcp $peer) || status=1
      done
    fi
  fi
  if [ "$what" = benches ] || [ "$what" = all ]; then
    export CRITERION_HOME="$PWD/criterion"
    for b in benches/*; do
      [ -x "$b" ] || continue
      echo "=== $b"
      "$b" --bench "$@" || status=1
    done
    [ -d criterion ] && tar czf "$out/criterion.tar.gz" criterion
  fi
  if [ "$what" = peers ] || [ "$what" = all ]; then
    echo "=== peers"
    if [ -f anchors/run.sh ]; then
      bash anchors/run.sh || status=1
    else
      echo "no anchors staged: .gpu/anchors/ is absent (gpu/stage.sh copies it only from the team's ../shared/anchors)"
      # Asked for by name, nothing to run is a failure; as part of `all`, it is a note.
      [ "$what" = peers ] && status=1
    fi
  fi
  echo "gpu run exit status: $status"
  exit $status
} 2>&1 | tee "$out/gpu-run.log"

#!/usr/bin/env bash
# Runs on the GPU machine, as root, as .gpu-netns/run.sh (gpu/stage-netns.sh puts it there): the
# two-node registry runs of vmm-registry with GPU skips turned into failures, etcd the staged one.
# Logs go to $OUT (default /tmp/gpu-out): gpu-netns-run.log.
# Usage: bash .gpu-netns/run.sh [all|host|memd|fabric] [args for memd_fabric_netns]
#   host:   memd_fabric_netns --host (the same two nodes with a host-memory region: no GPU used)
#   memd:   memd_fabric_netns (a GPU region of vmm-memd published by vmm-memd-publish on node A,
#           imported as fabric handles on node B, and again after the service's restart)
#   fabric: fabric_netns (an exporter's own fabric buffer, without the memory service)
#   all (default): host, memd, fabric, in that order.
set -uo pipefail
what=${1:-all}; shift || true
case "$what" in all|host|memd|fabric) ;; *) echo "usage: bash .gpu-netns/run.sh [all|host|memd|fabric] [args]" >&2; exit 2;; esac
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
export VMM_REQUIRE_GPU=1 RUST_BACKTRACE=1
# Fabric handles need an IMEX channel; the GPU test machine has the driver's major but no node. As root,
# create channel0 (a device node only; no GPU setting changes).
maj=$(awk '/nvidia-caps-imex-channels/ {print $1}' /proc/devices 2>/dev/null)
if [ -n "$maj" ] && [ "$(id -u)" = 0 ] && [ ! -e /dev/nvidia-caps-imex-channels/channel0 ]; then
  mkdir -p /dev/nvidia-caps-imex-channels && mknod /dev/nvidia-caps-imex-channels/channel0 c "$maj" 0
fi
cd "$(dirname "$0")"
# stage-netns.sh ships the executables gzipped.
if [ -f netns.tar.gz ]; then
  rm -rf bin && tar -xzf netns.tar.gz
fi
export VMM_ETCD_BIN="$PWD/bin/etcd"
# The machine's `ip`, else the staged one through the machine's loader (no LD_LIBRARY_PATH, so
# the programs `ip netns exec` starts load nothing of it).
if ! command -v ip >/dev/null && [ -x bin/iproute2/ip ]; then
  mkdir -p bin/path
  printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s/bin/iproute2/lib %s/bin/iproute2/ip "$@"\n' \
    "$PWD" "$PWD" > bin/path/ip
  chmod +x bin/path/ip
  export PATH="$PWD/bin/path:$PATH"
fi
{
  echo "commit $(cat COMMIT 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "ip: $(command -v ip) ($(ip -V 2>&1)); etcd: $VMM_ETCD_BIN ($("$VMM_ETCD_BIN" --version 2>&1 | head -1))"
  ls -l /dev/nvidia-caps-imex-channels 2>&1
  status=0
  if [ "$what" = all ] || [ "$what" = host ]; then
    echo "=== memd_fabric_netns --host"
    bin/memd_fabric_netns --host || status=1
  fi
  if [ "$what" = all ] || [ "$what" = memd ]; then
    echo "=== memd_fabric_netns $*"
    bin/memd_fabric_netns "$@" || status=1
  fi
  if [ "$what" = all ] || [ "$what" = fabric ]; then
    echo "=== fabric_netns"
    bin/fabric_netns || status=1
  fi
  echo "gpu-netns run exit status: $status"
  exit $status
} 2>&1 | tee "$out/gpu-netns-run.log"

#!/usr/bin/env bash
# Stage the two-node registry runs for the GPU machine (issue 32 item 5) apart from gpu/stage.sh
# (whose .gpu/ is close to the 64 MiB a carried tree may hold): the examples memd_fabric_netns
# and fabric_netns of vmm-registry (release, stripped; they play vmm-memd and vmm-memd-publish
# themselves), an etcd server binary, a fallback copy of iproute2's `ip`, and run.sh, under
# .gpu-netns/ in the repository root (git-ignored). No GPU needed here.
# Usage (from anywhere):  bash gpu/stage-netns.sh    (etcd: $VMM_ETCD_BIN, else `command -v etcd`)
# Then, on the GPU machine, as root, from a copy of the repository root with .gpu-netns/ in it:
#   bash .gpu-netns/run.sh [all|host|memd|fabric] [args for memd_fabric_netns]
# With the device tool: carry [".gpu-netns"] (and not .gpu: each carry is 64 MiB at most).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
etcd=${VMM_ETCD_BIN:-$(command -v etcd || true)}
if [ -z "$etcd" ] || [ ! -x "$etcd" ]; then
  echo "stage-netns.sh needs an etcd server binary: set VMM_ETCD_BIN or install etcd-server" >&2
  exit 1
fi
rm -rf .gpu-netns && mkdir -p .gpu-netns/bin   # .gpu-netns/ is git-ignored
# Small, symbol-free binaries, as gpu/stage.sh builds them.
export CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols
cargo build --release -p vmm-registry --example memd_fabric_netns --example fabric_netns
target=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
cp "$target/release/examples/memd_fabric_netns" "$target/release/examples/fabric_netns" .gpu-netns/bin/
# etcd is a Go program linked only against libc: it runs as it is.
cp -L "$etcd" .gpu-netns/bin/etcd
echo "etcd: $etcd ($("$etcd" --version 2>/dev/null | head -1))"
# `ip` (iproute2), for a machine without it: the binary and the libraries it needs besides
# glibc's, run through the machine's own loader (run.sh uses it only where `ip` is missing).
if ip=$(command -v ip); then
  ip=$(readlink -f "$ip")
  mkdir -p .gpu-netns/bin/iproute2/lib
  cp "$ip" .gpu-netns/bin/iproute2/ip
  ldd "$ip" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
    xargs -r cp -L -t .gpu-netns/bin/iproute2/lib/
else
  echo "no ip here: staging without the iproute2 fallback"
fi
cp "$here/run-netns.sh" .gpu-netns/run.sh
# The commit the executables were built from; "+dirty" when tracked files had uncommitted changes.
if commit=$(git rev-parse HEAD 2>/dev/null); then
  git diff --quiet HEAD 2>/dev/null || commit="$commit+dirty"
  echo "$commit" > .gpu-netns/COMMIT
fi
ls -la .gpu-netns/bin
# They travel gzipped (run.sh unpacks them).
tar -C .gpu-netns -czf .gpu-netns/netns.tar.gz bin
rm -rf .gpu-netns/bin
size=$(du -sm .gpu-netns | cut -f1)
echo "staged ${size} MiB under .gpu-netns/ (a carry holds 64 MiB at most)"
[ "$size" -lt 60 ] || { echo "too large to carry" >&2; exit 1; }
echo 'next, on the GPU machine, as root: bash .gpu-netns/run.sh   (logs in $OUT, default /tmp/gpu-out)'

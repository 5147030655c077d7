#!/usr/bin/env bash
# Build the workspace's test and bench executables here (release, stripped; no GPU needed) and
# stage them, with run.sh, under .gpu/ in the repository root, for a GPU machine that has no Rust
# toolchain: copy the repository root with .gpu/ there and run `bash .gpu/run.sh`.
# Usage (from anywhere):  bash gpu/stage.sh [cargo args, e.g. -p vmm-tests]
# Then, on the GPU machine, from that copy:  bash .gpu/run.sh [tests|benches|peers|all] [args]
# Needs cargo, git and jq. The raw-driver and Python anchors (`peers`) are staged only where a
# sibling checkout of the team's shared/ directory exists (../shared/anchors).
# vmm-registry's two-node runs (they need etcd) are staged apart, under .gpu-netns/, by
# gpu/stage-netns.sh; run them there with `bash .gpu-netns/run.sh` (gpu/run-netns.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
command -v jq >/dev/null || { echo "stage.sh needs jq (it reads cargo's JSON messages): install it first" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/tests .gpu/benches .gpu/examples   # .gpu/ is git-ignored
# Small, symbol-free binaries: a carried tree may be limited (the team's is 64 MiB).
export CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols
export CARGO_PROFILE_BENCH_DEBUG=false CARGO_PROFILE_BENCH_STRIP=symbols
stage() { # $1 = tests|benches; reads cargo's JSON messages on stdin
  jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test == true)
      | "\(.target.name)\t\(.target.kind[0])\t\(.executable)"' |
  while IFS=$'\t' read -r name kind exe; do
    if [ "$1" = benches ] && [ "$kind" != bench ]; then continue; fi
    # Not for the GPU machine: the registry bench needs etcd (not carried), the tests of the
    # GPU path on the fake driver (vmm-fake-driver) test it without a GPU, in CI, and
    # vmm-etcd-api's drift test (`generated`, 6.7 MB) needs the checkout's proto/ and protoc.
    case "$name" in registry|hashing_races|python_fake_gpu|generated) continue;; esac
    if [ "$1" = tests ] && [ "$kind" = bench ]; then continue; fi
    cp "$exe" ".gpu/$1/${name}-${kind}"
  done
}
# vmm-registry's tests need an etcd server binary, which the GPU machine lacks (and under
# VMM_REQUIRE_GPU=1 their skip is a failure): they are not staged until a run carries etcd.
cargo test --workspace --exclude vmm-registry --release --no-run --message-format=json-render-diagnostics "$@" | stage tests
cargo bench --workspace --exclude vmm-registry --no-run --message-format=json-render-diagnostics "$@" | stage benches
# Where cargo puts what it builds (CARGO_TARGET_DIR or the workspace's target/).
target=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
# The examples run.sh runs on the GPU (the fabric example over mutual TLS, to Rust and Python).
mkdir -p .gpu/examples
cargo build --release -p vmm-core --features tls --example fabric_tcp
cp "$target/release/examples/fabric_tcp" .gpu/examples/fabric_tcp
# The service's own programs (the GMS comparison in vmm-bench/gms/ runs the real vmm-memd).
cargo build --release -p vmm-memd --bins
mkdir -p .gpu/examples/bin
cp "$target/release/vmm-memd" "$target/release/vmm-memctl" .gpu/examples/bin/
cp "$here/run.sh" .gpu/run.sh
# An A/B in one lease (ab.sh, compare.py): AB_BASE=<a bench executable of another build> stages
# it as .gpu/base/vmm-bench beside this build's.
cp "$here/ab.sh" "$here/compare.py" .gpu/
if [ -n "${AB_BASE:-}" ]; then
  mkdir -p .gpu/base && cp "$AB_BASE" .gpu/base/vmm-bench
fi
anchors="$root/../shared/anchors"
if [ -d "$anchors" ]; then
  cp -r "$anchors" .gpu/anchors
  echo "staged the anchors from $anchors"
else
  echo "no $anchors here: staging without anchors (run.sh peers will say so)"
fi
# The commit the executables were built from; "+dirty" when tracked files had uncommitted changes.
if commit=$(git rev-parse HEAD 2>/dev/null); then
  git diff --quiet HEAD 2>/dev/null || commit="$commit+dirty"
  echo "$commit" > .gpu/COMMIT
fi
ls -la .gpu/tests .gpu/benches
# The executables travel gzipped (run.sh unpacks them): the carried tree is limited to 64 MiB.
extra=(); [ -d .gpu/base ] && extra=(base)
tar -C .gpu -czf .gpu/executables.tar.gz tests benches examples "${extra[@]}"
rm -rf .gpu/tests .gpu/benches .gpu/examples .gpu/base
size=$(du -sm .gpu | cut -f1)
echo "staged ${size} MiB under .gpu/ (keep it under 60 MiB so it can travel)"
[ "$size" -lt 60 ] || { echo "too large to carry: stage fewer targets (cargo args such as -p NAME)" >&2; exit 1; }
echo 'next, on the GPU machine: bash .gpu/run.sh tests   (or benches, peers, all)'

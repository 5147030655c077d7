#!/usr/bin/env bash
# Recreates .gms-carry/ at the repository root: what compare.py needs on the GPU machine (which
# has no network) to run NVIDIA Dynamo's GPU Memory Service (GMS) unmodified beside vmm-memd.
#
#   .gms-carry/gpu_memory_service/   Dynamo's lib/gpu_memory_service at COMMIT, byte for byte
#                                    (Apache-2.0; run from PYTHONPATH=.gms-carry, not installed)
#   .gms-carry/LICENSE               Dynamo's LICENSE at the same commit
#   .gms-carry/COMMIT                the commit and where it came from
#   .gms-carry/wheels/msgspec-*.whl  GMS's one dependency the GPU image lacks (uvloop is there;
#                                    pynvml is not needed: compare.py passes --socket-path)
#
# Usage (on a machine with PyPI): bash vmm-bench/gms/carry.sh DYNAMO [COMMIT]
#   DYNAMO: a git clone of ai-dynamo/dynamo (or a fork holding COMMIT), a working tree or a bare
#           repository; or a URL git can clone (then cloned blobless into a temporary folder).
#   COMMIT: default df888f6860e247b5a16039d659db61cd64a9d2d7 (the commit ANCHORS.md measured).
# Nothing here is committed: the folder is ignored (.gitignore) and travels with the device
# tool's `carry` (it stays well under 1 MiB).
set -euo pipefail
src=${1:?usage: bash vmm-bench/gms/carry.sh DYNAMO_GIT_DIR_OR_URL [COMMIT]}
commit=${2:-df888f6860e247b5a16039d659db61cd64a9d2d7}
msgspec=${MSGSPEC_VERSION:-0.23.0}
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=$root/.gms-carry
tmp=

cleanup() { [ -z "$tmp" ] || rm -rf "$tmp"; }
trap cleanup EXIT

if [ -d "$src" ]; then
  git_dir=$src
else
  tmp=$(mktemp -d)
  git clone --quiet --filter=blob:none --no-checkout "$src" "$tmp/dynamo"
  git_dir=$tmp/dynamo
fi
full=$(git -C "$git_dir" rev-parse --verify "$commit^{commit}")
echo "GMS source: $src at $full"

rm -rf "$out"
mkdir -p "$out/gpu_memory_service" "$out/wheels"
# File by file (git show), so a partial clone or a mirror with unrelated blobs missing works.
count=0
while IFS= read -r path; do
  rel=${path#lib/gpu_memory_service/}
  mkdir -p "$out/gpu_memory_service/$(dirname "$rel")"
  git -C "$git_dir" show "$full:$path" > "$out/gpu_memory_service/$rel"
  count=$((count + 1))
done < <(git -C "$git_dir" ls-tree -r --name-only "$full" -- lib/gpu_memory_service)
[ "$count" -gt 0 ] || { echo "no lib/gpu_memory_service at $full" >&2; exit 1; }
git -C "$git_dir" show "$full:LICENSE" > "$out/LICENSE"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$out/gpu_memory_service/pyproject.toml" | head -1)
printf 'commit %s\nsource %s\npath lib/gpu_memory_service (%s files, version %s), unmodified\n' \
  "$full" "$src" "$count" "$version" > "$out/COMMIT"

python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out/wheels" "msgspec==$msgspec"
ls "$out/wheels"/msgspec-*.whl > /dev/null

cat "$out/COMMIT"
echo "wheels: $(cd "$out/wheels" && ls)"
echo "carried folder: $out ($(du -sh "$out" | cut -f1))"
echo "GMS commit used: $full"

#!/usr/bin/env bash
# On the GPU machine (no network), from a copy of the project root that holds .gms-carry/
# (vmm-bench/gms/carry.sh made it) and a vmm-memd binary (default .gpu/examples/bin/vmm-memd,
# which gpu/stage.sh stages in .gpu/executables.tar.gz: unpacked here when needed):
# installs the carried msgspec wheel into /tmp/site (GMS itself runs from PYTHONPATH, not
# installed: its C++ allocator extension is only for torch's pluggable allocator, unused here),
# then runs compare.py. Results go to $OUT: gms-compare.md (the table), gms-compare.json (every
# sample), gms-compare.log (everything printed).
#   bash vmm-bench/gms/run.sh [compare.py run options, e.g. --repeat 3 --only gms]
# Environment: VMM_MEMD_BIN (the binary), GMS_CARRY (the carried folder), GMS_SITE (where
# the wheels go, /tmp/site), OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-/tmp/gms-out}
mkdir -p "$out"
carry=${GMS_CARRY:-$root/.gms-carry}
memd=${VMM_MEMD_BIN:-$root/.gpu/examples/bin/vmm-memd}
if [ ! -e "$memd" ] && [ -f "$root/.gpu/executables.tar.gz" ]; then
  tar -C "$root/.gpu" -xzf "$root/.gpu/executables.tar.gz"
fi
site=${GMS_SITE:-/tmp/site}
[ -d "$carry/gpu_memory_service" ] || { echo "no $carry/gpu_memory_service: run vmm-bench/gms/carry.sh where there is network" >&2; exit 2; }
[ -x "$memd" ] || chmod +x "$memd" 2>/dev/null || true
[ -x "$memd" ] || { echo "no vmm-memd binary at $memd (set VMM_MEMD_BIN)" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$carry"/wheels/*.whl || exit 2
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  echo "== GMS: $(head -1 "$carry/COMMIT" 2>/dev/null); vmm-memd: $memd ($(cat .gpu/COMMIT 2>/dev/null || echo '?'))"
  python3 -c 'import sys, msgspec, uvloop, torch, cuda.bindings; print("== python", sys.version.split()[0], "torch", torch.__version__, "msgspec", msgspec.__version__, "cuda available", torch.cuda.is_available())'
  PYTHONPATH=$carry:$PYTHONPATH python3 -c 'import gpu_memory_service.client.memory_manager, gpu_memory_service.server.rpc' || exit 2
  time python3 vmm-bench/gms/compare.py run --memd "$memd" --gms-carry "$carry" --out "$out" "$@"
} 2>&1 | tee "$out/gms-compare.log"
exit "${PIPESTATUS[0]}"

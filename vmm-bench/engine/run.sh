#!/usr/bin/env bash
# On the GPU machine (no network), from a copy of the project root that holds a vmm-memd binary
# (default .gpu/examples/bin/vmm-memd, which gpu/stage.sh stages in .gpu/executables.tar.gz:
# unpacked here when needed): runs ready.py (restart to ready for the 1B model: vmm-memd,
# safetensors in the page cache, pinned host memory). python3 needs torch (CUDA),
# transformers, safetensors and cuda.bindings; python/ gives vmm_memd, vmm_ipc_cuda and
# vmm_ipc_peer. Results go to $OUT: engine-ready.md (the table), engine-ready.json (every
# sample), engine-ready.log (everything printed).
#   bash vmm-bench/engine/run.sh [ready.py run options, e.g. --repeat 3 --exec-repeat 0]
# Environment: VMM_MEMD_BIN (the binary), OUT (default /tmp/engine-ready), READY_TIMEOUT
# (seconds for the whole run, default 580: ready.py starts no sample past its --deadline, 540).
# Every process ready.py starts dies with it (PR_SET_PDEATHSIG); timeout(1) signals the whole
# process group past READY_TIMEOUT, and ready.py stops the service and writes what it has.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-/tmp/engine-ready}
mkdir -p "$out"
memd=${VMM_MEMD_BIN:-$root/.gpu/examples/bin/vmm-memd}
if [ ! -e "$memd" ] && [ -f "$root/.gpu/executables.tar.gz" ]; then
  tar -C "$root/.gpu" -xzf "$root/.gpu/executables.tar.gz"
fi
[ -x "$memd" ] || chmod +x "$memd" 2>/dev/null || true
[ -x "$memd" ] || { echo "no vmm-memd binary at $memd (set VMM_MEMD_BIN)" >&2; exit 2; }
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cuda=1
for arg in "$@"; do [ "$arg" = --cpu ] && cuda=0; done
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  echo "== vmm-memd: $memd ($(cat .gpu/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo "== free: /tmp $(df -h --output=avail /tmp | tail -1 | tr -d ' '), /dev/shm $(df -h --output=avail /dev/shm | tail -1 | tr -d ' ')"
  if [ "$cuda" = 1 ]; then
    python3 -c 'import sys, torch, transformers, safetensors, cuda.bindings, vmm_memd, vmm_ipc_cuda; print("== python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "safetensors", safetensors.__version__, "cuda available", torch.cuda.is_available())' || exit 2
  else
    python3 -c 'import sys, torch, transformers, safetensors, vmm_memd; print("== python", sys.version.split()[0], "torch", torch.__version__, "(dry run)")' || exit 2
  fi
  time timeout -k 10 "${READY_TIMEOUT:-580}" \
    python3 vmm-bench/engine/ready.py run --memd "$memd" --out "$out" "$@"
} 2>&1 | tee "$out/engine-ready.log"
exit "${PIPESTATUS[0]}"

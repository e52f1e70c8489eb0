#!/usr/bin/env bash
# The one GPU script: everything in the project that needs a GPU, in one run time-boxed to 12 minutes.
#
#     bash tests/gpu/run_gpu_checks.sh          # results: $OUT/gpu_checks.json (default runs/gpu_checks)
#
# Works on a bare machine with python3, torch and pip and no network: it installs the project
# offline first (pip editable, no dependencies, no build isolation; if pip cannot build it, a
# meta-path finder for this checkout through a .pth file), prints the versions it finds, then runs
# tests/gpu/gpu_checks.py: one line per item (CUDA-path tests, NCCL smoke run, MFU and longest
# sequence, sharded-state modes, TE / flash-attn, the block kernels vs SDPA / flex, the one-process
# ring rehearsal), a JSON file and a table. Without CUDA it skips the GPU items with one line each
# and exits 0 (the CPU rehearsal: tests/gpu/test_rehearsal.py).
# Environment: PYTHON (default python3), OUT, GPU_CHECKS_BUDGET_S (default 720), GPU_CHECKS_ONLY
# (default every item; e.g. cuda,schemas,kernels,rehearsal: see tests/gpu/gpu_checks.py).
set -u
cd "$(dirname "$0")/../.." || exit 2
export GPU_CHECKS_START="${GPU_CHECKS_START:-$(date +%s)}"
export GPU_CHECKS_BUDGET_S="${GPU_CHECKS_BUDGET_S:-720}"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-runs/gpu_checks}"
mkdir -p "$OUT_DIR"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found on PATH; set PYTHON to the interpreter that has torch." >&2
    exit 2
fi
echo "== $(command -v "$PY"): $("$PY" --version 2>&1)"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo "== install (offline): $PY -m pip install --no-deps --no-build-isolation -e ."
t0=$(date +%s)
install=pip-editable
if ! PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 \
        timeout 180 "$PY" -m pip install --no-deps --no-build-isolation --no-input -q -e . \
        > "$OUT_DIR/pip_install.log" 2>&1; then
    echo "   pip could not install it ($OUT_DIR/pip_install.log); using the checkout finder instead"
    grep -i "error" "$OUT_DIR/pip_install.log" \
        | grep -viE "subprocess-exited|metadata-generation|encountered error|originates" \
        | head -n 2 | sed 's/^ */   | /'
    install=fallback
    timeout 120 "$PY" tests/gpu/gpu_checks.py --install-fallback || install=failed
fi
echo "   install: $install ($(( $(date +%s) - t0 )) s)"
left=$(( GPU_CHECKS_BUDGET_S - ($(date +%s) - GPU_CHECKS_START) ))
[ "$left" -lt 60 ] && left=60            # timeout 0 would mean no limit at all
timeout -k 5 "$left" "$PY" tests/gpu/gpu_checks.py --install "$install" \
    --install-seconds "$(( $(date +%s) - t0 ))"

#!/usr/bin/env bash
# Everything in the project that needs a GPU, in one short run (about 10 minutes at most):
# the CUDA-path tests, then the time-boxed long-context benchmark (longest sequence, MFU).
set -uo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python -m pytest -q -rs tests/gpu/test_cuda_paths.py
rc=$?
python bench/gpu_long_context.py --budget-s "${GPU_BENCH_BUDGET_S:-400}"
exit $rc

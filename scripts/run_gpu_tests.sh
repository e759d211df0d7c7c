#!/usr/bin/env bash
# The CUDA test suite (tests/test_cuda_*.py) on one GPU; docs/gpu.md says what it checks.
#
#     bash scripts/run_gpu_tests.sh                          # the "cuda" tests (a few minutes on one H100/H200)
#     bash scripts/run_gpu_tests.sh -k resume                # some of them (pytest's arguments)
#     bash scripts/run_gpu_tests.sh tests/test_cuda_emulator.py -k pipenag
#
# Uses an existing Python that has torch and pytest (${PYTHON:-python3}): no virtual environment, no install,
# no scripts/setup_env.sh (a GPU image may have no network and lacks wandb, datasets and nltk, which the suite
# never needs: it runs with those three made unimportable, so a module-level import of one fails it). It selects
# the "cuda" parametrisations (marker `cuda`); their "cpu" twins run in CI (scripts/run_tests.sh).
# Without a GPU every selected test is skipped with "needs CUDA".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, pytest" 2>/dev/null; then
  echo "error: $PY cannot import torch and pytest; set PYTHON to an interpreter that has both (pytest>=8)" >&2
  exit 2
fi
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
source scripts/gpu_wheels.sh  # torchao from .gpu_wheels/ when carried (docs/fp8.md)
# cuBLAS reads this once per process, at its first use: the deterministic tests need it set before then.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
"$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU: the cuda tests skip')"

# The tests marked `cuda` (the "cuda" twins; tests/cuda_harness.py) of every test file, unless the arguments
# name a marker expression (-m) or test paths of their own; other arguments (-k, -x, ...) go to pytest as given.
args=("$@")
names_a_path=0
names_markers=0
for a in "$@"; do
  case "$a" in
    -m) names_markers=1 ;;
    tests/*|*.py|*::*) names_a_path=1 ;;
  esac
done
if [ "$names_markers" = 0 ]; then args=(-m cuda "${args[@]}"); fi
if [ "$names_a_path" = 0 ]; then args=(tests/test_cuda_*.py "${args[@]}"); fi
exec "$PY" -c "import sys; sys.modules.update(dict.fromkeys(('wandb', 'datasets', 'nltk'))); import pytest
sys.exit(pytest.main(sys.argv[1:]))" -q --durations=15 "${args[@]}"

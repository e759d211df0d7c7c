#!/usr/bin/env bash
# Everything a lent GPU should check and measure, in one command per device call (issue 34; docs/gpu.md,
# "When a GPU is lent"): the CUDA test suite, the compile and fused-step tests on the device's own torch with the
# GPU hidden, then bench/gpu/gpu.py's sections by priority, in a time budget; bench/gpu/gpu_check.py is the logic.
#
#     bash scripts/gpu_check.sh                  # part 1 (first device call): the CUDA suite, peak, gpt, plain, compiled
#     bash scripts/gpu_check.sh --part 2         # part 2 (second call): the sections part 1 leaves
#     bash scripts/gpu_check.sh --part 2 --budget-s 330 --add compiled   # a shorter call, and what part 1 skipped
#     bash scripts/gpu_check.sh --quick --out-dir "$TMPDIR/c"  # on a CPU: one test per suite, a tiny GPT
#
# Results go to $OUT when it is set (the device tool's folder that comes back), else bench/results/gpu_check/.
# Uses an existing Python with torch and pytest (${PYTHON:-python3}): no virtual environment, no network, and
# wandb, datasets and nltk unimportable in the tests, as on the GPU image (scripts/run_gpu_tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 GPU_CHECK_VIA=scripts/gpu_check.sh
source scripts/gpu_wheels.sh  # torchao from .gpu_wheels/ when carried (docs/fp8.md)
exec "${PYTHON:-python3}" bench/gpu/gpu_check.py "$@"

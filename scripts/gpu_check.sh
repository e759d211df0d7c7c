#!/usr/bin/env bash
# Everything a lent GPU should check and measure, the same command in every device call (issues 34, 44; docs/gpu.md,
# "When a GPU is lent"): what no run has measured yet first (the CUDA suite, then sections never measured, then those
# whose code changed, then the rest), inside a time budget; the baselines once per machine; the compile tests on the
# device's torch beside the timed steps. bench/gpu_check/gpu_check.py is the logic, bench/gpu_check/gpu_plan.py the order.
#
#     bash scripts/gpu_check.sh                  # a device call: the plan, inside 540 s
#     bash scripts/gpu_check.sh --budget-s 300   # a later call on the same machine, with what the lease has left
#     bash scripts/gpu_check.sh --plan           # the order and why, nothing run (on a CPU too)
#     bash scripts/gpu_check.sh --steps profile  # only these steps (and the baselines they read)
#     bash scripts/gpu_check.sh --quick --out-dir "$TMPDIR/c"  # on a CPU: one test per suite, a tiny GPT
#
# Results go to $OUT when it is set (the device tool's folder that comes back), else bench/results/gpu_check/.
# Uses an existing Python with torch and pytest (${PYTHON:-python3}): no virtual environment, no network, and
# wandb, datasets and nltk unimportable in the tests, as on the GPU image (scripts/run_gpu_tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 GPU_CHECK_VIA=scripts/gpu_check.sh
source scripts/gpu_wheels.sh  # torchao from .gpu_wheels/ when carried (docs/fp8.md)
exec "${PYTHON:-python3}" bench/gpu_check/gpu_check.py "$@"

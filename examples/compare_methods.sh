#!/usr/bin/env bash
# Convergence comparison of the pipeline methods (GPipe, 1F1B, async-naive, PipeDream, PipeDream-2BW,
# SpecTrain, PipeOptim) on the tiny GPT and the bundled World English Bible, at D = 4 and 8 pipeline
# stages with Adam, AdamW and SGD-momentum, three seeds each: same hyperparameters for every method,
# mean ± std over seeds, a verdict that calls a difference real only when it exceeds the spread.
# About 20-40 minutes on 2 CPU cores (bench/convergence/convergence.py --quick: a 1-2 minute smoke run).
#
#   bash examples/compare_methods.sh                       # the default benchmark
#   OUT=runs/compare bash examples/compare_methods.sh --depths 4 --optimizers adam --seeds 2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-bench/results}

$PY bench/convergence/convergence.py --out "$OUT" "$@"

echo "table: $OUT/convergence.md"
echo "plot:  $OUT/convergence.png"

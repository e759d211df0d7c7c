#!/usr/bin/env bash
# Install everything into ./.venv and run the whole test suite (what CI runs). Its output ends with the 20 slowest
# tests (pytest's durations report), the command's wall time since it started (tests/conftest.py) and pytest's
# closing line, so that a slow new test shows in every log (issue 60).
#
# The tests run in parallel pytest processes (pytest-xdist): one per core, at most 8 (PYTEST_WORKERS overrides;
# 1 runs them in this process), each test file whole on one process (--dist loadfile: a module's fixtures are
# built once, and the files the suite measures slowest start first: tests/conftest.py), one torch thread each
# (OMP_NUM_THREADS=1: the tests' models are tiny, and the processes share the cores). TorchDynamo/inductor's
# compiled kernels are cached in .cache/torchinductor/ (git-ignored; TORCHINDUCTOR_CACHE_DIR overrides): a fresh
# clone compiles each kernel once per run, every later run finds it there.
set -euo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/torchinductor}"
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (nproc reads OMP_NUM_THREADS, set to 1 above)
workers="${PYTEST_WORKERS:-$(( cores < 8 ? cores : 8 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
export RUN_TESTS_STARTED="${RUN_TESTS_STARTED:-$start}" RUN_TESTS_WORKERS="$workers"
exec .venv/bin/python -m pytest -q ${parallel[@]+"${parallel[@]}"} --durations=20 "$@"

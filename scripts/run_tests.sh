#!/usr/bin/env bash
# Install everything into ./.venv and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
exec .venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# Create ./.venv (if missing) and install the requirements into it. Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -r requirements.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import torch, sentencepiece, datasets; print('environment ready: torch', torch.__version__)"

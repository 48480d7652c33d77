#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the CPU build of torch and the project installed.
# Safe to run again: it only installs what is missing or out of date.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# torch first and pinned: on these machines `pip install torch==2.13.0` takes the local CPU wheel, while an
# unpinned torch would resolve to the newest CUDA build (several GB). A torch already installed is kept.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi

stamp=.venv/.glm_training_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VPY" -m pip install -q -e ".[test]"
  touch "$stamp"
fi

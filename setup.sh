#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with exactly the tested set of packages.
#
#   ./setup.sh             make or update .venv from requirements.lock (a no-op when it already matches)
#   ./setup.sh --relock    re-resolve: the newest releases pyproject.toml's ranges allow, in a throw-away venv,
#                          frozen into requirements.lock; then .venv follows the new lock. Run the tests next:
#                          ./setup.sh --relock && .venv/bin/python -m pytest
#
# requirements.lock pins every package, transitive ones included, and is installed as pip constraints next to
# the project's own requirements, so a release published after the lock was written is never picked up
# silently. The last step compares .venv with the lock and fails, listing the differences, if they differ.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
LOCK=requirements.lock
VPY=.venv/bin/python
stamp=.venv/.glm_training_installed

# torch first and pinned: on these machines `pip install torch==X` takes the local CPU wheel, while an
# unpinned torch would resolve to the newest CUDA build (several GB). A torch already installed is kept.
# pip, without its warnings about index folders this machine's pip.conf names but lacks (one per package).
pip_quiet() {
  "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

torch_pin() { { grep -sE '^torch==' "$LOCK" || echo torch==2.13.0; } | head -n 1; }

install_torch() {  # $1: the venv's python
  if ! "$1" -c "import torch" >/dev/null 2>&1; then
    pip_quiet "$1" -m pip install -q "$(torch_pin)"
  fi
}

relock() {
  local tmp
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/glm-training-relock.XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  echo "relock: resolving the newest allowed releases in a fresh venv ($tmp)"
  "$PY" -m venv "$tmp/venv"
  install_torch "$tmp/venv/bin/python"
  pip_quiet "$tmp/venv/bin/python" -m pip install -q -e ".[test]"
  {
    echo "# The tested set: every package .venv holds, transitive ones included, as pip constraints."
    echo "# Written by ./setup.sh --relock on $(date -u +%Y-%m-%d) with $("$tmp/venv/bin/python" -V) on $(uname -sm);"
    echo "# installed by ./setup.sh. Local build labels (torch's +cpu) are dropped: 2.13.0 matches 2.13.0+cpu."
    "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9][A-Za-z0-9._-]*==' \
      | sed -E 's/^([^=]+==[^+]+)\+.*$/\1/' | LC_ALL=C sort -f
  } >"$LOCK.new"
  mv "$LOCK.new" "$LOCK"
  echo "relock: wrote $LOCK ($(grep -cE '^[A-Za-z0-9]' "$LOCK") packages); git diff $LOCK shows what moved"
}

if [ "${1:-}" = "--relock" ]; then
  relock
  rm -f "$stamp"
elif [ -n "${1:-}" ]; then
  echo "usage: ./setup.sh [--relock]" >&2
  exit 2
fi

if [ ! -x "$VPY" ]; then
  "$PY" -m venv .venv
fi
install_torch "$VPY"

sync_lock() {
  pip_quiet "$VPY" -m pip install -q -c "$LOCK" -e ".[test]"
  touch "$stamp"
}

if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$LOCK" -nt "$stamp" ]; then
  sync_lock
fi
if ! "$VPY" -m glm_training.environment >/dev/null 2>&1; then
  echo "setup: .venv has drifted from $LOCK; reinstalling the locked versions" >&2
  sync_lock
fi
"$VPY" -m glm_training.environment

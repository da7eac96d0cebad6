#!/usr/bin/env bash
# Sets up a fresh checkout: creates .venv at the repo root, installs the pinned dependencies
# (requirements-lock.txt) and deepspeed_c itself (editable, which builds the core module
# deepspeed_c._C in place). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "deepspeed_c needs Python >= 3.10 (found $("$PY" --version))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-lock.txt
.venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
echo "deepspeed_c is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"

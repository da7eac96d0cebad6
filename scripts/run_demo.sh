#!/usr/bin/env bash
# The README's first command: set up (idempotent), then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/op_demo.py "$@"

#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A private op cache, so the suite also proves cold builds (and never trusts a stale one).
export DSC_CACHE_DIR=${DSC_CACHE_DIR:-$(mktemp -d -t dsc-cache-XXXXXX)}
exec .venv/bin/python -m pytest -q --timeout=900 tests "$@"

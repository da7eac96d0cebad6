#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Bytecode for the package once, up front: where PYTHONDONTWRITEBYTECODE is set (it is on the CI machine) every
# launched rank, CLI subprocess and worker would otherwise compile deepspeed_c's ~700 modules again (the variable
# only stops writing .pyc files; existing ones are still read).
.venv/bin/python -m compileall -q -j 0 deepspeed_c tests benchmarks >/dev/null
# A private op cache, so the suite also proves cold builds (and never trusts a stale one).
export DSC_CACHE_DIR=${DSC_CACHE_DIR:-$(mktemp -d -t dsc-cache-XXXXXX)}
# Two workers where there are two cores or more; each test file stays whole on one worker (--dist
# loadfile), so a module's shared multi-rank run happens once; the longest files are handed out first
# (tests/xdist_order.py), so none starts last while the other worker idles. Distributed tests start up to four
# ranks each: more workers would only oversubscribe the cores.
# (getconf, not nproc: nproc obeys the OMP_NUM_THREADS=1 set above). --durations: the slowest tests in the CI log,
# where trimming the suite starts (it is kept under 15 minutes with the two later CI steps).
if [ "$(getconf _NPROCESSORS_ONLN)" -ge 2 ]; then
    exec .venv/bin/python -m pytest -q --timeout=900 --durations=40 -n 2 --dist loadfile tests "$@"
fi
exec .venv/bin/python -m pytest -q --timeout=900 tests "$@"

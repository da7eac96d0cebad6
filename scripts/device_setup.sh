#!/usr/bin/env bash
# For a GPU machine that has torch but no network: install the pure-Python wheels carried in
# .whl/ (pydantic & co., downloaded beforehand with `pip download`) into /tmp/site and build the
# core module in place. Source it: `source scripts/device_setup.sh`.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 setup.py build_ext --inplace -q >/tmp/build_ext.log 2>&1 || { cat /tmp/build_ext.log; return 1 2>/dev/null || exit 1; }
export DSC_CACHE_DIR=${DSC_CACHE_DIR:-/tmp/dsc_cache}

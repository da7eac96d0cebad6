#!/usr/bin/env bash
# needs 1 GPU, ~1 min. Session 8, issue 41: cProfile of our layer stack's step (host time by function).
export PYTHONUNBUFFERED=1
timeout 100 python3 .devrun/cprof41.py > ${OUT:-/tmp}/cprof41.txt 2>&1; echo rc=$?; grep -E "function calls|seconds" ${OUT:-/tmp}/cprof41.txt | head

#!/usr/bin/env bash
# needs 1 GPU, ~2.5 min. Session 10: exact-size pinned buffers on every offload mode: the small-GPT check of
# offload_largest (zero2 = ZeRO-Offload, zero3 = ZeRO-3 param+optimizer offload, zero3nvme = ZeRO-Infinity) with
# torch's pinned allocator and with ours; the losses must be the same bits.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
for exact in 0 1; do
    DSC_EXACT_PINNED=$exact timeout 150 python3 benchmarks/offload_largest.py --check --mode zero2,zero3,zero3nvme \
        --impls dsc --check_steps 4 --nvme_path /tmp/ol_swap_e$exact --log $O/check_e$exact.log 2>&1 \
        | grep -E "check [a-z0-9]+: deepspeed_c" | sed "s/^.*check /exact=$exact /" | tee -a $O/check.txt
done
python3 - "$O/check.txt" <<'PY'
import sys
rows = [l.split(None, 2) for l in open(sys.argv[1])]
by = {}
for exact, mode, rest in rows:
    by.setdefault(mode, {})[exact] = rest.split("max rel")[0].strip()
for mode, d in by.items():
    print(mode, "SAME" if len(set(d.values())) == 1 and len(d) == 2 else "DIFFERENT", d)
PY

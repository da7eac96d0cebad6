#!/usr/bin/env bash
# 4 GPUs: issue 54 — Megatron-DeepSpeed's --enable-zbh1-pipeline (its own ZeroBubbleH1Pipeline schedule and
# BackwardOnlyPass / WeightPass methods, plugged into our PipelineEngine through DeepSpeed's _INSTRUCTION_MAP and
# schedule.TrainSchedule) at PP 2 x TP 2, bf16, ZeRO-1, on CUDA. The real DeepSpeed 0.19.8 cannot run zbh1 (its
# PipelineEngine lost mem_status, which Megatron's BackwardOnlyPass calls), so the competitor is its 1F1B on the
# same command. Prints each iteration's loss: ours 1F1B, ours ZB-H1, real 1F1B (correctness first: ZB-H1's equal
# ours 1F1B's within bf16 accumulation-order noise, ~1e-5), then Megatron's tokens/s per GPU and the ratios.
#
# CARRY and setup exactly as .devrun/gpu_54c.sh (run(carry=[".mds", ".dsref", ".whl"]); from the repo root after
# `source scripts/device_setup.sh`):
#   bash .devrun/gpu_54c.sh setup   # once per machine (~3-4 min)
#   bash .devrun/gpu_54d.sh         # <= 150 s
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$(pwd)
[ -d /tmp/mds_gpu ] && [ -d /tmp/dsc_alias/deepspeed ] && [ -d /tmp/ds_real/deepspeed ] \
    || bash .devrun/gpu_54c.sh setup || exit 1
export CUDA_HOME=/tmp/cuda_mds
timeout 145 python3 - "$ROOT" <<'EOF'
import pathlib, sys, statistics
sys.path.insert(0, sys.argv[1])
from benchmarks.megatron_client import run_pretrain_gpt as c
deps = sys.argv[1] + "/.mds/deps"
runs = [("dsc 1F1B", "/tmp/dsc_alias", False), ("dsc ZB-H1", "/tmp/dsc_alias", True), ("DS 1F1B", "/tmp/ds_real", False)]
rows = {}
for i, (name, root, zb) in enumerate(runs):
    a = c.parser().parse_args(["--mds", "/tmp/mds_gpu", "--launcher", root + "/bin/deepspeed", "--pythonpath",
                               root + ":" + deps, "--device", "cuda", "--gpus", "4", "--tp", "2", "--pp", "2",
                               "--layers", "8", "--hidden", "2048", "--seq", "1024", "--micro", "2",
                               "--global-batch", "16", "--iters", "8", "--stage", "1", "--clip", "0", "--bf16",
                               "--port", str(29631 + i), "--tag", f"zb{i}", "--work", "/tmp/mds_work_zb"]
                              + (["--zbh1"] if zb else []))
    try:
        rows[name] = c.run(a, pathlib.Path("/tmp/mds_work_zb"), timeout=45)[0]
    except Exception as exc:
        print(f"{name}: FAILED {str(exc)[-600:]}")
        rows[name] = []
print("PP 2 x TP 2, 4 GPUs, bf16, ZeRO-1, layers 8 hidden 2048 seq 1024, micro 2 x gas 8")
print(f"{'iter':>4} " + " ".join(f"{n:>12}" for n, _, _ in runs) + "  zb/1f1b-1")
n = max(len(r) for r in rows.values())
for k in range(n):
    v = [rows[name][k][1] if k < len(rows[name]) else float("nan") for name, _, _ in runs]
    print(f"{k + 1:>4} " + " ".join(f"{x:>12.6f}" for x in v) + f"  {v[1] / v[0] - 1:+.2e}")
tgs = {name: statistics.median([r[2] for r in rows[name][2:]]) if len(rows[name]) > 2 else float("nan")
       for name, _, _ in runs}
print("tokens/s per GPU (median, iterations 3+): " + "  ".join(f"{k} {v:.1f}" for k, v in tgs.items()))
print(f"ratio dsc ZB-H1 / DS 1F1B {tgs['dsc ZB-H1'] / tgs['DS 1F1B']:.3f}   "
      f"dsc ZB-H1 / dsc 1F1B {tgs['dsc ZB-H1'] / tgs['dsc 1F1B']:.3f}")
EOF
echo "== done $(( $(date +%s) - T0 )) s"
for f in /tmp/mds_work_zb/log_*.txt; do [ -f "$f" ] && { echo "-- $f"; grep -E "Error|Traceback" "$f" | tail -3; }; done

"""Ratio tables for the JSON lines benchmarks/train_throughput.py writes: each deepspeed_c system
against DDP and FSDP2 at the same world size, against the real DeepSpeed at the same stage and
offload, and per GPU against deepspeed_c stage 0 on one GPU (the same model)."""
from __future__ import annotations

import json
from typing import Any


def _load(path: str) -> list[dict[str, Any]]:
    rows: dict[tuple, dict[str, Any]] = {}
    with open(path) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                rows[(r["model"], r["world"], r["system"])] = r  # the last run of a system counts
    return list(rows.values())


def report(path: str) -> None:
    rows = _load(path)
    by = {(r["model"], r["world"], r["system"]): r for r in rows}
    for model in sorted({r["model"] for r in rows}):
        for world in sorted({r["world"] for r in rows if r["model"] == model}):
            mine = [r for r in rows if r["model"] == model and r["world"] == world]
            gpu = mine[0]["gpu"]
            print(f"\n{model} ({mine[0]['params'] / 1e6:.0f}M params) on {world} x {gpu}, seq {mine[0]['seq']}, "
                  f"micro {mine[0]['micro']}, torch {mine[0]['torch']}")
            print(f"{'system':10s}{'tokens/s':>10s}{'/GPU':>8s}{'MFU':>7s}{'peak GiB':>9s}{'ring MiB':>10s}"
                  f"{'vs DDP':>8s}{'vs FSDP2':>9s}{'vs DS':>7s}{'/GPU vs 1-GPU dsc0':>20s}")
            ddp = by.get((model, world, "ddp"))
            fsdp = by.get((model, world, "fsdp2"))
            single = by.get((model, 1, "dsc0"))
            for r in sorted(mine, key=lambda r: r["system"]):
                s = r["system"]
                ds = by.get((model, world, "ds" + s[3:])) if s.startswith("dsc") else None

                def ratio(other: dict[str, Any] | None, per_gpu: bool = False) -> str:
                    if other is None or other is r:
                        return "-"
                    key = "tokens_per_s_gpu" if per_gpu else "tokens_per_s"
                    return f"{r[key] / other[key]:.2f}x"

                print(f"{s:10s}{r['tokens_per_s']:10.0f}{r['tokens_per_s_gpu']:8.0f}{r['mfu']:7.1%}"
                      f"{r['peak_gib']:9.2f}{r['ring_bytes'] / 2**20:10.1f}{ratio(ddp):>8s}{ratio(fsdp):>9s}"
                      f"{ratio(ds):>7s}{ratio(single, per_gpu=True):>20s}")
            lower = (world - 1) / world * 4 * mine[0]["params"]  # bf16 gradients + bf16 parameters
            if world > 1:
                print(f"ZeRO-2 reduce-scatter lower bound (W-1)/W x (bf16 grads + bf16 params): "
                      f"{lower / 2**20:.1f} MiB per rank per step; counted: "
                      + ", ".join(f"{s} {by[(model, world, s)]['ring_bytes'] / lower:.2f}x"
                                  for s in ("dsc2", "ds2") if (model, world, s) in by))

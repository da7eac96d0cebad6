"""CPU Adam: deepspeed_c's C core against torch.optim.AdamW (fused=True and foreach=True) on the
same parameters, plus the machine's memory bandwidth measured in the same run (an in-place
read-modify-write pass over buffers of the same size: bytes read + written), interleaved.

    python benchmarks/cpu_optimizers.py [--log2n 26] [--reps 5]

Prints ms/step, GB/s (28 bytes per parameter for fp32 Adam: p, m, v read+written, g read),
% of measured bandwidth, and ratios. Also: bf16 parameters (fp32 states), and the ZeRO-Offload
fused "step + write the bf16 copy" against the path it replaces (bf16 grads up-cast into an fp32
buffer, an fp32 step, then a separate copy_ into the bf16 params).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from deepspeed_c.ops.adam import DeepSpeedCPUAdam
from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step
from deepspeed_c.ops.op_builder import CPUAdamBuilder

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def timed(fn, reps_out: list[float]) -> None:
    start = time.perf_counter()
    fn()
    reps_out.append(time.perf_counter() - start)


def make_opt(kind: str, p: torch.Tensor):
    if kind == "ours":
        return DeepSpeedCPUAdam([p], **HP)
    return torch.optim.AdamW([p], **HP, **{kind: True})


def check_correct(n: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = torch.randn(n).to(dtype)
    grads = [torch.randn(n).to(dtype) for _ in range(3)]
    out = {}
    for kind in ("ours", "fused", "foreach"):
        p = base.clone().requires_grad_()
        opt = make_opt(kind, p)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[kind] = p.detach().double()
    for kind in ("fused", "foreach"):
        rel = ((out["ours"] - out[kind]).norm() / out[kind].norm()).item()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert rel < tol, f"{dtype} ours vs torch {kind}: relative difference {rel:.2e}"


def bench_adam(n: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    params = {k: torch.randn(n).to(dtype).requires_grad_() for k in ("ours", "fused", "foreach")}
    opts = {k: make_opt(k, p) for k, p in params.items()}
    for k, p in params.items():
        p.grad = torch.randn(n).to(dtype) * 1e-3
        opts[k].step()  # state allocation outside the timing
    bw_bufs = [torch.ones(n) for _ in range(4 if dtype == torch.float32 else 3)]
    times: dict[str, list[float]] = {k: [] for k in (*params, "bandwidth")}
    for _ in range(reps):  # interleaved
        for k in params:
            timed(opts[k].step, times[k])
        timed(lambda: torch._foreach_mul_(bw_bufs, 1.0000001), times["bandwidth"])
    med = {k: statistics.median(v) for k, v in times.items()}
    bw_bytes = sum(b.numel() * b.element_size() * 2 for b in bw_bufs)
    med["bandwidth_gbs"] = bw_bytes / med.pop("bandwidth") / 1e9
    return med


def bench_offload_path(n: int, reps: int, gdt: torch.dtype) -> dict[str, float]:
    """fp32 master + states; bf16/fp16 grads; bf16/fp16 model copy."""
    torch.manual_seed(0)
    base = torch.randn(n)
    master = {k: base.clone() for k in ("fused", "baseline")}
    states = {k: (torch.zeros(n), torch.zeros(n)) for k in master}
    copies = {k: torch.empty(n, dtype=gdt) for k in master}
    grad16 = torch.randn(n).to(gdt)
    upcast = torch.empty(n)
    op = CPUAdamBuilder().load()
    step = {"n": 0}

    def fused() -> None:
        step["n"] += 1
        cpu_adam_step([master["fused"]], [grad16], [states["fused"][0]], [states["fused"][1]], lr=1e-3,
                      betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step["n"], copies=[copies["fused"]])

    def baseline() -> None:
        upcast.copy_(grad16)  # up-cast into an fp32 buffer
        op.adam_step([master["baseline"]], [upcast], [states["baseline"][0]], [states["baseline"][1]], None, 1e-3,
                     0.9, 0.999, 1e-8, 0.01, step["n"], 1, 1)
        copies["baseline"].copy_(master["baseline"])  # separate cast into the low-precision params

    fused()
    baseline()
    assert torch.equal(master["fused"], master["baseline"]) and torch.equal(copies["fused"], copies["baseline"])
    times: dict[str, list[float]] = {"fused": [], "baseline": []}
    for _ in range(reps):
        timed(fused, times["fused"])
        timed(baseline, times["baseline"])
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2n", type=int, default=26)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = 1 << args.log2n
    simd = CPUAdamBuilder().load().simd()
    print(f"deepspeed_c CPU Adam benchmark: 2^{args.log2n} params, {torch.get_num_threads()} torch threads, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, SIMD path {simd}")
    for dtype in (torch.float32, torch.bfloat16):
        check_correct(1 << 16, dtype)
    print("correctness: ours matches torch fused and foreach AdamW (fp32 rel < 1e-6, bf16 < 1e-2)")
    for dtype, bytes_per in ((torch.float32, 28), (torch.bfloat16, 4 + 4 + 16 + 2)):
        r = bench_adam(n, dtype, args.reps)
        name = str(dtype).removeprefix("torch.")
        print(f"\n[{name} params, fp32 states] bandwidth (in-place RMW) {r['bandwidth_gbs']:.1f} GB/s")
        print(f"{'impl':<22}{'ms/step':>10}{'GB/s':>9}{'% of bw':>9}{'ours is':>12}")
        for k, label in (("ours", "deepspeed_c"), ("fused", "torch fused=True"), ("foreach", "torch foreach=True")):
            gbs = n * bytes_per / r[k] / 1e9
            ratio = "" if k == "ours" else f"{r[k] / r['ours']:.2f}x"
            print(f"{label:<22}{r[k] * 1e3:>10.1f}{gbs:>9.1f}{100 * gbs / r['bandwidth_gbs']:>8.0f}%{ratio:>12}")
    for gdt in (torch.bfloat16, torch.float16):
        r = bench_offload_path(n, args.reps, gdt)
        name = str(gdt).removeprefix("torch.")
        print(f"\n[ZeRO-Offload step, fp32 master, {name} grads and copy] fused step+copy {r['fused'] * 1e3:.1f} ms "
              f"vs up-cast + step + copy_ {r['baseline'] * 1e3:.1f} ms: {r['baseline'] / r['fused']:.2f}x")


if __name__ == "__main__":
    main()

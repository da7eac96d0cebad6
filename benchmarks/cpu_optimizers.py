"""CPU Adam: deepspeed_c's C core against torch.optim.AdamW (fused=True and foreach=True) on the
same parameters, plus the machine's memory bandwidth measured in the same run, interleaved.

    python benchmarks/cpu_optimizers.py [--log2n 26] [--reps 7]

(after `pip install -e .` or `python setup.py build_ext --inplace`; uses every core unless
OMP_NUM_THREADS says otherwise.)

Sections, each checked for correctness before timing:
1. fp32 Adam: 28 bytes per parameter (p, m, v read and written, g read).
2. bf16 parameters and grads: against torch with the same bytes (torch keeps bf16 states for
   bf16 parameters, so ours runs with fp32_optimizer_states=False: 14 B/param), and ours with
   DeepSpeed's default fp32 states (22 B/param) as an extra row.
3. ZeRO-Offload step (fp32 master and states, 16-bit grads read directly, 16-bit model copy
   written in the same pass: 28 B/param) against the path it replaces: 16-bit grads up-cast
   into an fp32 buffer, an fp32 step, then a separate copy_ into the 16-bit params. Plus the
   bf16-states variant (20 B/param).
Bandwidth: an in-place read-modify-write pass (x *= c) over four fp32 buffers of n elements,
counting bytes read plus written (a plain copy undercounts because of write-allocate). It is a
reference, not a ceiling: a good streaming kernel can match or exceed it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

try:
    import deepspeed_c  # noqa: F401
except ImportError:  # a checkout built in place
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_c.ops.adam import DeepSpeedCPUAdam  # noqa: E402
from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step  # noqa: E402
from deepspeed_c.ops.op_builder import CPUAdamBuilder  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def interleaved(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per call, the candidates taking turns within each repetition."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def bandwidth_probe(n: int) -> tuple[Callable[[], None], int]:
    bufs = [torch.ones(n) for _ in range(4)]
    return (lambda: torch._foreach_mul_(bufs, 1.0000001)), sum(b.numel() * b.element_size() * 2 for b in bufs)


def make_opt(kind: str, p: torch.Tensor, fp32_states: bool = True):
    if kind == "ours":
        return DeepSpeedCPUAdam([p], **HP, fp32_optimizer_states=fp32_states)
    return torch.optim.AdamW([p], **HP, **{kind: True})


def check_correct(n: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = torch.randn(n).to(dtype)
    grads = [torch.randn(n).to(dtype) for _ in range(3)]
    out = {}
    for kind in ("ours", "fused", "foreach"):
        p = base.clone().requires_grad_()
        opt = make_opt(kind, p, fp32_states=dtype == torch.float32)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[kind] = p.detach().double()
    for kind in ("fused", "foreach"):
        rel = ((out["ours"] - out[kind]).norm() / out[kind].norm()).item()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert rel < tol, f"{dtype} ours vs torch {kind}: relative difference {rel:.2e}"


def table(title: str, n: int, rows: list[tuple[str, float, int]], bw_gbs: float, ours: str) -> None:
    """rows: (label, seconds, bytes per parameter); the last column is `ours`'s speedup over
    each other row (that row's time / ours)."""
    print(f"\n[{title}] measured bandwidth (in-place RMW) {bw_gbs:.1f} GB/s")
    print(f"{'implementation':<42}{'ms/step':>9}{'B/param':>8}{'GB/s':>8}{'% of bw':>9}  speedup of first row")
    t_ours = {label: s for label, s, _ in rows}[ours]
    for label, s, bpp in rows:
        gbs = n * bpp / s / 1e9
        ratio = "" if label == ours else f"{s / t_ours:.2f}x"
        print(f"{label:<42}{s * 1e3:>9.1f}{bpp:>8}{gbs:>8.1f}{100 * gbs / bw_gbs:>8.0f}%  {ratio}")


def bench_fp32(n: int, reps: int) -> None:
    torch.manual_seed(0)
    params = {k: torch.randn(n).requires_grad_() for k in ("ours", "fused", "foreach")}
    opts = {k: make_opt(k, p) for k, p in params.items()}
    for k, p in params.items():
        p.grad = torch.randn(n) * 1e-3
        opts[k].step()  # state allocation outside the timing
    probe, probe_bytes = bandwidth_probe(n)
    med = interleaved({**{k: o.step for k, o in opts.items()}, "bw": probe}, reps)
    ours = "deepspeed_c DeepSpeedCPUAdam"
    table("fp32 Adam", n, [(ours, med["ours"], 28), ("torch AdamW fused=True", med["fused"], 28),
                           ("torch AdamW foreach=True", med["foreach"], 28)], probe_bytes / med["bw"] / 1e9, ours)


def bench_bf16(n: int, reps: int) -> None:
    torch.manual_seed(0)
    kinds = {"ours-bf16s": ("ours", False), "ours-fp32s": ("ours", True), "fused": ("fused", True),
             "foreach": ("foreach", True)}
    params = {k: torch.randn(n).to(torch.bfloat16).requires_grad_() for k in kinds}
    opts = {k: make_opt(kind, params[k], fp32_states) for k, (kind, fp32_states) in kinds.items()}
    for k, p in params.items():
        p.grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
        opts[k].step()
    assert opts["fused"].state[params["fused"]]["exp_avg"].dtype == torch.bfloat16  # same bytes as ours-bf16s
    probe, probe_bytes = bandwidth_probe(n)
    med = interleaved({**{k: o.step for k, o in opts.items()}, "bw": probe}, reps)
    a, b = "deepspeed_c, bf16 states (as torch)", "deepspeed_c, fp32 states (DeepSpeed dflt)"
    table("bf16 params and grads", n,
          [(a, med["ours-bf16s"], 14), (b, med["ours-fp32s"], 22), ("torch AdamW fused=True", med["fused"], 14),
           ("torch AdamW foreach=True", med["foreach"], 14)], probe_bytes / med["bw"] / 1e9, a)


def bench_offload(n: int, reps: int, gdt: torch.dtype) -> None:
    torch.manual_seed(0)
    base = torch.randn(n)
    names = ("fused", "baseline", "bf16-states")
    master = {k: base.clone() for k in names}
    sdt = {"fused": torch.float32, "baseline": torch.float32, "bf16-states": torch.bfloat16}
    states = {k: (torch.zeros(n, dtype=sdt[k]), torch.zeros(n, dtype=sdt[k])) for k in names}
    copies = {k: torch.empty(n, dtype=gdt) for k in names}
    grad16 = torch.randn(n).to(gdt)
    upcast = torch.empty(n)
    op = CPUAdamBuilder().load()
    step = {k: 0 for k in names}

    def fused(k: str = "fused") -> None:
        step[k] += 1
        cpu_adam_step([master[k]], [grad16], [states[k][0]], [states[k][1]], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                      weight_decay=0.01, step=step[k], copies=[copies[k]])

    def baseline() -> None:
        step["baseline"] += 1
        upcast.copy_(grad16)  # up-cast into an fp32 buffer
        op.adam_step([master["baseline"]], [upcast], [states["baseline"][0]], [states["baseline"][1]], None, 1e-3,
                     0.9, 0.999, 1e-8, 0.01, step["baseline"], 1, 1)
        copies["baseline"].copy_(master["baseline"])  # separate cast into the low-precision params

    fused()
    baseline()
    assert torch.equal(master["fused"], master["baseline"]) and torch.equal(copies["fused"], copies["baseline"])
    probe, probe_bytes = bandwidth_probe(n)
    med = interleaved({"fused": fused, "baseline": baseline, "bf16-states": lambda: fused("bf16-states"),
                       "bw": probe}, reps)
    name = str(gdt).removeprefix("torch.")
    a = f"fused step + {name} copy"
    # the replaced path moves 2 + 4 (up-cast: read 16-bit, write fp32) + 28 (step) + 4 + 2 (copy_) = 40 B/param
    table(f"ZeRO-Offload step: fp32 master, {name} grads and model copy", n,
          [(a, med["fused"], 28), ("up-cast + fp32 step + copy_", med["baseline"], 40),
           (f"fused, bf16 states + {name} copy", med["bf16-states"], 20)], probe_bytes / med["bw"] / 1e9, a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log2n", type=int, default=26)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    n = 1 << args.log2n
    simd = CPUAdamBuilder().load().simd()
    print(f"deepspeed_c CPU Adam benchmark: 2^{args.log2n} params on {machine()}; {torch.get_num_threads()} torch "
          f"threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, SIMD path {simd}, "
          f"torch {torch.__version__}, medians of {args.reps} interleaved reps")
    for dtype in (torch.float32, torch.bfloat16):
        check_correct(1 << 16, dtype)
    print("correctness: ours matches torch fused and foreach AdamW (fp32 rel < 1e-6, bf16 < 1e-2); "
          "the offload rows check fused == up-cast path bit for bit")
    bench_fp32(n, args.reps)
    bench_bf16(n, args.reps)
    for gdt in (torch.bfloat16, torch.float16):
        bench_offload(n, args.reps, gdt)


if __name__ == "__main__":
    main()

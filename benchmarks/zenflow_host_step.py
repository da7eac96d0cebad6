"""ZenFlow's / ZeRO-Offload's host Adam step (issue 52) on this CPU: the gradient coefficient (clip factor,
loss scale, ZenFlow's mean over the update interval) folded into the C CPU Adam (grad_scale) against the
path it replaces (a scaled fp32 gradient made first), side by side in one process, interleaved, correctness
(equal bits) checked before timing; plus the most that skipping ZenFlow's selected columns could save.

    python benchmarks/zenflow_host_step.py [--log2n 24] [--reps 7] [--topk 0.1]

Sections (n fp32 master elements, fp32 moments, bf16 model copy written in the same pass):
1. ZenFlow host step, CPU run, update_interval 4: before, the fp32 accumulator scaled by 1/4 in place and
   cloned, the clone stepped, the accumulator zeroed; now the accumulator stepped with grad_scale 1/4, then
   zeroed (on a GPU the 1/4 was a device pass and the copy a device-to-host one: no host saving there).
2. Plain ZeRO-Offload / SuperOffload host step with bf16 gradients and a clip coefficient < 1: before, each
   4M-element sub-chunk's gradient up-cast into a scaled fp32 copy; now the kernel reads bf16 and scales.
3. The same with fp32 gradients: before, an in-place scaling pass over the gradient; now none.
4. Skipping the selected columns in the host step (DeepSpeed does not: its host step updates every
   element): the kernel over (1 - topk) n contiguous elements against n, the bound on any skip. Our
   partitions are row-major, so the selected columns are scattered through every row (with topk 0.1 about
   one element in ten, in nearly every 64-byte line), and a real skip would stream the same lines.
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

from deepspeed_c.ops.adam.cpu_adam import _adam_op, cpu_adam_step  # noqa: E402

SUB_CHUNK = 1 << 22  # the offload's C-kernel call size (deepspeed_c.runtime.zero.offload.SUB_CHUNK)
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class State:
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.p = torch.randn(n, generator=g)
        self.m = torch.randn(n, generator=g) * 1e-2
        self.v = torch.rand(n, generator=g) * 1e-4
        self.copy = torch.empty(n, dtype=torch.bfloat16)
        self.step = 1

    def clone(self) -> "State":
        out = State.__new__(State)
        out.p, out.m, out.v, out.copy, out.step = self.p.clone(), self.m.clone(), self.v.clone(), self.copy.clone(), 1
        return out

    def same(self, other: "State") -> bool:
        return all(torch.equal(a, b) for a, b in ((self.p, other.p), (self.m, other.m), (self.v, other.v),
                                                   (self.copy, other.copy)))

    def kernel(self, grad: torch.Tensor, lo: int, hi: int, scale: float = 1.0) -> None:
        cpu_adam_step([self.p[lo:hi]], [grad], [self.m[lo:hi]], [self.v[lo:hi]], copies=[self.copy[lo:hi]],
                      step=self.step, grad_scale=scale, **HP)


def chunks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + SUB_CHUNK)) for lo in range(0, n, SUB_CHUNK)]


# -- 1. ZenFlow host step (CPU run) --------------------------------------------------------------------------
def zenflow_old(st: State, acc: torch.Tensor, interval: int) -> None:
    acc.mul_(1.0 / interval)
    grad = acc.clone()
    acc.zero_()
    st.kernel(grad, 0, grad.numel())


def zenflow_new(st: State, acc: torch.Tensor, interval: int) -> None:
    st.kernel(acc, 0, acc.numel(), 1.0 / interval)
    acc.zero_()


# -- 2./3. plain offload host step ---------------------------------------------------------------------------
def offload_old(st: State, grad: torch.Tensor, coef: float) -> None:
    for lo, hi in chunks(grad.numel()):
        g = grad[lo:hi]
        g = g.float().mul_(coef) if g.dtype != torch.float32 else g.mul_(coef)
        st.kernel(g, lo, hi)


def offload_new(st: State, grad: torch.Tensor, coef: float) -> None:
    for lo, hi in chunks(grad.numel()):
        st.kernel(grad[lo:hi], lo, hi, coef)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(a: Callable[[], None], b: Callable[[], None], reps: int) -> tuple[float, float]:
    """Medians of reps runs each, alternating which goes first."""
    ta, tb = [], []
    for r in range(reps):
        if r % 2 == 0:
            ta.append(timed(a))
            tb.append(timed(b))
        else:
            tb.append(timed(b))
            ta.append(timed(a))
    return statistics.median(ta), statistics.median(tb)


def row(name: str, old: float, new: float, label: tuple[str, str] = ("before", "folded")) -> None:
    print(f"{name:<46} {label[0]} {old * 1e3:8.1f} ms   {label[1]} {new * 1e3:8.1f} ms   ratio {old / new:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--topk", type=float, default=0.1)
    args = ap.parse_args()
    n = 1 << args.log2n
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"simd {_adam_op(None).simd()}, n = 2^{args.log2n}")
    base = State(n, 0)
    gen = torch.Generator().manual_seed(1)
    acc0 = torch.randn(n, generator=gen) * 4
    g32 = torch.randn(n, generator=gen)
    g16 = g32.to(torch.bfloat16)
    coef = 0.4123456

    # correctness first: the folded step gives the bits of the old one
    a, b = base.clone(), base.clone()
    acc_a, acc_b = acc0.clone(), acc0.clone()
    zenflow_old(a, acc_a, 4)
    zenflow_new(b, acc_b, 4)
    ok1 = a.same(b) and torch.equal(acc_a, acc_b)
    a, b = base.clone(), base.clone()
    offload_old(a, g16, coef)
    offload_new(b, g16, coef)
    ok2 = a.same(b)
    a, b = base.clone(), base.clone()
    ga = g32.clone()
    offload_old(a, ga, coef)
    offload_new(b, g32, coef)
    ok3 = a.same(b)
    print(f"check: equal bits, zenflow {ok1}, offload bf16 grads {ok2}, offload fp32 grads {ok3}")
    if not (ok1 and ok2 and ok3):
        raise SystemExit("the folded step differs from the old one: no timing")

    sa, sb = base.clone(), base.clone()
    acc_a, acc_b = acc0.clone(), acc0.clone()

    def z_old() -> None:
        acc_a.copy_(acc0)  # a new interval's gradients (the same copy on both sides, inside the clock)
        zenflow_old(sa, acc_a, 4)

    def z_new() -> None:
        acc_b.copy_(acc0)
        zenflow_new(sb, acc_b, 4)

    row("1. zenflow host step (CPU run, interval 4)", *interleaved(z_old, z_new, args.reps))
    row("2. offload step, bf16 grads, clip coef", *interleaved(lambda: offload_old(sa, g16, coef),
                                                               lambda: offload_new(sb, g16, coef), args.reps))
    gb = g32.clone()

    def o32_old() -> None:
        gb.copy_(g32)  # the old path scales the gradient in place: a fresh one each time, on both sides
        offload_old(sa, gb, coef)

    def o32_new() -> None:
        gb.copy_(g32)
        offload_new(sb, gb, coef)

    row("3. offload step, fp32 grads, clip coef", *interleaved(o32_old, o32_new, args.reps))
    keep = int(n * (1.0 - args.topk))
    acc = acc0.clone()
    t_all, t_keep = interleaved(lambda: sa.kernel(acc, 0, n), lambda: sa.kernel(acc[:keep], 0, keep), args.reps)
    row(f"4. bound on skipping topk {args.topk:g} (contiguous)", t_all, t_keep, ("all", "1-topk"))


if __name__ == "__main__":
    main()

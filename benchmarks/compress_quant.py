"""Fused fake quantization (compression library / MoQ) on CUDA: correctness first, then bandwidth.

Correctness: the CUDA kernel (csrc/cuda/compress_quant.cu) against the C kernel (csrc/cpu/compress_quant.c) on
the same data (bit-equal, stochastic rounding included: both draw the same counter hash), and against the torch
reference run on the GPU (DeepSpeed's own arithmetic; bit-equal for nearest rounding).
Timing at --log2 elements (fp32): the fused kernel, DeepSpeed 0.19.6's torch quantizer arithmetic
(quant_reference, the competitor) and torch's copy_, interleaved reps. Bandwidth counts the bytes each must move:
fake quant reads x twice (range, then quantize) and writes once (3 x 4 B per element; groups of <= 4096
elements: once each, "1pass"), copy reads and writes once (2 x 4 B); the ratio is effective fake-quant
bandwidth over copy bandwidth (bar >= 0.85)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_c.compression import quant_kernels as K  # noqa: E402
from deepspeed_c.compression import quant_reference as R  # noqa: E402


def _raw(op, x, groups, bits, asym, seed):
    out = torch.empty_like(x)
    op.fake_quant(x, out, groups, bits, int(asym), None, None, 0, seed)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values, NaN where the other has NaN (an fp16 ternary over 2^20 elements overflows its sums)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def correctness() -> list[tuple[str, bool]]:
    cpu_op, cuda_op = K._op("cpu"), K._op("cuda")
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(1 << 20, generator=g) * 3).to(dtype)
        odd = (torch.randn(3 * 5003, generator=g) * 3).to(dtype)  # 2-pass, groups not a multiple of 4
        cases = [(1, 8, False, x), (1, 8, True, x), (64, 4, False, x), (256, 3, True, x), (4096, 8, True, x),
                 (1 << 4, 5, False, x), (3, 8, True, odd), (3, 4, False, odd),
                 (1 << 18, 8, False, x),  # n = 4: the 16-bit dtypes take the per-element group kernel
                 (5003, 4, True, odd),  # n = 3: per-element group kernel
                 (64, 8, True, x[:1 + 64 * 1024])]  # used one element in: not 16-byte aligned (below)
        for groups, bits, asym, t in cases:
            tc = t.cuda()
            if t.numel() == 1 + 64 * 1024:  # slice on each side, so the device view is misaligned too
                t, tc = t[1:], tc[1:]
            for seed in (0, 12345):
                a = _raw(cuda_op, tc, groups, bits, asym, seed).cpu()
                b = _raw(cpu_op, t, groups, bits, asym, seed)
                rows.append((f"cuda==C {str(dtype)[6:]} g{groups} b{bits} {'asym' if asym else 'sym'} "
                             f"{'stoch' if seed else 'near'}", _same(a, b)))
            if dtype != torch.float16 or bits < 16:  # torch's CUDA ops on the device: one rounding per op too
                ref = R.fake_quant(tc, bits, groups, asym).cpu()
                rows.append((f"cuda==torch {str(dtype)[6:]} g{groups} b{bits} {'asym' if asym else 'sym'}",
                             _same(_raw(cuda_op, tc, groups, bits, asym, 0).cpu(), ref)))
        if dtype == torch.float32:  # more than 65535 groups of the two-pass length: several range launches
            big = torch.randn(65537 * 4100, generator=g)
            rows.append(("cuda==C float32 g65537 n4100 b8 asym near",
                         _same(_raw(cuda_op, big.cuda(), 65537, 8, True, 0).cpu(), _raw(cpu_op, big, 65537, 8, True, 0))))
            del big
        xc = x.cuda()
        for groups in (1, 32):
            rows.append((f"ternary cuda==torch {str(dtype)[6:]} g{groups}",
                         _same(K.ternary(xc, groups).cpu(), R.ternary(xc, groups).cpu())))
            rows.append((f"binary cuda==torch {str(dtype)[6:]} g{groups}",
                         _same(K.binary(xc, groups).cpu(), R.binary(xc, groups).cpu())))
    return rows


def _time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def bandwidth(log2: int, reps: int, rounds: int) -> None:
    n = 1 << log2
    x = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    op = K._op("cuda")
    cases = {
        "fq sym8 g1": lambda: op.fake_quant(x, out, 1, 8, 0, None, None, 0, 0),
        "fq asym4 g1": lambda: op.fake_quant(x, out, 1, 4, 1, None, None, 0, 0),
        "fq sym8 g=n/2^16": lambda: op.fake_quant(x, out, n >> 16, 8, 0, None, None, 0, 0),
        "fq asym8 4096/g 1pass": lambda: op.fake_quant(x, out, n // 4096, 8, 1, None, None, 0, 0),
        "fq sym8 stochastic": lambda: op.fake_quant(x, out, 1, 8, 0, None, None, 0, 7),
        "torch ref sym8 g1": lambda: R.fake_quant(x, 8, 1, False),
        "copy_": lambda: out.copy_(x),
    }
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    best = {k: float("inf") for k in cases}
    for _ in range(rounds):  # interleaved
        for k, fn in cases.items():
            best[k] = min(best[k], _time(fn, reps))
    copy_bw = 2 * 4 * n / best["copy_"] / 1e9
    print(f"\n2^{log2} fp32 elements ({4 * n / 2**30:.2f} GiB), best of {rounds} rounds x {reps} reps")
    print(f"{'case':<22}{'ms':>9}{'GB/s':>10}{'vs copy':>9}")
    for k, t in best.items():
        moved = 2 if k == "copy_" or "1pass" in k else 3
        bw = moved * 4 * n / t / 1e9
        print(f"{k:<22}{t * 1e3:>9.3f}{bw:>10.0f}{bw / copy_bw:>9.2f}")
    speedup = best["torch ref sym8 g1"] / best["fq sym8 g1"]
    print(f"fused kernel vs DeepSpeed's torch arithmetic (sym8 g1): {speedup:.1f}x")


def cpu(log2: int, reps: int, rounds: int) -> None:
    """The C kernel against DeepSpeed's torch arithmetic and clone() on host tensors (bit-equality first)."""
    import time

    n = 1 << log2
    x = torch.randn(n)
    same = all(torch.equal(K.fake_quant(x, b, g, a), R.fake_quant(x, b, g, a))
               for b, g, a in ((8, 1, False), (4, 64, True)))
    print(f"cpu correctness: C kernel == torch reference: {same}")
    cases = {"C sym8 g1": lambda: K.fake_quant(x, 8, 1, False), "C asym4 g64": lambda: K.fake_quant(x, 4, 64, True),
             "torch ref sym8 g1": lambda: R.fake_quant(x, 8, 1, False), "clone": lambda: x.clone()}
    best = {k: float("inf") for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t) / reps)
    print(f"2^{log2} fp32 on {torch.get_num_threads()} threads: " +
          ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()) +
          f"; C vs torch {best['torch ref sym8 g1'] / best['C sym8 g1']:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2", type=int, default=28)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="time the C kernel on host tensors instead")
    args = ap.parse_args()
    if args.cpu:
        cpu(args.log2, args.reps, args.rounds)
        return
    rows = correctness()
    bad = [name for name, ok in rows if not ok]
    print(f"correctness: {len(rows) - len(bad)}/{len(rows)} bit-equal" + (f"; FAILED: {bad}" if bad else ""))
    bandwidth(args.log2, args.reps, args.rounds)


if __name__ == "__main__":
    main()

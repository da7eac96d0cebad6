"""Weight-only int8 / int4 GEMV (ops.transformer.inference.quant, CUDA op quant_gemv) against the bf16 GEMV of
cuBLAS (torch.nn.functional.linear) at decode's batch 1, on the linear layers of a LLaMA-7B-shaped block.

Correctness first: each kernel's output against x @ dequantize_reference(q)^T in float32 (torch ops); a kernel
over 1e-2 relative error is marked WRONG and not timed. Timings: each call captured 20 times in one CUDA graph
(the decode step runs as a graph, so launch gaps are not what is measured), replayed; medians of --reps
interleaved rounds. Bandwidth = weight bytes read (bf16: 2 a weight; int8: 1 + scales; int4: 1/2 + scales) / time.
--variants times the tuning launches of the kernel too (100 * warps a block + 16-byte chunks in flight a lane,
+ 1000: two weight rows a warp at batch 1).

    python benchmarks/inference_quant.py [--hidden 4096 --inter 11008 --group 128 --reps 5 --variants]"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_c.ops.transformer.inference import quant as Q  # noqa: E402

CALLS = 20


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1, help="activation rows (decode batch)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", action="store_true")
    return ap.parse_args()


def graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    return g


def us_per_call(g: torch.cuda.CUDAGraph) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / CALLS


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        sys.exit("inference_quant.py needs a GPU")
    dev, dt = "cuda", torch.bfloat16
    h, f = args.hidden, args.inter
    heads = max(2, h // 128)
    kv = max(2, heads // 4)
    shapes = {"qkv": ((heads + 2 * kv) * 128 if h % 128 == 0 else 3 * h, h), "o": (h, h), "gate_up": (2 * f, h),
              "down": (h, f)}
    variants = [0] + ([802, 804, 808, 404, 1802, 1804, 1404] if args.variants else [])
    print(f"== quant_gemv vs cuBLAS bf16 GEMV: LLaMA hidden {h} / inter {f} linears, {args.rows} row(s), group "
          f"{args.group}, {torch.cuda.get_device_name()} ==")
    torch.manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    graphs: dict[tuple[str, str], torch.cuda.CUDAGraph] = {}
    nbytes: dict[tuple[str, str], int] = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev) * 0.02
        x = torch.randn(args.rows, k, device=dev, dtype=dt)
        wb = w.to(dt)
        out = torch.empty(args.rows, n, device=dev, dtype=dt)
        graphs[(name, "bf16")] = graph_of(lambda x=x, wb=wb, out=out: torch.matmul(x, wb.t(), out=out))
        nbytes[(name, "bf16")] = wb.numel() * 2
        errs = []
        for bits in (8, 4):
            q, s = Q.quantize(w, bits, args.group)
            ref = x.float() @ Q.dequantize_reference(q, s, bits, args.group, torch.float32).t()
            for v in variants:
                got = Q.gemv(x, q, s, bits, args.group, v)
                e = float((got.float() - ref).abs().max() / ref.abs().max())
                tag = f"int{bits}" + (f"/v{v}" if v else "")
                errs.append(f"{tag} {e:.1e}{' WRONG' if e > 1e-2 else ''}")
                if e > 1e-2:
                    continue
                graphs[(name, tag)] = graph_of(lambda x=x, q=q, s=s, bits=bits, v=v: Q.gemv(x, q, s, bits, args.group, v))
                nbytes[(name, tag)] = q.numel() + s.numel() * 4
        print(f"  {name:8s} [{n} x {k}] rel err vs float32 reference: " + "  ".join(errs))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in graphs}
    for _ in range(args.reps):
        for key, g in graphs.items():
            times[key].append(us_per_call(g))
    for (name, tag), ts in times.items():
        results.setdefault(name, {})[tag] = statistics.median(ts)
    tags = [t for t in dict.fromkeys(tag for (_, tag) in graphs)]
    print(f"  {'linear':8s} {'system':10s} {'us/call':>8s} {'GB/s':>7s} {'vs bf16':>8s}")
    total = {t: 0.0 for t in tags}
    for name, row in results.items():
        for tag in tags:
            if tag not in row:
                continue
            us = row[tag]
            total[tag] += us
            print(f"  {name:8s} {tag:10s} {us:8.2f} {nbytes[(name, tag)] / us / 1e3:7.0f} {row['bf16'] / us:7.2f}x")
    print("  all four (one layer's GEMVs): " + "  ".join(f"{t} {total[t]:.1f} us ({total['bf16'] / total[t]:.2f}x)"
                                                           for t in tags if total[t] > 0))


if __name__ == "__main__":
    main()

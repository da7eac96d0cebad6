"""Weight-only int8 / int4 GEMV (ops.transformer.inference.quant, CUDA op quant_gemv) against the bf16 GEMV of
cuBLAS (torch.nn.functional.linear) at decode's batch 1, on the linear layers of a LLaMA-7B-shaped block.

Correctness first: each kernel's output against x @ dequantize_reference(q)^T in float32 (torch ops); a kernel
over 1e-2 relative error is marked WRONG and not timed. Timings: calls queued behind a GPU sleep so they run back
to back (no host launch gaps), cycling over enough copies of the weight (>= 256 MiB a system) that none is served
from L2 as in a real decode step, us per call from CUDA events; medians of --reps interleaved rounds. (CUDA graphs
are not used here: torch 2.11 can fault replaying many graphs captured on one stream with cuBLAS in them.)
Bandwidth = weight bytes read (bf16: 2 a weight; int8: 1 + scales; int4: 1/2 + scales) / time.
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

COPY_BYTES = 256 << 20
SLEEP_CYCLES = 6_000_000  # ~3 ms: longer than queueing the calls from the host


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1, help="activation rows (decode batch)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", action="store_true")
    return ap.parse_args()


def us_per_call(calls: list) -> float:
    """The calls run back to back on the GPU (queued behind a sleep kernel); mean us each."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for fn in calls:
        fn()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / len(calls)


def copies_for(nbytes: int) -> int:
    return max(4, min(64, -(-COPY_BYTES // nbytes)))


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
    systems: dict[tuple[str, str], list] = {}
    nbytes: dict[tuple[str, str], int] = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev) * 0.02
        x = torch.randn(args.rows, k, device=dev, dtype=dt)
        wbs = [w.to(dt) for _ in range(copies_for(w.numel() * 2))]
        out = torch.empty(args.rows, n, device=dev, dtype=dt)
        systems[(name, "bf16")] = [lambda x=x, wb=wb, out=out: torch.matmul(x, wb.t(), out=out) for wb in wbs]
        nbytes[(name, "bf16")] = w.numel() * 2
        errs = []
        for bits in (8, 4):
            q, s = Q.quantize(w, bits, args.group)
            ref = x.float() @ Q.dequantize_reference(q, s, bits, args.group, torch.float32).t()
            size = q.numel() + s.numel() * 4
            qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies_for(size) - 1)]
            for v in variants:
                got = Q.gemv(x, q, s, bits, args.group, v)
                e = float((got.float() - ref).abs().max() / ref.abs().max())
                tag = f"int{bits}" + (f"/v{v}" if v else "")
                errs.append((tag, e))
                if e > 1e-2:
                    continue
                systems[(name, tag)] = [lambda x=x, q=qq, s=ss, bits=bits, v=v: Q.gemv(x, q, s, bits, args.group, v)
                                        for qq, ss in qs]
                nbytes[(name, tag)] = size
        del w
        worst = {b: max(e for t, e in errs if t.startswith(f"int{b}")) for b in (8, 4)}
        wrong = [t for t, e in errs if e > 1e-2]
        print(f"  {name:8s} [{n} x {k}] rel err vs float32 reference, worst of {len(variants)} launches: int8 "
              f"{worst[8]:.1e}  int4 {worst[4]:.1e}" + (f"  WRONG: {wrong}" if wrong else ""))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in systems}
    for _ in range(args.reps):
        for key, calls in systems.items():
            times[key].append(us_per_call(calls))
    for (name, tag), ts in times.items():
        results.setdefault(name, {})[tag] = statistics.median(ts)
    tags = [t for t in dict.fromkeys(tag for (_, tag) in systems)]
    names = list(results)
    print(f"  {'system':11s}" + "".join(f" {n + ' us (GB/s)':>18s}" for n in names) + f" {'layer us':>9s} {'vs bf16':>8s}")
    layer_bf16 = sum(results[n]["bf16"] for n in names)
    for tag in tags:
        if not all(tag in results[n] for n in names):
            continue
        cells = "".join(f" {results[n][tag]:9.2f} ({nbytes[(n, tag)] / results[n][tag] / 1e3:5.0f})" for n in names)
        layer = sum(results[n][tag] for n in names)
        print(f"  {tag:11s}{cells} {layer:9.1f} {layer_bf16 / layer:7.2f}x")


if __name__ == "__main__":
    main()

"""DS4Sci_EvoformerAttention (ours: flash-style CUDA kernels) side by side with a naive
implementation (materialised [B, N, H, L, L] scores), torch SDPA with the two biases materialised
as one [B*N, H, L, L] mask, FlexAttention with the biases as a score_mod, and DeepSpeed's CUTLASS
kernel when it builds. One GPU.

"ours" runs the default kernels (mma.sync tensor-core tiles on sm_80+, CUDA cores before). First a
correctness table: our fp16/bf16 kernels against float32 naive math (outputs and the
gradients of Q, K, V, the mask bias and the pair bias, relative max error), on small odd shapes
and on the benchmark shape. Then forward+backward and forward-only time (median of interleaved
reps) and the forward+backward peak memory above the inputs, with ratios against ours.

    python benchmarks/evoformer.py                      # L 512, N 128, 4 heads, D 32 (the issue's bar)
    python benchmarks/evoformer.py --small              # a quick pass (.devrun/gpu_41.sh)
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_c.ops.deepspeed4science import DS4Sci_EvoformerAttention  # noqa: E402
from deepspeed_c.ops.deepspeed4science import evoformer_attn  # noqa: E402


def naive(q, k, v, b1, b2):
    qh, kh, vh = (t.transpose(-2, -3) for t in (q, k, v))
    s = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    for b in (b1, b2):
        s = s if b is None else s + b
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), vh).transpose(-2, -3)


def sdpa(q, k, v, b1, b2):
    B, N, L, H, D = q.shape
    bias = (b1 + b2).expand(B, N, H, L, L).reshape(B * N, H, L, L)  # materialised
    qh, kh, vh = (t.reshape(B * N, L, H, D).transpose(1, 2) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)
    return o.transpose(1, 2).reshape(B, N, L, H, D)


def make_flex():
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention)

    def flex(q, k, v, b1, b2):
        B, N, L, H, D = q.shape
        m = b1.reshape(B * N, L)
        p = b2.reshape(B, H, L, L)

        def score_mod(score, b, h, qi, ki):
            return score + m[b, ki] + p[b // N, h, qi, ki]

        qh, kh, vh = (t.reshape(B * N, L, H, D).transpose(1, 2) for t in (q, k, v))
        o = compiled(qh, kh, vh, score_mod=score_mod)
        return o.transpose(1, 2).reshape(B, N, L, H, D)

    return flex


def deepspeed_fn():
    from deepspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention as ds_attn

    return lambda q, k, v, b1, b2: ds_attn(q, k, v, [b1, b2])


def ours(q, k, v, b1, b2):
    return DS4Sci_EvoformerAttention(q, k, v, [b1, b2])


def inputs(B, N, L, H, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, N, L, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    keep = torch.rand(B, N, 1, 1, L, device="cuda", generator=g) > 0.2
    keep[..., 0] = True
    b1 = ((keep.float() - 1) * 1e4).to(dtype)  # large negative for masked keys (finite in fp16)
    b2 = torch.randn(B, 1, H, L, L, device="cuda", dtype=dtype, generator=g)
    return q, k, v, b1, b2


def fwd_bwd(fn, tensors, d_o):
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(d_o)
    return out.detach(), [None if t is None else t.grad for t in leaves]


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check(shapes, dtypes, kernels=("tc",), drop_biases: bool = False) -> bool:
    """Ours (fp16/bf16; each kernel) against float32 naive math; one row per case (drop_biases: also
    without the pair bias and without either bias)."""
    ok = True
    if not getattr(check, "header_printed", False):
        check.header_printed = True
        print("correctness: ours vs float32 naive (max |err| / max |ref|); tc = tensor cores (mma.sync), "
              "simt = CUDA cores")
        print(f"{'shape B,N,L,H,D':>32} {'kern':>4} {'dtype':>9} {'out':>9} {'dQ':>9} {'dK':>9} {'dV':>9} "
              f"{'dmask':>9} {'dpair':>9}")
    keeps = [(True, True)] + ([(True, False), (False, False)] if drop_biases else [])
    for kernel, shape, keep in itertools.product(kernels, shapes, keeps):  # the newest kernel last: a fault ends the run
        evoformer_attn.kernel = kernel
        for dtype in dtypes:
            t = list(inputs(*shape, dtype=dtype, seed=sum(shape)))
            t[3], t[4] = (t[3] if keep[0] else None), (t[4] if keep[1] else None)
            d_o = torch.randn_like(t[0])
            want, wg = fwd_bwd(naive, [None if x is None else x.float() for x in t], d_o.float())
            got, gg = fwd_bwd(ours, t, d_o)
            errs = [rel_err(got, want)] + [float("nan") if b is None else rel_err(a, b) for a, b in zip(gg, wg)]
            tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
            good = all(e < tol for e in errs if e == e) and all(torch.isfinite(x).all() for x in [got, *gg]
                                                               if x is not None)
            ok &= good
            label = str(shape) + ("" if keep == (True, True) else " mask only" if keep[0] else " no bias")
            print(f"{label:>32} {kernel:>4} {str(dtype)[6:]:>9} " + " ".join(f"{e:9.2e}" if e == e else f"{'-':>9}" for e in errs)
                  + ("" if good else f"  FAIL (tol {tol})"))
    evoformer_attn.kernel = "auto"
    return ok


def bench(shape, dtype, reps: int, systems: dict) -> None:
    t = inputs(*shape, dtype=dtype)
    d_o = torch.randn_like(t[0])
    want, wg = fwd_bwd(ours, t, d_o)
    live = {}
    for name, fn in systems.items():
        try:
            out, grads = fwd_bwd(fn, t, d_o)
            err = max([rel_err(out, want)] + [rel_err(a, b) for a, b in zip(grads, wg)])
            live[name] = fn
            print(f"  {name}: agrees with ours to {err:.2e} (max rel err over out and all grads)")
        except Exception as e:  # a competitor that does not run here is reported and dropped
            print(f"  {name}: not run: {type(e).__name__}: {' '.join(str(e).split())[:400]}")
    torch.cuda.synchronize()
    peak = {}
    for name, fn in live.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(fn, t, d_o)
        torch.cuda.synchronize()
        peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = {name: [] for name in live}
    fwd_times = {name: [] for name in live}
    inner = 3  # calls per timed sample: one call of ~1 ms is too close to the launch overheads
    for _ in range(reps):
        for name, fn in live.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fwd_bwd(fn, t, d_o)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / inner)
            start.record()
            with torch.no_grad():
                for _ in range(inner):
                    fn(*t)
            end.record()
            torch.cuda.synchronize()
            fwd_times[name].append(start.elapsed_time(end) / inner)
    B, N, L, H, D = shape
    print(f"\nforward+backward, B={B} N={N} L={L} H={H} D={D} {str(dtype)[6:]}, median of {reps} interleaved reps of 3 calls")
    print(f"{'system':>12} {'fwd+bwd ms':>11} {'/ ours':>7} {'fwd ms':>8} {'/ ours':>7} {'peak MiB':>10} "
          f"{'/ ours':>7}")
    ms_ours, fwd_ours = statistics.median(times["ours"]), statistics.median(fwd_times["ours"])
    for name in live:
        ms, fwd = statistics.median(times[name]), statistics.median(fwd_times[name])
        print(f"{name:>12} {ms:11.3f} {ms / ms_ours:6.2f}x {fwd:8.3f} {fwd / fwd_ours:6.2f}x {peak[name]:10.1f} "
              f"{peak[name] / peak['ours']:6.2f}x")


def profile(shape, dtype, iters: int = 3) -> None:
    """CUDA time of each kernel of ours' forward+backward (torch.profiler), per call."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    t = inputs(*shape, dtype=dtype)
    d_o = torch.randn_like(t[0])
    fwd_bwd(ours, t, d_o)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fwd_bwd(ours, t, d_o)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters / 1e3, e.count // iters) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    print(f"\nours per fwd+bwd call, kernel by kernel ({str(dtype)[6:]}, {iters} calls profiled)")
    for name, ms, count in rows[:10]:
        print(f"  {ms:8.3f} ms  x{count:<3} {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="fewer reps and a smaller N")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nseq", type=int, default=128)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    ap.add_argument("--skip-check", action="store_true", help="no correctness table (timings still check agreement)")
    ap.add_argument("--only", default="", help="comma-separated systems to time besides ours (e.g. flex)")
    ap.add_argument("--profile", action="store_true", help="also our kernels' times from torch.profiler")
    ap.add_argument("--kernels", default="", help="our kernels in the correctness table (default: tc on sm_80+, "
                    "simt before)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/evoformer.py needs a GPU")
    kernels = tuple(args.kernels.split(",")) if args.kernels else (
        ("tc",) if torch.cuda.get_device_capability()[0] >= 8 else ("simt",))
    reps = 7 if args.small else args.reps
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    shape = (args.batch, args.nseq, args.length, args.heads, args.dim)
    ok = True
    if not args.skip_check:
        ok &= check([(1, 2, 17, 2, 8), (2, 3, 100, 4, 32), (1, 2, 130, 2, 64)], [torch.float16, torch.bfloat16],
                    kernels)
        ok &= check([(2, 3, 45, 2, 16)], [torch.bfloat16], kernels, drop_biases=True)
        ok &= check([(1, 2, 200, 2, 12)], [torch.float16], kernels, drop_biases=True)
        ok &= check([shape], [torch.bfloat16], kernels)

    systems = {"ours": ours, "naive": naive, "sdpa": sdpa}
    if not args.no_flex and (not args.only or "flex" in args.only.split(",")):
        try:
            systems["flex"] = make_flex()
        except Exception as e:
            print(f"  flex: not available: {type(e).__name__}: {e}")
    try:
        if args.only and "deepspeed" not in args.only.split(","):
            raise ImportError("not requested (--only)")
        systems["deepspeed"] = deepspeed_fn()
    except Exception as e:
        print(f"  deepspeed: not available: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if args.only:
        keep = {"ours", *args.only.split(",")}
        systems = {name: fn for name, fn in systems.items() if name in keep}
    for dtype in (torch.bfloat16,) if args.small else (torch.bfloat16, torch.float16):
        try:
            bench(shape, dtype, reps, systems)
        except Exception:
            traceback.print_exc()
            ok = False
    if args.profile:
        try:
            profile(shape, torch.bfloat16)
        except Exception:
            traceback.print_exc()
    print("\nevoformer correctness:", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()

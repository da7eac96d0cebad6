"""The fused pieces of DeepSpeedTransformerLayer (csrc/cuda/transformer_gelu.cu, transformer_norm.cu)
one by one against torch's own kernels for the same work, on BERT-Large shapes (T = batch x seq
rows, hidden 1024, FFN 4096). First correctness: every piece on the GPU against its torch form in
deepspeed_c/ops/transformer/fused_reference.py (float32 math) on the same inputs: the vectorised
path (16-byte chunks), the fallback (odd widths, unaligned views), fp32/fp16/bf16, with and
without bias, dropout mask, residual, the invertible LayerNorm backward and the fused bias
gradients. Then time per call (median of interleaved reps) beside:

  bias_gelu          HF: F.gelu (its bias rides in the GEMM epilogue) | unfused: F.gelu(f + b)
  gelu_backward+db   torch gelu_backward + the bias gradient's sum(0), as HF's backward runs them
  residual_norm      torch native_layer_norm alone | HF's chain: dropout(a) + x, then layer_norm
  norm_backward+db   torch native_layer_norm_backward (dx, dgamma, dbeta) | HF's chain: that +
                     dropout backward + the bias gradient's sum(0)

"x ours" = torch time / our time (above 1: ours is faster).

    python benchmarks/transformer_pieces.py               # GPU, T = 8192 (64 x 128)
    python benchmarks/transformer_pieces.py --device cpu --rows 64   # the script's own dry run
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_c.ops.transformer import fused_ops as ops  # noqa: E402
from deepspeed_c.ops.transformer import fused_reference as ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def check(device: str) -> bool:
    ok = True
    print("correctness: our kernels vs fused_reference (float32 math), max |err| / max |ref| over all outputs")
    print(f"{'piece':>16} {'rows x cols':>12} {'dtype':>9} {'layout':>9} {'err':>9}")
    shapes = [(300, 1024), (37, 4096), (33, 768), (17, 13), (9, 8192), (5, 4104)]
    for (rows, cols), dtype, unal in [(s, d, u) for s in shapes for d in (torch.bfloat16, torch.float16, torch.float32)
                                      for u in (False, True)]:
        if unal and (rows, cols) != (300, 1024):
            continue
        torch.manual_seed(rows * 7 + cols)
        mk = (lambda t: unaligned_copy(t)) if unal else (lambda t: t)
        f = mk(torch.randn(rows, cols, device=device).to(dtype))
        bias = (torch.randn(cols, device=device) * 0.1).to(dtype)
        gamma = (1 + 0.1 * torch.randn(cols, device=device)).to(dtype)
        beta = (0.1 * torch.randn(cols, device=device)).to(dtype)
        keep = mk(torch.rand(rows, cols, device=device) > 0.1)
        res = mk(torch.randn(rows, cols, device=device).to(dtype))
        layout = "unaligned" if unal else "aligned"
        errs = {}
        # bias + gelu (g only: the pre-activation is formed again from f and the bias), gelu alone
        _, g = ops.bias_gelu(f, bias)
        errs["bias_gelu"] = max(rel_err(g, ref.bias_gelu(f, bias)[1]), rel_err(ops.gelu(f, bias), ref.gelu(f, bias)),
                                rel_err(ops.gelu(f), ref.gelu(f)))
        # gelu backward (in place over a copy of dg) with and without the bias and its gradient
        dg = mk(torch.randn(rows, cols, device=device).to(dtype))
        du, db = ops.gelu_backward(unaligned_copy(dg) if unal else dg.clone(), f, bias, want_bias=True)
        rdu, rdb = ref.gelu_backward(dg, f, bias, want_bias=True)
        du2, none = ops.gelu_backward(dg.clone(), f)
        errs["gelu_backward"] = max(rel_err(du, rdu), rel_err(db, rdb), rel_err(du2, ref.gelu_backward(dg, f)[0]),
                                    0.0 if none is None else 1.0)
        # bias + dropout + residual + LayerNorm; residual only (no gamma)
        worst = 0.0
        for kp, rs, b in ((keep, res, bias), (None, res, None), (None, None, bias)):
            got = ops.residual_norm(f, b, rs, kp, 1 / 0.9, gamma, beta, 1e-12, want_r=True)
            want = ref.residual_norm(f, b, rs, kp, 1 / 0.9, gamma, beta, 1e-12, want_r=True)
            worst = max([worst] + [rel_err(x, y) for x, y in zip(got, want)])
        r_only, *_ = ops.residual_norm(f, bias, res, keep, 1 / 0.9, None, None, 1e-12, want_r=True)
        worst = max(worst, rel_err(r_only, ref.residual_norm(f, bias, res, keep, 1 / 0.9, None, None, 1e-12, True)[0]))
        errs["residual_norm"] = worst
        # LayerNorm backward: from the input and (invertible) from the output, extra, dropout, bias grad
        r, y, mean, rstd = ref.residual_norm(f, None, res, None, 1.0, gamma, beta, 1e-5, want_r=True)
        r, y = mk(r), mk(y)
        dy = mk(torch.randn(rows, cols, device=device).to(dtype))
        worst = 0.0
        for inv, extra, kp, want_bias in ((False, None, None, False), (False, res, keep, True),
                                          (True, None, keep, True), (True, res, None, True)):
            src = y if inv else r
            args = (dy, src, gamma, beta, None if inv else mean, rstd, inv, extra, kp, 1 / 0.9, want_bias)
            got, want = ops.norm_backward(*args), ref.norm_backward(*args)
            worst = max([worst] + [rel_err(x, w) for x, w in zip(got, want)])
        errs["norm_backward"] = worst
        for name, e in errs.items():
            tol = TOL[dtype] * (2 if name == "norm_backward" else 1)
            good = e <= tol
            ok &= good
            print(f"{name:>16} {f'{rows}x{cols}':>12} {str(dtype)[6:]:>9} {layout:>9} {e:9.2e}"
                  + ("" if good else f"  FAIL (tol {tol:.0e})"))
    return ok


def timer(device: str):
    """fn, inner -> ms per call: CUDA events (wall time of the queued calls: launch overhead shows
    when the GPU outruns the host) or, on the host, perf_counter."""
    if device == "cuda":
        def run(fn, inner):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / inner
    else:
        def run(fn, inner):
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t) * 1e3 / inner
    return run


def kernel_ms(fn, inner: int, device: str) -> tuple[float, int]:
    """(GPU kernel time per call in ms, kernels per call) from torch.profiler: the kernels alone,
    without the host's launch gaps. On the host: (nan, 0)."""
    if device != "cuda":
        return float("nan"), 0
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return sum(e.device_time_total for e in events) / inner / 1e3, sum(e.count for e in events) // inner


def bench(device: str, rows: int, hidden: int, inter: int, dtype, reps: int, inner: int) -> None:
    run = timer(device)
    torch.manual_seed(0)
    p, s = 0.1, 1 / 0.9

    def t(shape_cols, scale=1.0):
        return (torch.randn(rows, shape_cols, device=device) * scale).to(dtype)

    f, dg, u = t(inter), t(inter), t(inter)
    b_i = (torch.randn(inter, device=device) * 0.1).to(dtype)
    a, x, dy = t(hidden), t(hidden), t(hidden)
    ob = (torch.randn(hidden, device=device) * 0.1).to(dtype)
    gamma = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    beta = (0.1 * torch.randn(hidden, device=device)).to(dtype)
    keep = torch.rand(rows, hidden, device=device) > p
    r, _, mean, rstd = ops.residual_norm(a, ob, x, keep, s, gamma, beta, 1e-12, want_r=True)
    _, mean2, rstd2 = torch.native_layer_norm(r, [hidden], gamma, beta, 1e-12)  # torch's own statistics
    cases = {
        f"bias_gelu {rows}x{inter}": [
            ("ours", lambda: ops.bias_gelu(f, b_i)),
            ("torch gelu", lambda: F.gelu(f)),
            ("torch gelu(f+b)", lambda: F.gelu(f + b_i))],
        f"gelu_backward+db {rows}x{inter}": [
            ("ours", lambda: ops.gelu_backward(dg, u, b_i, want_bias=True)),
            ("torch", lambda: torch.ops.aten.gelu_backward(dg, u).sum(0))],
        f"residual_norm {rows}x{hidden}": [
            ("ours", lambda: ops.residual_norm(a, ob, x, keep, s, gamma, beta, 1e-12, want_r=True)),
            ("torch LN alone", lambda: torch.native_layer_norm(x, [hidden], gamma, beta, 1e-12)),
            ("HF chain", lambda: F.layer_norm(F.dropout(a, p, True) + x, [hidden], gamma, beta, 1e-12))],
        f"norm_backward+db {rows}x{hidden}": [
            ("ours", lambda: ops.norm_backward(dy, r, gamma, beta, mean, rstd, False, None, keep, s, want_bias=True)),
            ("torch LN bwd", lambda: torch.ops.aten.native_layer_norm_backward(
                dy, r, [hidden], mean2, rstd2, gamma, beta, [True, True, True])),
            ("HF chain", lambda: torch.ops.aten.native_dropout_backward(torch.ops.aten.native_layer_norm_backward(
                dy, r, [hidden], mean2, rstd2, gamma, beta, [True, True, True])[0], keep, s).sum(0))],
    }
    print(f"\nper call, {str(dtype)[6:]}: GPU kernel time (torch.profiler, kernels per call in brackets) and "
          f"wall time (median of {reps} interleaved reps x {inner} calls); x ours = their time / ours")
    print(f"{'piece':>34} {'system':>16} {'kernel ms':>10} {'x ours':>7} {'wall ms':>9} {'x ours':>7}")
    for name, fns in cases.items():
        for _, fn in fns:
            fn()
        times = {k: [] for k, _ in fns}
        for _ in range(reps):
            for k, fn in fns:
                times[k].append(run(fn, inner))
        wall = {k: statistics.median(v) for k, v in times.items()}
        kern = {k: kernel_ms(fn, inner, device) for k, fn in fns}
        for k, _ in fns:
            (km, count), w = kern[k], wall[k]
            print(f"{name if k == 'ours' else '':>34} {k:>16} {km:10.4f} {km / kern['ours'][0]:7.2f} {w:9.4f} "
                  f"{w / wall['ours']:7.2f}  [{count}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rows", type=int, default=64 * 128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/transformer_pieces.py needs a GPU (or --device cpu for a dry run)")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = True if args.skip_check else check(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    bench(args.device, args.rows, 1024, 4096, dtype, args.reps, args.inner)
    print("\ntransformer pieces correctness:", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()

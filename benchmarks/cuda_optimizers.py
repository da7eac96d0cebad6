"""Fused CUDA kernels against torch, side by side in one process (issue 4).

  python benchmarks/cuda_optimizers.py [--log2n 28] [--reps 30]

Sections (all on 2^log2n parameters, as 1 tensor and as 256 tensors):
  copy      device-to-device copy: the bandwidth ceiling (bytes read + written)
  adam      fp32 Adam step: deepspeed_c FusedAdam vs torch.optim.AdamW fused=True and foreach=True;
            GB/s at 28 bytes per parameter, % of copy bandwidth, ratios
  epilogue  bf16 model + fp32 master AdamW with loss scale and clipping: deepspeed_c's global norm
            + fused epilogue vs torch's cast, unscale + inf check, clip, fused AdamW, cast sequence
  norm      global L2 norm of 2^log2n fp32 elements vs torch.linalg.vector_norm and a plain sum
            (the read ceiling), and of 2,000 tensors of 64K elements vs _foreach_norm + stack + norm
Every pair is checked for agreement before it is timed; repetitions are interleaved. Each row
has two times, both medians: `ms` from CUDA events with the queue kept busy (host work overlaps
the previous launch's kernels: the kernel time), and `idle ms` from an idle queue (synchronise,
call, synchronise, host clock: what a training step that waits for its optimizer sees, host work
before the first launch included).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS: list[dict] = []


IDLE: dict[str, float] = {}  # idle-queue medians of the last timed() call, by name


def timed(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 3) -> dict[str, float]:
    """Median milliseconds per function with the queue kept busy (CUDA events), repetitions
    interleaved across the functions; the idle-queue medians of the same functions go to IDLE."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    torch.cuda.synchronize()
    marks: dict[str, list] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            marks[k].append((start, end))
    torch.cuda.synchronize()
    idle: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            idle[k].append((time.perf_counter() - t0) * 1e3)
    IDLE.clear()
    IDLE.update({k: statistics.median(v) for k, v in idle.items()})
    return {k: statistics.median(s.elapsed_time(e) for s, e in v) for k, v in marks.items()}


def rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(((x.double() - y.double()) ** 2).sum().item() for x, y in zip(a, b))
    den = sum((y.double() ** 2).sum().item() for y in b)
    return (num / den) ** 0.5


def row(section: str, shape: str, name: str, ms: float, nbytes: float, ceiling: float | None,
        ref_ms: float | None = None, ref_name: str = "", idle_ms: float | None = None,
        ref_idle_ms: float | None = None) -> None:
    """One printed row; idle_ms defaults to the IDLE median recorded under `name`."""
    idle_ms = IDLE.get(name) if idle_ms is None else idle_ms
    gbs = nbytes / ms / 1e6
    r = {"section": section, "shape": shape, "impl": name, "ms": round(ms, 4), "GB/s": round(gbs, 1)}
    if idle_ms is not None:
        r["idle ms"] = round(idle_ms, 4)
        r["idle/busy"] = round(idle_ms / ms, 3)
    if ceiling:
        r["% ceiling"] = round(100 * gbs / ceiling, 1)
    if ref_ms:
        r[f"speedup vs {ref_name}"] = round(ref_ms / ms, 3)
    if ref_idle_ms and idle_ms:
        r[f"idle speedup vs {ref_name}"] = round(ref_idle_ms / idle_ms, 3)
    ROWS.append(r)
    extra = f"  {r['% ceiling']:5.1f}%" if ceiling else "        "
    speed = f"  x{ref_ms / ms:5.2f} vs {ref_name}" if ref_ms else ""
    idle = f"  idle {idle_ms:8.3f} ms ({idle_ms / ms:4.2f}x busy)" if idle_ms is not None else ""
    if ref_idle_ms and idle_ms:
        idle += f" x{ref_idle_ms / idle_ms:5.2f} idle vs {ref_name}"
    print(f"{section:9s} {shape:14s} {name:34s} {ms:9.3f} ms {gbs:8.1f} GB/s{extra}{speed}{idle}", flush=True)


def bench_copy(n: int, reps: int) -> float:
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t = timed({"dst.copy_(src)": lambda: dst.copy_(src)}, reps)["dst.copy_(src)"]
    row("copy", "1 tensor", "dst.copy_(src)", t, 8 * n, None)
    return 8 * n / t / 1e6


def _split(n: int, parts: int) -> list[int]:
    return [n // parts] * parts


def bench_adam(n: int, parts: int, copy_gbs: float, reps: int) -> None:
    from deepspeed_c.ops.adam import FusedAdam

    sizes = _split(n, parts)
    shape = f"{parts} tensor" + ("s" if parts > 1 else "")
    base = [torch.randn(s, device="cuda") for s in sizes]
    grads = [torch.randn(s, device="cuda") * 1e-2 for s in sizes]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sets, opts = {}, {}
    names = ("deepspeed_c FusedAdam", "deepspeed_c FusedAdam one launch", "torch AdamW fused", "torch AdamW foreach")
    for name in names:
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g
        sets[name] = ps
    del base
    opts["deepspeed_c FusedAdam"] = FusedAdam(sets["deepspeed_c FusedAdam"], **hp)
    opts["deepspeed_c FusedAdam one launch"] = FusedAdam(sets["deepspeed_c FusedAdam one launch"], **hp)
    opts["torch AdamW fused"] = torch.optim.AdamW(sets["torch AdamW fused"], fused=True, **hp)
    opts["torch AdamW foreach"] = torch.optim.AdamW(sets["torch AdamW foreach"], foreach=True, **hp)
    from deepspeed_c.ops import fused_step_plan

    for k, o in opts.items():
        if k.endswith("one launch"):  # the plan before pipelined launches: a bucket is one launch
            saved, fused_step_plan.PIPELINED_DEVICES = fused_step_plan.PIPELINED_DEVICES, frozenset()
            o.step()
            fused_step_plan.PIPELINED_DEVICES = saved
        else:
            o.step()
    err = rel_err(sets["deepspeed_c FusedAdam"], sets["torch AdamW fused"])
    print(f"check     {shape:14s} FusedAdam vs torch fused AdamW after 1 step: rel err {err:.2e}", flush=True)
    assert err < 1e-5, err
    times = timed({k: o.step for k, o in opts.items()}, reps)
    ref, ref_idle = times["torch AdamW fused"], IDLE["torch AdamW fused"]
    for k, t in times.items():
        is_ref = k == "torch AdamW fused"
        row("adam", shape, k, t, 28 * n, copy_gbs, None if is_ref else ref, "torch fused",
            ref_idle_ms=None if is_ref else ref_idle)
    del sets, opts, grads
    torch.cuda.empty_cache()


def bench_epilogue(n: int, parts: int, copy_gbs: float, reps: int) -> None:
    from deepspeed_c.ops import cuda_multi_tensor as mt

    sizes = _split(n, parts)
    shape = f"{parts} tensor" + ("s" if parts > 1 else "")
    ls, max_norm, hp = 1024.0, 1.0, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    base = [torch.randn(s, device="cuda") for s in sizes]
    grads = [(torch.randn(s, device="cuda") * ls * 1e-3).bfloat16() for s in sizes]  # scaled model grads

    # deepspeed_c: one norm pass over the bf16 grads, one epilogue pass
    masters_a = [b.clone() for b in base]
    m_a = [torch.zeros_like(b) for b in base]
    v_a = [torch.zeros_like(b) for b in base]
    model_a = [b.bfloat16() for b in base]
    step_a = torch.zeros(1, device="cuda")

    def ours() -> None:
        norm, _, found = mt.multi_tensor_l2norm(grads)
        mt.fused_adam_epilogue_(grads, masters_a, m_a, v_a, step=step_a, grad_norm=norm, found_inf=found,
                                model_params=model_a, loss_scale=ls, max_grad_norm=max_norm, **hp)

    # torch: cast grads to fp32, unscale + inf check, clip_grad_norm_ (foreach), fused AdamW
    # (skipping on found_inf on the device), cast masters back into the bf16 model
    masters_b = [torch.nn.Parameter(b.clone()) for b in base]
    master_grads = [torch.empty_like(b) for b in base]
    for p, g in zip(masters_b, master_grads):
        p.grad = g
    model_b = [b.bfloat16() for b in base]
    del base
    opt = torch.optim.AdamW(masters_b, fused=True, **hp)
    found_inf = torch.zeros((), device="cuda")  # 0-dim, as GradScaler makes it
    inv_scale = torch.full((), 1.0 / ls, device="cuda")
    opt.found_inf = found_inf  # read by torch's fused AdamW (what GradScaler.step sets)

    @torch.no_grad()
    def theirs() -> None:
        torch._foreach_copy_(master_grads, grads)
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(master_grads)))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(master_grads, coef)
        opt.step()
        torch._foreach_copy_(model_b, masters_b)

    ours()
    theirs()
    err = rel_err(masters_a, masters_b)
    bad = sum((a != b).sum().item() for a, b in zip(model_a, model_b))
    print(f"check     {shape:14s} epilogue vs torch sequence after 1 step: master rel err {err:.2e}, "
          f"bf16 params differing {bad} of {n}", flush=True)
    assert err < 1e-5, err
    times = timed({"deepspeed_c norm + epilogue": ours, "torch cast+unscale+clip+AdamW+cast": theirs}, reps)
    ref = times["torch cast+unscale+clip+AdamW+cast"]
    row("epilogue", shape, "deepspeed_c norm + epilogue", times["deepspeed_c norm + epilogue"], 30 * n, copy_gbs,
        ref, "torch seq", ref_idle_ms=IDLE["torch cast+unscale+clip+AdamW+cast"])
    row("epilogue", shape, "torch cast+unscale+clip+AdamW+cast", ref, 60 * n, copy_gbs)
    del masters_a, m_a, v_a, model_a, masters_b, master_grads, model_b, opt, grads
    torch.cuda.empty_cache()


def bench_norm(n: int, reps: int) -> None:
    from deepspeed_c.ops import cuda_multi_tensor as mt

    x = torch.randn(n, device="cuda")
    ref = x.double().norm().item()
    got = mt.multi_tensor_global_norm([x]).item()
    print(f"check     {'1 tensor':14s} global norm rel err vs float64 {abs(got - ref) / ref:.2e}", flush=True)
    times = timed({"plain sum": lambda: x.sum(),
                   "deepspeed_c l2norm (+inf flag)": lambda: mt.multi_tensor_l2norm([x]),
                   "torch.linalg.vector_norm": lambda: torch.linalg.vector_norm(x)}, reps)
    read_gbs = 4 * n / times["plain sum"] / 1e6
    row("norm", "1 tensor", "plain sum (read ceiling)", times["plain sum"], 4 * n, None, idle_ms=IDLE["plain sum"])
    row("norm", "1 tensor", "deepspeed_c l2norm (+inf flag)", times["deepspeed_c l2norm (+inf flag)"], 4 * n,
        read_gbs, times["torch.linalg.vector_norm"], "vector_norm")
    row("norm", "1 tensor", "torch.linalg.vector_norm", times["torch.linalg.vector_norm"], 4 * n, read_gbs)
    del x
    ts = [torch.randn(65536, device="cuda") for _ in range(2000)]
    ref = torch.stack([t.double().norm() for t in ts]).norm().item()
    got = mt.multi_tensor_global_norm(ts).item()
    print(f"check     {'2000 x 64K':14s} global norm rel err vs float64 {abs(got - ref) / ref:.2e}", flush=True)
    times = timed({"deepspeed_c l2norm (+inf flag)": lambda: mt.multi_tensor_l2norm(ts),
                   "torch _foreach_norm+stack+norm":
                       lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))}, reps)
    nb = 4 * 2000 * 65536
    ref_ms = times["torch _foreach_norm+stack+norm"]
    row("norm", "2000 x 64K", "deepspeed_c l2norm (+inf flag)", times["deepspeed_c l2norm (+inf flag)"], nb,
        read_gbs, ref_ms, "torch foreach")
    row("norm", "2000 x 64K", "torch _foreach_norm+stack+norm", ref_ms, nb, read_gbs)
    # Both sides above are bound by host work per tensor; CUDA-graph replays show the GPU time.
    times = timed({"deepspeed_c l2norm, graph replay": _graphed(lambda: mt.multi_tensor_l2norm(ts)),
                   "torch foreach norm, graph replay":
                       _graphed(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))))}, reps)
    ref_ms = times["torch foreach norm, graph replay"]
    row("norm", "2000 x 64K", "deepspeed_c l2norm, graph replay", times["deepspeed_c l2norm, graph replay"], nb,
        read_gbs, ref_ms, "torch graph")
    row("norm", "2000 x 64K", "torch foreach norm, graph replay", ref_ms, nb, read_gbs)


def _graphed(fn: Callable[[], object]) -> Callable[[], None]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log2n", type=int, default=28)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    ap.add_argument("--sections", default="adam,epilogue,norm", help="comma-separated subset to run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    n = 1 << args.log2n
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  n = 2^{args.log2n}", flush=True)
    sections = set(args.sections.split(","))
    copy_gbs = bench_copy(n, args.reps)
    for parts in (1, 256):
        if "adam" in sections:
            bench_adam(n, parts, copy_gbs, args.reps)
    for parts in (1, 256):
        if "epilogue" in sections:
            bench_epilogue(n, parts, copy_gbs, args.reps)
    if "norm" in sections:
        bench_norm(n, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    main()

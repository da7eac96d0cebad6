"""MoE gating + dispatch + combine, side by side in one process: deepspeed_c's C/CUDA core against the
same math written with torch ops in DeepSpeed's classic einsum / one-hot formulation (dense
[tokens, experts, capacity] combine weights and dispatch mask, einsum "sec,sm->ecm" and
"sec,ecm->sm"), and against the real DeepSpeed's MoE layer (0.19.x: its sparse index_select path)
when `deepspeed` is importable.

Variants (names in the table):
  dsc-core    softmax + top-2 selection + capacity plan (C/CUDA) + dispatch + combine (C/CUDA)
  torch-dense the same routing and moves as dense one-hot tensors and two einsums (DeepSpeed < 0.18)
  dsc-layer   deepspeed_c.moe.layer.MoE, identity experts (gate matmul included), forward [+ backward]
  ds-layer    deepspeed.moe.layer.MoE (the real DeepSpeed), the same weights and input

Correctness first: on the device, the CUDA core's routing (every route's slot) equals the C host
core's on the same logits, and dsc-core's output equals torch-dense's (bf16 tolerance); dsc-layer's
output equals ds-layer's. A variant that disagrees is reported and not timed. Then --reps interleaved
rounds (each variant once per round, synchronised), median ms, tokens/s, and the peak device memory
each variant allocates above what was allocated when it began; ratios are against dsc-core / dsc-layer.

    python benchmarks/moe.py [--tokens 8192] [--experts 64] [--hidden 4096] [--k 2] [--dtype bf16]
                             [--capacity_factor 1.0] [--reps 20] [--backward] [--device cuda]
The real DeepSpeed is found on PYTHONPATH (e.g. PYTHONPATH=/path/to/ds_site DS_ACCELERATOR=cuda).
--device cpu runs a small smoke test of the same code on the host."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--capacity_factor", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backward", action="store_true", help="time forward + backward of the layers")
    ap.add_argument("--device", default="cuda")
    return ap.parse_args()


# ---- the variants ---------------------------------------------------------------------------------

def dsc_core(x: torch.Tensor, wg: torch.Tensor, k: int, cf: float) -> torch.Tensor:
    from deepspeed_c.moe.gating import route_top1, route_top2, route_topk
    from deepspeed_c.moe import gating_core as core

    logits = x.float() @ wg.t()
    if k == 1:
        r = route_top1(logits, cf, 4, use_rts=False)
    elif k == 2:
        r = route_top2(logits, cf, 4, top2_2nd_expert_sampling=False)
    else:
        r = route_topk(logits, k, cf, 4)
    y = core.dispatch(x, r.route_slot, r.slot_route)  # identity experts: the dispatched rows come back
    return core.combine(y, r.weights, r.route_slot, r.slot_route)


def torch_dense(x: torch.Tensor, wg: torch.Tensor, k: int, cf: float) -> torch.Tensor:
    """Top-2 (k=2) gating as dense one-hot tensors, written from DeepSpeed's formulas."""
    if k != 2:
        raise NotImplementedError("the dense formulation here is top-2")
    logits = x.float() @ wg.t()
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    idx1 = gates.argmax(1)
    mask1 = F.one_hot(idx1, E)
    idx2 = logits.masked_fill(mask1.bool(), float("-inf")).argmax(1)
    mask2 = F.one_hot(idx2, E)
    loc1 = torch.cumsum(mask1, 0) - 1
    loc2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)
    C = max(int(torch.ceil(torch.tensor(S / E * cf * 2)).item()), 4)
    mask1 = mask1 * (loc1 < C)
    mask2 = mask2 * (loc2 < C)
    l1 = (loc1 * mask1).sum(1)
    l2 = (loc2 * mask2).sum(1)
    g1 = (gates * mask1).sum(1)
    g2 = (gates * mask2).sum(1)
    denom = (g1 + g2).clamp(min=torch.finfo(torch.float32).eps)
    g1, g2 = g1 / denom, g2 / denom
    cw = (torch.einsum("s,se->se", g1, mask1.float()).unsqueeze(2) * F.one_hot(l1, C).float().unsqueeze(1)
          + torch.einsum("s,se->se", g2, mask2.float()).unsqueeze(2) * F.one_hot(l2, C).float().unsqueeze(1))
    dispatch_mask = cw.bool()
    dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.to(x.dtype), x)
    return torch.einsum("sec,ecm->sm", cw.to(x.dtype), dispatched)


def make_layers(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    from deepspeed_c.moe.layer import MoE as DscMoE

    layers: dict[str, Any] = {}
    torch.manual_seed(0)
    ours = DscMoE(args.hidden, torch.nn.Identity(), num_experts=args.experts, k=args.k,
                  capacity_factor=args.capacity_factor, min_capacity=4, use_rts=False,
                  top2_2nd_expert_sampling=False).to(device=device, dtype=dtype)
    layers["dsc-layer"] = ours
    try:
        from deepspeed.moe.layer import MoE as DsMoE  # the real DeepSpeed
    except Exception as e:  # not installed here: the table says so
        print(f"real DeepSpeed not importable ({type(e).__name__}: {e}); ds-layer skipped", flush=True)
        return layers
    theirs = DsMoE(args.hidden, torch.nn.Identity(), num_experts=args.experts, k=args.k,
                   capacity_factor=args.capacity_factor, min_capacity=4, use_rts=False,
                   top2_2nd_expert_sampling=False).to(device=device, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    layers["ds-layer"] = theirs
    return layers


# ---- harness --------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, int]:
    """(seconds, peak bytes allocated above the start)."""
    sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    del out
    return dt, peak


def check_cuda_core_against_host(x: torch.Tensor, wg: torch.Tensor, args: argparse.Namespace) -> None:
    """The CUDA core's selection, counts and plan equal the C host core's on the same logits; dispatch and
    combine equal the host's within rounding."""
    from deepspeed_c.moe import gating_core as core

    logits = (x.float() @ wg.t())
    gates = F.softmax(logits, 1)
    E = logits.shape[1]
    for name, score_fn, order in (("positional", None, core.ROUTE_MAJOR), ("scored", "probs", core.TOKEN_MAJOR)):
        idx_d = core.select(gates, args.k, secondary=logits)
        idx_h = core.select(gates.cpu(), args.k, secondary=logits.cpu())
        assert torch.equal(idx_d.cpu(), idx_h), f"select differs ({name})"
        assert torch.equal(core.counts(idx_d, E).cpu(), core.counts(idx_h, E)), "counts differ"
        C = max(1, int(x.shape[0] * args.k * args.capacity_factor / E) // 2)  # small: forces drops
        score_d = gates.gather(1, idx_d) if score_fn else None
        rs_d, sr_d = core.plan(idx_d, E, C, order, score=score_d)
        rs_h, sr_h = core.plan(idx_h, E, C, order, score=None if score_d is None else score_d.cpu())
        assert torch.equal(rs_d.cpu(), rs_h) and torch.equal(sr_d.cpu(), sr_h), f"plan differs ({name})"
        w = gates.gather(1, idx_d) * (rs_d >= 0)
        disp_d = core.dispatch(x, rs_d, sr_d)
        disp_h = core.dispatch(x.cpu(), rs_h, sr_h)
        assert torch.equal(disp_d.cpu(), disp_h), f"dispatch differs ({name})"
        out_d = core.combine(disp_d, w, rs_d, sr_d)
        out_h = core.combine(disp_h, w.cpu(), rs_h, sr_h)
        torch.testing.assert_close(out_d.cpu().float(), out_h.float(), rtol=1e-2, atol=1e-2)
    print("CUDA core == C host core (select, counts, plan positional and scored, dispatch, combine): OK", flush=True)


def table(title: str, rows: list[tuple[str, list[float], int]], anchor: str, tokens: int) -> None:
    print(f"\n{title}")
    print(f"| variant | median ms | tokens/s | peak MiB | time / {anchor} | memory / {anchor} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ref = next(((statistics.median(t), m) for n, t, m in rows if n == anchor), None)
    for name, times, peak in rows:
        med = statistics.median(times)
        ratio_t = f"{med / ref[0]:.2f}x" if ref else "-"
        ratio_m = f"{peak / ref[1]:.2f}x" if ref and ref[1] else "-"
        print(f"| {name} | {med * 1e3:.3f} | {tokens / med:,.0f} | {peak / 2**20:.1f} | {ratio_t} | {ratio_m} |")


def main() -> None:
    args = parse()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --device cpu for a smoke test)")
        torch.cuda.set_device(0)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29541"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    if not dist.is_initialized():  # DeepSpeed's layer logs through its comm module
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    S, E, M = args.tokens, args.experts, args.hidden
    torch.manual_seed(0)
    x = torch.randn(S, M, device=device).to(dtype)
    wg = torch.randn(E, M, device=device) / M**0.5
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}  torch {torch.__version__}  {S} tokens x {E} experts x hidden {M}, top-{args.k}, {args.dtype}, "
          f"capacity_factor {args.capacity_factor}", flush=True)
    if device.type == "cuda":
        check_cuda_core_against_host(x, wg, args)

    # -- core: correctness, then interleaved timing ---------------------------------------------------
    cf = args.capacity_factor
    variants: dict[str, Callable[[], Any]] = {"dsc-core": lambda: dsc_core(x, wg, args.k, cf)}
    if args.k == 2:
        variants["torch-dense"] = lambda: torch_dense(x, wg, args.k, cf)
    ref_out = variants["dsc-core"]().float()
    for n in list(variants):
        if n == "dsc-core":
            continue
        try:
            got = variants[n]().float()
            torch.testing.assert_close(got, ref_out, rtol=2e-2, atol=2e-2)
            print(f"{n} output == dsc-core: OK", flush=True)
        except Exception as e:  # out of memory or a disagreement: reported, not timed
            print(f"{n}: not timed ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
            del variants[n]
    times: dict[str, list[float]] = {n: [] for n in variants}
    peaks: dict[str, int] = {n: 0 for n in variants}
    for n, fn in variants.items():  # warm-up (JIT builds, cuBLAS plans)
        timed(fn, device)
    for _ in range(args.reps):
        for n, fn in variants.items():
            dt, peak = timed(fn, device)
            times[n].append(dt)
            peaks[n] = max(peaks[n], peak)
    table("gating + dispatch + combine (identity experts)", [(n, times[n], peaks[n]) for n in variants], "dsc-core", S)

    # -- whole layers ---------------------------------------------------------------------------------
    layers = make_layers(args, dtype, device)

    def run_layer(layer: Any) -> Any:
        xi = x.view(1, S, M).detach().requires_grad_(args.backward)
        out, l_aux, _ = layer(xi)
        if args.backward:
            (out.float().sum() + l_aux).backward()
        return out

    base = run_layer(layers["dsc-layer"]).float()
    for n in list(layers):
        if n == "dsc-layer":
            continue
        try:
            torch.testing.assert_close(run_layer(layers[n]).float(), base, rtol=2e-2, atol=2e-2)
            print(f"{n} output == dsc-layer: OK", flush=True)
        except Exception as e:
            print(f"{n}: not timed ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
            del layers[n]
    ltimes: dict[str, list[float]] = {n: [] for n in layers}
    lpeaks: dict[str, int] = {n: 0 for n in layers}
    for layer in layers.values():
        timed(lambda layer=layer: run_layer(layer), device)
    for _ in range(args.reps):
        for n, layer in layers.items():
            dt, peak = timed(lambda layer=layer: run_layer(layer), device)
            ltimes[n].append(dt)
            lpeaks[n] = max(lpeaks[n], peak)
    what = "forward + backward" if args.backward else "forward"
    table(f"MoE layer {what} (identity experts, gate included)", [(n, ltimes[n], lpeaks[n]) for n in layers],
          "dsc-layer", S)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

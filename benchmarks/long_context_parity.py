"""FPDT layer parity and speed on the device: FPDT_Attention (bf16, 4 chunks, offload on and off) against the
unchunked Ulysses layer (DistributedAttention around torch SDPA, bf16) on the same weights and data, both
measured against an fp32 computation of the whole sequence (SDPA in fp32). Used by
`benchmarks/long_context.py --mode parity`; an 8B attention shape (32 heads, 8 kv heads, head_dim 128).

On a GPU an fp32 round at <= 4096 tokens comes first: FPDT's blocks then take the exact math path and its
CUDA offload machinery (side stream, pinned buffers, events) must reproduce fp32 within 1e-5.
Correctness first: the relative max error (max |a - ref| / max |ref|) of each bf16 layer's output and
gradients (input, QKV weight, output weight) against fp32; FPDT passes when its error is within 2x the
unchunked layer's + 2e-3 (the tolerance bf16 rounding of a different summation order allows). Then timing:
forward+backward, reps interleaved, with the peak device memory of each."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import Tensor


def _rope(n: int, hd: int, device: torch.device) -> tuple:
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    ang = torch.outer(torch.arange(n, device=device).float(), inv)
    ang = torch.cat((ang, ang), dim=-1)[:, None, None, :]
    return ang.cos(), ang.sin()


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal GQA attention on [b, s, h, d]."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
    return o.transpose(1, 2)


def _ulysses_layer(p: dict, x: Tensor, rot: tuple, heads: int, kv: int, hd: int, group: Any) -> Tensor:
    from deepspeed_c.sequence.layer import DistributedAttention

    qkv = x @ p["wqkv"].t()
    s, b = x.shape[0], x.shape[1]
    split = lambda t: t.reshape(s, b, -1, hd).permute(1, 0, 2, 3).contiguous()  # noqa: E731
    q, k, v = split(qkv[..., :heads * hd]), split(qkv[..., heads * hd:(heads + kv) * hd]), \
        split(qkv[..., (heads + kv) * hd:])
    o = DistributedAttention(_sdpa, group)(q, k, v, 0, (rot[0].to(x.dtype), rot[1].to(x.dtype)))
    return o.flatten(2).permute(1, 0, 2) @ p["wo"].t()


def _fpdt_layer(p: dict, x: Tensor, rot: tuple, heads: int, kv: int, hd: int, group: Any, chunk: int,
                offload: bool) -> Tensor:
    from deepspeed_c.sequence.fpdt_layer import FPDT_Attention

    cfg = SimpleNamespace(kv_channels=hd, num_attention_heads=heads, num_key_value_heads=kv,
                          hidden_size=x.shape[-1], attention_dropout=0.0)
    attn = FPDT_Attention(cfg, p["wqkv"], None, p["wo"], None, group, chunk_size=chunk, enable_offloading=True)
    return attn(x, None, None, rot, cpu_offloading=offload)[0]


def _ds_fpdt_layer() -> Any:
    """DeepSpeed 0.19.8's FPDT_Attention when it can run here (real DeepSpeed and flash-attn importable), else
    the reason it cannot."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash-attn not installed (DeepSpeed's FPDT requires it)"
    from long_context import real_deepspeed

    ds = real_deepspeed()
    if ds is None:
        return "the real DeepSpeed is not importable"
    from importlib import import_module

    return import_module("deepspeed.sequence.fpdt_layer").FPDT_Attention


def _ds_fpdt(cls: Any, p: dict, x: Tensor, rot: tuple, heads: int, kv: int, hd: int, group: Any, chunk: int,
             offload: bool) -> Tensor:
    cfg = SimpleNamespace(kv_channels=hd, num_attention_heads=heads, num_key_value_heads=kv,
                          hidden_size=x.shape[-1], attention_dropout=0.0)
    zero = torch.zeros(p["wqkv"].shape[0], dtype=x.dtype, device=x.device)  # DeepSpeed adds a QKV bias always
    attn = cls(cfg, p["wqkv"], zero, p["wo"], None, group, chunk_size=chunk, enable_offloading=offload)
    return attn(x, None, None, rot, cpu_offloading=offload)[0]


def _fwd_bwd(fn: Callable[[dict, Tensor], Tensor], p: dict, x: Tensor, g: Tensor) -> dict:
    leaves = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
    xl = x.detach().clone().requires_grad_()
    out = fn(leaves, xl)
    out.backward(g)
    return {"out": out.detach(), "gx": xl.grad, **{f"g{k}": v.grad for k, v in leaves.items()}}


def _rel(a: Tensor, ref: Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _setup(seq: int, heads: int, kv: int, hidden: int, dev: torch.device) -> dict:
    hd = hidden // heads
    gen = torch.Generator(device="cpu").manual_seed(0)
    return {"wqkv": torch.randn(hd * (heads + 2 * kv), hidden, generator=gen) * hidden ** -0.5,
            "wo": torch.randn(hidden, heads * hd, generator=gen) * (heads * hd) ** -0.5,
            "x": torch.randn(seq, 1, hidden, generator=gen), "g": torch.randn(seq, 1, hidden, generator=gen),
            "rot": _rope(seq, hd, dev)}


def _round(a: Any, rank: int, world: int, group: Any, low: torch.dtype, seq: int, shape: tuple,
           with_ds: bool) -> tuple:
    """One parity round: every case's errors against fp32; returns (cases, errs, data, ds note)."""
    from deepspeed_c.sequence.fpdt_layer import token_order

    dev = a.device
    heads, kv, hidden = shape
    hd = hidden // heads
    chunk = seq // 4
    d = _setup(seq, heads, kv, hidden, dev)
    rot = d["rot"]
    mine = token_order(seq, chunk, world).view(world, -1)[rank]  # FPDT's rows of this rank
    contig = torch.arange(rank * seq // world, (rank + 1) * seq // world)  # the unchunked layer's rows
    p32 = {k: d[k].to(dev) for k in ("wqkv", "wo")}
    plow = {k: v.to(low) for k, v in p32.items()}
    one = torch.distributed.new_group([rank]) if world > 1 else group
    ref = _fwd_bwd(lambda p, x: _ulysses_layer(p, x, rot, heads, kv, hd, one), p32, d["x"].to(dev), d["g"].to(dev))

    def fpdt(offload: bool) -> Callable:
        return lambda p, x: _fpdt_layer(p, x, rot, heads, kv, hd, group, chunk, offload)

    cases = {"unchunked": (lambda p, x: _ulysses_layer(p, x, rot, heads, kv, hd, group), contig),
             "fpdt-offload": (fpdt(True), mine), "fpdt-resident": (fpdt(False), mine)}
    ds_cls = _ds_fpdt_layer() if with_ds else "host run" if dev.type != "cuda" else "bf16 round only"
    if not isinstance(ds_cls, str):
        cases["ds-fpdt-offload"] = (lambda p, x: _ds_fpdt(ds_cls, p, x, rot, heads, kv, hd, group, chunk, True), mine)
    errs: dict = {}
    for name, (fn, rows) in list(cases.items()):
        try:
            r = _fwd_bwd(fn, plow, d["x"][rows].to(dev, low), d["g"][rows].to(dev, low))
        except Exception as e:  # DeepSpeed's side failing must not hide ours
            if not name.startswith("ds-"):
                raise
            ds_cls = f"{type(e).__name__}: {str(e)[:160]}"
            del cases[name]
            continue
        e = {"out": _rel(r["out"], ref["out"][rows.to(dev)]), "gx": _rel(r["gx"], ref["gx"][rows.to(dev)])}
        for k in ("gwqkv", "gwo"):
            t = r[k].float()
            torch.distributed.all_reduce(t, group=group)
            e[k] = _rel(t, ref[k])
        errs[name] = e
    from deepspeed_c.sequence import fpdt_kernels

    flash = dev.type == "cuda" and low != torch.float32 and not fpdt_kernels._FLASH_BROKEN
    _say(rank, f"FPDT parity | seq {seq} over {world} rank(s), chunk {chunk} ({seq // chunk} chunks) | heads {heads}, "
               f"kv {kv}, head_dim {hd} | {low} vs fp32 whole-sequence reference (rel. max error) | FPDT blocks on "
               f"{'torch flash kernels' if flash else 'the math path'}")
    _say(rank, f"{'layer':15s} " + " ".join(f"{k:>9s}" for k in errs["unchunked"]) + "  verdict")
    base = errs["unchunked"]
    for name, e in errs.items():
        # fp32: FPDT is exact up to summation order (1e-5); bf16: within 2x the unchunked layer's error + 2e-3
        ok = all(e[k] <= (1e-5 if low == torch.float32 else 2 * base[k] + 2e-3) for k in e)
        _say(rank, f"{name:15s} " + " ".join(f"{v:9.2e}" for v in e.values()) + ("  ok" if ok else "  FAIL"))
    if isinstance(ds_cls, str) and with_ds:
        _say(rank, f"DeepSpeed's FPDT_Attention: not run ({ds_cls})")
    return cases, plow, d


def run_parity(a: Any, rank: int, world: int) -> None:
    dev = a.device
    shape = (4, 2, 64) if dev.type == "cpu" else (a.heads, a.kv_heads, a.hidden)
    seq = min(a.parity_seq, 256) if dev.type == "cpu" else a.parity_seq
    group = torch.distributed.new_group(list(range(world)))
    if dev.type == "cuda":  # fp32 first: the CUDA offload path (side stream, pinned buffers, events) exactly
        _round(a, rank, world, group, torch.float32, min(seq, 4096), shape, with_ds=False)
    cases, plow, d = _round(a, rank, world, group, a.dtype, seq, shape, with_ds=dev.type == "cuda")
    if dev.type != "cuda":
        return
    times: dict = {n: [] for n in cases}
    peaks: dict = {}
    for _ in range(a.reps):
        for name, (fn, rows) in cases.items():
            xs, gs = d["x"][rows].to(dev, a.dtype), d["g"][rows].to(dev, a.dtype)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
            t = time.perf_counter()
            _fwd_bwd(fn, plow, xs, gs)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
            peaks[name] = (torch.cuda.max_memory_allocated() - base_mem) / 2 ** 30
    _say(rank, f"{'layer':15s} {'fwd+bwd ms':>11s} {'peak GB':>8s} {'vs unchunked':>13s}  (median of {a.reps}, "
               "interleaved)")
    med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    for name in cases:
        _say(rank, f"{name:15s} {1e3 * med[name]:11.1f} {peaks[name]:8.2f} {med['unchunked'] / med[name]:12.2f}x")


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)

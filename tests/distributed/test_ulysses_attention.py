"""DeepSpeed-Ulysses DistributedAttention against full-sequence attention in one process.

One 4-rank gloo run checks sequence-parallel sizes 2 (groups {0,1}, {2,3}) and 4, both layouts
([b, s, h, d] and [s, b, h, d]), grouped-query attention (fewer key/value heads), causal masking,
DeepSpeed's rotary_pos_emb argument, and the bad-input errors. Reference: float64 softmax attention over
the whole sequence computed by every rank alone; each rank's output slice and the gradients of its q/k/v
slices must match. Under DSC_TEST_BACKEND=nccl the sharded side runs one GPU a rank (float64 on the
GPU; the reference stays on the CPU), with the same tolerance."""
from __future__ import annotations

import numpy as np
import torch

from tests.harness import rank_device, run_distributed


class _Attention(torch.nn.Module):
    """Plain causal softmax attention; GQA by repeating key/value heads."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_dim_idx: int = 0) -> torch.Tensor:
        if batch_dim_idx == 1:  # [s, b, h, d] -> [b, s, h, d]
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        s = q.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(mask, float("-inf")).softmax(-1), v)
        return out.transpose(0, 1) if batch_dim_idx == 1 else out


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding written out: channels (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per half."""
    half = t.shape[-1] // 2
    x1, x2 = t[..., :half], t[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def _case(sp_group, sp_rank: int, sp: int, layout: int, heads: int, kv_heads: int, seed: int,
          rotary: bool = False) -> float:
    from deepspeed_c.sequence.layer import DistributedAttention

    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, 8, 4
    full = [torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(b, s, heads, d, generator=g, dtype=torch.float64)
    # DeepSpeed's rotary argument: (cos, sin) over the whole sequence as [1, s, 1, d], applied after the
    # exchange (each rank then holds every position); the reference applies it to the full q and k
    freqs = (torch.randn(1, s, 1, d, generator=g, dtype=torch.float64),
             torch.randn(1, s, 1, d, generator=g, dtype=torch.float64)) if rotary else None
    # reference: whole sequence, one process
    ref_in = [t.clone().requires_grad_(True) for t in full]
    if rotary:  # layout [s, b, h, d] here; freqs [1, s, 1, d] -> [s, 1, 1, d]
        cos, sin = (f.permute(1, 0, 2, 3) for f in freqs)
        q, k = (_rotate(t.transpose(0, 1), cos, sin).transpose(0, 1) for t in ref_in[:2])
        ref_out = _Attention()(q, k, ref_in[2])
    else:
        ref_out = _Attention()(*ref_in)
    (ref_out * weight).sum().backward()
    # sharded: this rank's slice of the sequence
    lo, hi = sp_rank * s // sp, (sp_rank + 1) * s // sp
    to_layout = (lambda t: t) if layout == 0 else (lambda t: t.transpose(0, 1).contiguous())
    dev = rank_device()
    mine = [to_layout(t[:, lo:hi]).to(dev).clone().requires_grad_(True) for t in full]
    if freqs is not None:
        freqs = tuple(f.to(dev) for f in freqs)
    attn = DistributedAttention(_Attention(), sp_group)
    out = attn(mine[0], mine[1], mine[2], layout, freqs, layout)  # batch_dim_idx, rotary, then local attn's args
    (out * to_layout(weight[:, lo:hi]).to(dev)).sum().backward()
    err = (out.detach().cpu() - to_layout(ref_out[:, lo:hi])).abs().max().item()
    for m, r in zip(mine, ref_in):
        err = max(err, (m.grad.cpu() - to_layout(r.grad[:, lo:hi])).abs().max().item())
    return err


def body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from deepspeed_c.sequence.layer import DistributedAttention

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sp2 = pairs[rank // 2]
    out: dict = {"err": {}}
    for sp, group, sp_rank in ((2, sp2, rank % 2), (4, dist.group.WORLD, rank)):
        for layout in (0, 1):
            for heads, kv in ((4, 4), (8, 4)):
                out["err"][(sp, layout, heads, kv)] = _case(group, sp_rank, sp, layout, heads, kv, seed=10 + rank // sp)
        out["err"][(sp, "rotary")] = _case(group, sp_rank, sp, 1, 8, 4, seed=20 + rank // sp, rotary=True)
    # bad input: 6 heads over 4 ranks, a 3-D input, batch_dim_idx 2, and local sequences of unequal length
    attn = DistributedAttention(_Attention(), dist.group.WORLD)
    errors = []
    dev = rank_device()
    uneven = torch.zeros(1, 2 + (rank == 3), 4, 4, device=dev)
    for args in ((torch.zeros(1, 2, 6, 4, device=dev),) * 3 + (0,), (torch.zeros(1, 2, 8, device=dev),) * 3 + (0,),
                 (torch.zeros(1, 2, 4, 4, device=dev),) * 3 + (2,), (uneven,) * 3 + (0,)):
        try:
            attn(*args)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def test_ulysses_matches_full_sequence_attention():
    results = run_distributed(body, 4, timeout=180)
    for r in results:
        assert len(r["err"]) == 10
        for case, err in r["err"].items():
            assert err < 1e-10, (case, err)
        heads, ndim, batch, uneven = r["errors"]
        assert "6 heads" in heads and "sequence parallel size 4" in heads, heads
        assert "4-D" in ndim, ndim
        assert "batch_dim_idx" in batch, batch
        assert "different shapes" in uneven and "pad the sequence" in uneven, uneven  # on every rank, no abort

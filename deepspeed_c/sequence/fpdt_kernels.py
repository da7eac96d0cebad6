"""Block attention for FPDT: one (query chunk, key/value chunk) pair at a time, with the log-sum-exp that
lets chunks be merged by an online softmax and the backward that recomputes the block's probabilities
from the merged output and log-sum-exp (the ring-attention identity: a block's gradient needs only the
final out/lse, never the other blocks).

Layout is [batch, seq, heads, head_dim] (the Ulysses gathered layout); lse is [batch, heads, seq] fp32.
GQA: key/value may hold fewer heads than the query (a divisor); each kv head serves a contiguous group.
On CUDA with fp16/bf16 and head_dim <= 256 the blocks run on torch's flash kernels
(aten._scaled_dot_product_flash_attention and its backward, which return/consume the lse); elsewhere
(CPU, fp32/fp64) an explicit math path computes in fp32 (fp64 for fp64 inputs).
The diagonal block is causal (the query chunk and key chunk cover the same positions); off-diagonal
blocks, whose keys all precede the queries, are full."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


_FLASH_BROKEN: list = []  # the first error torch's flash kernels raised here: the math path is used after it


def _use_flash(q: Tensor) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and not _FLASH_BROKEN
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward"))


def _flash_failed(e: Exception) -> None:
    """A torch build whose flash kernels reject these arguments: say so once, then compute exactly instead."""
    _FLASH_BROKEN.append(e)
    from deepspeed_c.utils.logging import logger

    logger.warning(f"FPDT: torch's flash attention kernels failed ({type(e).__name__}: {e}); using the math path")


def _expand_kv(t: Tensor, heads: int) -> Tensor:
    """[b, s, hkv, d] -> [b, s, heads, d], kv head j serving query heads j*g .. j*g+g-1."""
    group = heads // t.shape[2]
    return t if group == 1 else t.repeat_interleave(group, dim=2)


def _fold_kv(grad: Tensor, kv_heads: int) -> Tensor:
    """Sum an expanded kv gradient back onto its kv_heads heads."""
    b, s, h, d = grad.shape
    if h == kv_heads:
        return grad
    return grad.reshape(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _causal_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """Attention of one query chunk over one key/value chunk: (out [b, s, h, d] in q's dtype, or fp32 for
    the math path; lse [b, h, s] fp32/fp64)."""
    heads = q.shape[2]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    if _use_flash(q):
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2), 0.0, causal, False,
                                                                     scale=scale)
            return res[0].transpose(1, 2), res[1]
        except RuntimeError as e:
            _flash_failed(e)
    acc = _acc_dtype(q)
    qh, kh, vh = (t.transpose(1, 2).to(acc) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(_causal_mask(scores.shape[-2], scores.shape[-1], scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vh)
    return out.transpose(1, 2), lse


def merge(out: Optional[Tensor], lse: Optional[Tensor], block_out: Tensor,
          block_lse: Tensor) -> Tuple[Tensor, Tensor]:
    """Online softmax: fold one block's (out, lse) into the running pair (kept in fp32/fp64)."""
    acc = _acc_dtype(block_lse)
    block_out = block_out.to(acc)
    if out is None:
        return block_out, block_lse.to(acc)
    new_lse = torch.logaddexp(lse, block_lse)
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # [b, s, h, 1]
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one block, given the *merged* out/lse of the query chunk and its dout.
    dk/dv come back on k's head count (GQA groups summed)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
    if _use_flash(q):
        sq, sk = q.shape[1], k.shape[1]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)  # philox state: unused without dropout
        try:
            # cumulative lengths None (undefined): a defined one, even empty, selects the varlen kernel
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
                out.to(q.dtype).transpose(1, 2), lse.float().contiguous(), None, None, sq, sk, 0.0, causal, zero,
                zero, scale=scale)
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
            return dq, _fold_kv(dk, kv_heads), _fold_kv(dv, kv_heads)
        except RuntimeError as e:
            _flash_failed(e)
    acc = _acc_dtype(q)
    qh, kh, vh, oh, doh = (t.transpose(1, 2).to(acc) for t in (q, ke, ve, out, dout))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(_causal_mask(scores.shape[-2], scores.shape[-1], scores.device), float("-inf"))
    p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), doh)
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    delta = (doh * oh).sum(dim=-1, keepdim=True)  # rowsum(dO * O) over the merged output
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, kh)
    dk = torch.matmul(ds.transpose(-1, -2), qh)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, _fold_kv(dk, kv_heads), _fold_kv(dv, kv_heads)

"""The Python face of random-LTD's token moves in C (csrc/cpu/random_ltd.c, the reference) and CUDA
(csrc/cuda/random_ltd.cu): gather the kept tokens' rows, scatter rows back (replace or add), and cut an
attention mask to the kept rows and columns. Outputs are allocated here with torch; the C side only
moves bytes (and adds, for accumulate). Tensors on other devices, or a host without a C compiler, take
the same moves through torch.gather/scatter (one warning), so results never depend on what was built."""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _op(device_type: str) -> Optional[Any]:
    from deepspeed_c.ops.op_builder import RandomLTDBuilder, RandomLTDCUDABuilder

    builder = {"cpu": RandomLTDBuilder, "cuda": RandomLTDCUDABuilder}.get(device_type)
    if builder is None:
        return None
    try:
        return builder().load()
    except Exception as err:  # no compiler / nvcc here: torch's ops give the same result
        logger.warning("random-LTD: the %s token kernels are unavailable (%s); using torch.gather/scatter",
                       device_type, err)
        return None


def _idx(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return indices.to(device=device, dtype=torch.int32).contiguous()


def _expand(idx: torch.Tensor, batch_first: bool, hidden: int) -> torch.Tensor:
    i = idx.long()
    return (i if batch_first else i.t()).unsqueeze(-1).expand(-1, -1, hidden)


def gather(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """out[b, j] = hidden[b, indices[b, j]] ([keep, batch, hidden] when not batch_first)."""
    idx = _idx(indices, hidden.device)
    op = _op(hidden.device.type)
    if op is None:
        return torch.gather(hidden, 1 if batch_first else 0, _expand(idx, batch_first, hidden.shape[-1]))
    hidden = hidden.contiguous()
    b, s, h = (hidden.shape if batch_first else (hidden.shape[1], hidden.shape[0], hidden.shape[2]))
    k = idx.shape[1]
    out = hidden.new_empty((b, k, h) if batch_first else (k, b, h))
    op.gather(hidden, idx, bool(batch_first), out)
    return out


def scatter(hidden: Optional[torch.Tensor], part: Optional[torch.Tensor], indices: torch.Tensor, batch_first: bool,
            accumulate: bool = False, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`hidden` (zeros when None: then `like` gives shape and dtype) with each kept position's row replaced by
    `part`'s row (added to it when accumulate; zeroed when part is None). Kept positions are distinct per sample."""
    ref = hidden if hidden is not None else like
    if ref is None:
        raise ValueError("random-LTD scatter: give `hidden` or `like` (the shape and dtype of the result)")
    idx = _idx(indices, ref.device)
    if part is not None:
        part = part.to(ref.dtype)
    op = _op(ref.device.type)
    if op is None:
        base = hidden if hidden is not None else torch.zeros_like(ref)
        pos = _expand(idx, batch_first, ref.shape[-1])
        dim = 1 if batch_first else 0
        if part is None:
            return base.scatter(dim, pos, 0.0)
        return base.scatter_add(dim, pos, part) if accumulate else base.scatter(dim, pos, part)
    out = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
    inv = None
    if ref.device.type == "cuda":
        inv = torch.empty(ref.shape[0] * ref.shape[1], dtype=torch.int32, device=ref.device)
    op.scatter(None if hidden is None else hidden.contiguous(), None if part is None else part.contiguous(), idx,
               bool(batch_first), bool(accumulate), inv, out)
    return out


def mask_gather(mask: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """mask [batch or 1, heads, seq, seq] -> [batch, heads, keep, keep]: the kept rows and columns per sample."""
    idx = _idx(indices, mask.device)
    batch, keep = idx.shape
    op = _op(mask.device.type)
    if op is None:
        i = idx.long()
        full = mask.expand(batch, -1, -1, -1)
        rows = torch.gather(full, 2, i[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[3]))
        return torch.gather(rows, 3, i[:, None, None, :].expand(-1, mask.shape[1], keep, -1))
    out = mask.new_empty((batch, mask.shape[1], keep, keep))
    op.mask_gather(mask.contiguous(), idx, out)
    return out

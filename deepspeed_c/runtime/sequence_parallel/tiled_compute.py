"""ALST's tiled computations: work on a long sequence a tile at a time so that the large intermediate
(an MLP's 4x-wide activation, a [tokens, vocab] logits tensor) exists for one tile only.

All three recompute in backward instead of saving the intermediates: forward runs each tile under
no_grad and keeps only the input; backward re-runs each tile with grad enabled and back-propagates
that tile's slice of the incoming gradient, so parameter gradients accumulate tile by tile (the
engine's reducer sees them as it sees a reentrant activation checkpoint's nested backwards).

DeepSpeed's names and argument orders: `sequence_tiled_compute` / `SequenceTiledCompute`,
`TiledMLP.apply(fn, self, x, shards, compute_params)`, `TiledFusedLogitsLoss.apply(fn, self, x, y,
mask, shards, compute_params, output_reduction)`. One difference, same results: DeepSpeed's
TiledFusedLogitsLoss runs the tiles' backward inside forward (so parameter gradients appear before
backward is called, unscaled by gradient accumulation or a loss scale); here they are recomputed in
backward, which costs one more logits tile forward each and keeps engine.backward's scaling exact.
`compute_params` marks `ds_grad_is_ready` on the parameters as DeepSpeed does (False until the last
tile); deepspeed_c's reducers do not need the mark."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor


def _mark_ready(params: Optional[Sequence[Tensor]], ready: bool) -> None:
    for p in params or ():
        p.ds_grad_is_ready = ready


def _leaf(t: Tensor, requires_grad: bool) -> Tensor:
    return t.detach().requires_grad_(requires_grad)


def _reduce(stacked: Tensor, reduction: Optional[str]) -> Tensor:
    if reduction is None:
        return stacked
    if reduction == "mean":
        return stacked.mean()
    if reduction == "sum":
        return stacked.sum()
    raise ValueError(f"unknown value {reduction}: valid values are: none/mean/sum")


class SequenceTiledCompute(torch.autograd.Function):
    """fn(**tile of kwargs_to_shard, **kwargs_to_pass) over tiles of dimension 1 (the sequence).
    Positional layout (DeepSpeed's): fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *values."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int,  # type: ignore[override]
                keys_to_shard: list, keys_to_pass: list, grad_requiring_tensor_key: str, compute_params: Any,
                output_unshard_dimension: int, output_reduction: Optional[str], *args: Tensor) -> Tensor:
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"grad_requiring_tensor_key={grad_requiring_tensor_key!r} must be one of the sharded "
                             f"kwargs {list(keys_to_shard)}")
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        keys = list(keys_to_shard) + list(keys_to_pass)
        to_shard = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        step = math.ceil(seqlen / shards)
        ctx.fn, ctx.shards, ctx.step, ctx.key = fn, shards, step, grad_requiring_tensor_key
        ctx.index = keys.index(grad_requiring_tensor_key)
        ctx.nargs, ctx.dim, ctx.reduction = len(args), output_unshard_dimension, output_reduction
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.to_shard, ctx.passed = to_shard, passed
        with torch.no_grad():
            outs = [fn(**{k: v[:, i * step:(i + 1) * step] for k, v in to_shard.items()}, **passed)
                    for i in range(shards)]
            out = torch.stack(outs) if output_unshard_dimension == 0 else torch.cat(outs, dim=output_unshard_dimension)
            ctx.numel = out.numel()
            return _reduce(out, output_reduction)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:  # type: ignore[override]
        grad = grads[0]
        if ctx.reduction == "mean":  # d mean / d element: 1 / (tiles) for per-tile values, 1 / numel otherwise
            grad = grad / (ctx.shards if ctx.dim == 0 else ctx.numel)
        base = ctx.to_shard[ctx.key]
        base_grad = torch.zeros_like(base)
        offset = out_offset = 0
        for i in range(ctx.shards):
            _mark_ready(ctx.params, i + 1 == ctx.shards)
            tile = {k: v[:, i * ctx.step:(i + 1) * ctx.step] for k, v in ctx.to_shard.items()}
            length = tile[ctx.key].shape[1]
            tile[ctx.key] = _leaf(tile[ctx.key], True)
            with torch.enable_grad():
                out = ctx.fn(**tile, **ctx.passed)
            if ctx.reduction is not None:
                g = grad.expand_as(out)
            elif ctx.dim == 0:  # one value per tile (a loss), stacked
                g = grad[i]
            else:
                g = grad.narrow(ctx.dim, out_offset, out.shape[ctx.dim])
                out_offset += out.shape[ctx.dim]
            torch.autograd.backward(out, g)
            if tile[ctx.key].grad is not None:
                base_grad.narrow(1, offset, length).copy_(tile[ctx.key].grad)
            offset += length
        args_grads: list = [None] * ctx.nargs
        args_grads[ctx.index] = base_grad if base.requires_grad else None
        return (None,) * 9 + tuple(args_grads)


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict, kwargs_to_pass: dict,
                           grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: Optional[str] = "mean") -> Tensor:
    """Runs fn over `shards` tiles of the sequence dimension (1) of every kwargs_to_shard value and
    joins the outputs on output_unshard_dimension (0: one value per tile, stacked), then applies
    output_reduction (None, "mean" or "sum"). Only kwargs_to_shard[grad_requiring_tensor_key] gets a
    gradient; the tiles are recomputed in backward."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class TiledMLP(torch.autograd.Function):
    """fn(self, x) applied to `shards` tiles of x's second-to-last dimension (the sequence for
    [batch, seq, hidden] or [tokens, hidden]); the tiles are recomputed in backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: Tensor, shards: int,  # type: ignore[override]
                compute_params: Any) -> Tensor:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be at least 2-D ([..., seq, hidden]), got shape {tuple(x.shape)}")
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, t) for t in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        x_grad = torch.zeros_like(x)
        offset = 0
        tiles = torch.chunk(x, ctx.shards, dim=-2)
        for i, t in enumerate(tiles):
            _mark_ready(ctx.params, i + 1 == len(tiles))
            n = t.shape[-2]
            leaf = _leaf(t, True)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            torch.autograd.backward(out, grads[0].narrow(-2, offset, n))
            x_grad.narrow(-2, offset, n).copy_(leaf.grad)
            offset += n
        return None, None, x_grad if x.requires_grad else None, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over logits that never exist whole: fn(self, x_tile, y_tile[, mask_tile]) returns one
    tile's loss, x [batch, seq, hidden] and y [batch, seq] are flattened to tokens and cut into
    `shards` tiles, and the tile losses are averaged ("mean") or summed ("sum"). With tiles of
    unequal size or masks, "sum" of per-tile sums divided by the token count is the exact mean."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: Tensor, y: Tensor,  # type: ignore[override]
                mask: Optional[Tensor], shards: int, compute_params: Any, output_reduction: str) -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"x and y must be at least 2-D [batch_size, seq_len, ...], got x {tuple(x.shape)} and "
                             f"y {tuple(y.shape)}")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x and y batch/seq dims must match, got {tuple(x.shape[:2])} and {tuple(y.shape[:2])}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must be 2-D [batch_size, seq_len] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, self, shards, output_reduction
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, *(() if mask is None else (mask,)))
        with torch.no_grad():
            losses = [fn(self, *tile) for tile in _loss_tiles(x, y, mask, shards)]
        return _reduce(torch.stack(losses), output_reduction)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:  # type: ignore[override]
        x, y, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        g = grads[0] / ctx.shards if ctx.reduction == "mean" else grads[0]
        flat_grad = torch.zeros(x.shape[0] * x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
        offset = 0
        tiles = _loss_tiles(x, y, mask, ctx.shards)
        for i, (xt, *others) in enumerate(tiles):
            _mark_ready(ctx.params, i + 1 == len(tiles))
            leaf = _leaf(xt, True)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, leaf, *others)
            torch.autograd.backward(loss, g)
            flat_grad.narrow(0, offset, xt.shape[0]).copy_(leaf.grad)
            offset += xt.shape[0]
        x_grad = flat_grad.view(x.shape) if x.requires_grad else None
        return None, None, x_grad, None, None, None, None, None


def _loss_tiles(x: Tensor, y: Tensor, mask: Optional[Tensor], shards: int) -> list[tuple]:
    xs = torch.chunk(x.reshape(-1, *x.shape[2:]), shards, dim=0)
    ys = torch.chunk(y.reshape(-1, *y.shape[2:]), shards, dim=0)
    if mask is None:
        return [(a, b) for a, b in zip(xs, ys)]
    ms = torch.chunk(mask.reshape(-1), shards, dim=0)
    return [(a, b, m) for a, b, m in zip(xs, ys, ms)]

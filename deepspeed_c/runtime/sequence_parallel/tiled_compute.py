"""ALST's tiled computations: work on a long sequence a tile at a time so that the large intermediate
(an MLP's 4x-wide activation, a [tokens, vocab] logits tensor) exists for one tile only.

All three recompute in backward instead of saving the intermediates: forward runs each tile under
no_grad and keeps only the input; backward re-runs each tile with grad enabled and back-propagates
that tile's slice of the incoming gradient, so parameter gradients accumulate tile by tile (the
engine's reducer sees them as it sees a reentrant activation checkpoint's nested backwards).

That nested accumulation into `.grad` is a fast path (deepspeed_c/runtime/autograd_paths.py): it runs
only in a backward that adds into every one of the parameters' `.grad` with grad mode off. The
parameters (the module's, and compute_params) are inputs of the autograd node for that reason: its
edges let torch say which of them this backward accumulates, and give `autograd.grad(loss, [w])` and
`backward(inputs=[x])` their answer. In the fast path the last tile's parameter gradients travel through
those edges (an edge given None would run the parameter's AccumulateGrad anyway, calling its hooks with
None), so each parameter still accumulates once per tile; the parameters' tensor hooks are silenced in the
nested torch.autograd.grad that computes the last tile's gradient (torch would run them there and again at the
accumulation), so a user's hook sees each tile's gradient once, as in DeepSpeed's per-tile backward.
Elsewhere (autograd.grad, backward(inputs=), create_graph) each tile's gradients come from
`torch.autograd.grad` (hooks silenced there too) and are returned to autograd
(differentiable under create_graph); under torch.func transforms the same tiles run through plain torch
ops, no custom Function.

DeepSpeed's names and argument orders: `sequence_tiled_compute` / `SequenceTiledCompute`,
`TiledMLP.apply(fn, self, x, shards, compute_params)`, `TiledFusedLogitsLoss.apply(fn, self, x, y,
mask, shards, compute_params, output_reduction)`. One difference, same results: DeepSpeed's
TiledFusedLogitsLoss runs the tiles' backward inside forward (so parameter gradients appear before
backward is called, unscaled by gradient accumulation or a loss scale); here they are recomputed in
backward, which costs one more logits tile forward each and keeps engine.backward's scaling exact.
`compute_params` marks `ds_grad_is_ready` on the parameters as DeepSpeed does (False until the last
tile); deepspeed_c's reducers do not need the mark. sequence_tiled_compute's fn is a closure: only the
compute_params it is given are known, so without them a backward(inputs=[x]) still accumulates its
parameters' `.grad` (autograd.grad is told apart by the captured input)."""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from deepspeed_c.runtime.autograd_paths import (accumulates_in_place, partial_below, tensor_hooks_paused,
                                                 transforms_active)


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


def _graph_params(module: Any, compute_params: Any) -> List[Tensor]:
    """The parameters a tile may use, as node inputs: the module's and compute_params, once each."""
    found: dict = {}
    if isinstance(module, torch.nn.Module):
        found.update((id(p), p) for p in module.parameters())
    found.update((id(p), p) for p in (compute_params or ()))
    # a ZeRO-3 placeholder (numel 0 outside its module's forward) cannot take a gradient as an input
    return [p for p in found.values() if isinstance(p, Tensor) and p.requires_grad and p.numel() > 0]


def _accumulating(params: Sequence[Tensor]) -> bool:
    """The nested per-tile backward may add into `.grad` (the fast path): this backward accumulates every
    parameter's `.grad` with grad mode off. Without known parameters, a backward asked for chosen inputs only
    (autograd.grad, backward(inputs=)) below this node steps aside."""
    if torch.is_grad_enabled():
        return False
    if params:
        return all(accumulates_in_place(get_gradient_edge(p).node) for p in params)
    return not partial_below(torch._C._current_autograd_node())


def _leaves(out: Tensor) -> List[Tensor]:
    """The leaf tensors (parameters, the tile input) one tile's output was computed from."""
    found, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)  # an AccumulateGrad node
        if var is not None:
            found.append(var)
        else:
            todo.extend(nxt for nxt, _ in node.next_functions)
    return found


def _fast_tile(out: Tensor, grad: Tensor, leaf: Tensor, params: Sequence[Tensor], last: bool,
               returned: List[Optional[Tensor]]) -> Optional[Tensor]:
    """One tile of the fast path; returns the tile input's gradient. Earlier tiles back-propagate into `.grad`
    (a nested backward); the last one hands its parameter gradients to this node's edges, so that autograd
    accumulates them once each, as for any node (an edge given None would still run each parameter's
    AccumulateGrad, calling its hooks with None). A parameter outside `params` (a closure's) needs the nested
    backward: then the last tile takes it too."""
    if last and params:
        known = {id(p) for p in params}
        known.add(id(leaf))
        if all(id(v) in known for v in _leaves(out)):
            with tensor_hooks_paused(params):  # they run once, where the edges accumulate these gradients
                got = torch.autograd.grad(out, [leaf, *params], grad, allow_unused=True)
            returned[:] = got[1:]
            return got[0]
    torch.autograd.backward(out, grad)
    return leaf.grad


class _Replay:
    """A backward's walk over the tiles that is not the fast path: each tile's gradients from
    torch.autograd.grad, returned to autograd (and differentiable, under create_graph)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.create = torch.is_grad_enabled()
        self.param_grads: List[Optional[Tensor]] = [None] * len(self.params)

    def tile_input(self, t: Tensor) -> Tensor:
        # under create_graph the tile stays a slice of the saved input (with its history), so the returned
        # gradient's dependence on x is in the graph; otherwise a fresh leaf
        return t if self.create and t.requires_grad else _leaf(t, True)

    def run(self, tile: Tensor, out: Tensor, grad: Tensor) -> Tensor:
        """Back-propagates `grad` through one tile's `out`; returns the tile input's gradient."""
        with tensor_hooks_paused(self.params):  # the node's edges deliver the sum: the hooks run there, once
            got = torch.autograd.grad(out, [tile] + self.params, grad, allow_unused=True, create_graph=self.create)
        for j, g in enumerate(got[1:]):
            if g is not None:
                prev = self.param_grads[j]
                self.param_grads[j] = g if prev is None else prev + g
        return got[0] if got[0] is not None else torch.zeros_like(tile)


class _SequenceTiledComputeNode(torch.autograd.Function):
    """SequenceTiledCompute's autograd node (see SequenceTiledCompute)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int,  # type: ignore[override]
                keys_to_shard: list, keys_to_pass: list, grad_requiring_tensor_key: str, compute_params: Any,
                output_unshard_dimension: int, output_reduction: Optional[str], nvalues: int, *args: Any) -> Tensor:
        values, params = args[:nvalues], args[nvalues:]
        keys = list(keys_to_shard) + list(keys_to_pass)
        to_shard, passed, step = _split_values(seqlen, shards, keys_to_shard, keys_to_pass, values)
        ctx.fn, ctx.shards, ctx.step, ctx.key = fn, shards, step, grad_requiring_tensor_key
        ctx.index = keys.index(grad_requiring_tensor_key)
        ctx.nargs, ctx.dim, ctx.reduction = len(args), output_unshard_dimension, output_reduction
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.graph_params = params
        ctx.to_shard, ctx.passed = to_shard, passed
        with torch.no_grad():
            out = _tiled_outputs(fn, to_shard, passed, step, shards, output_unshard_dimension, None)
            ctx.numel = out.numel()
            return _reduce(out, output_reduction)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:  # type: ignore[override]
        grad = grads[0]
        if ctx.reduction == "mean":  # d mean / d element: 1 / (tiles) for per-tile values, 1 / numel otherwise
            grad = grad / (ctx.shards if ctx.dim == 0 else ctx.numel)
        base = ctx.to_shard[ctx.key]
        fast = _accumulating(ctx.graph_params)
        replay = None if fast else _Replay(ctx.graph_params)
        base_grad = torch.zeros_like(base) if fast else None
        returned: List[Optional[Tensor]] = [None] * len(ctx.graph_params)
        parts: List[Tensor] = []
        offset = out_offset = 0
        for i in range(ctx.shards):
            tile = {k: v[:, i * ctx.step:(i + 1) * ctx.step] for k, v in ctx.to_shard.items()}
            length = tile[ctx.key].shape[1]
            tile[ctx.key] = _leaf(tile[ctx.key], True) if fast else replay.tile_input(tile[ctx.key])
            with torch.enable_grad():
                out = ctx.fn(**tile, **ctx.passed)
            if ctx.reduction is not None:
                g = grad.expand_as(out)
            elif ctx.dim == 0:  # one value per tile (a loss), stacked
                g = grad[i]
            else:
                g = grad.narrow(ctx.dim, out_offset, out.shape[ctx.dim])
                out_offset += out.shape[ctx.dim]
            if not fast:
                with torch.enable_grad():
                    parts.append(replay.run(tile[ctx.key], out, g))
                continue
            _mark_ready(ctx.params, i + 1 == ctx.shards)
            tile_grad = _fast_tile(out, g, tile[ctx.key], ctx.graph_params, i + 1 == ctx.shards, returned)
            if tile_grad is not None:
                base_grad.narrow(1, offset, length).copy_(tile_grad)
            offset += length
        if not fast:
            base_grad = torch.cat(parts, dim=1)
        values_grads: list = [None] * (ctx.nargs - len(ctx.graph_params))
        values_grads[ctx.index] = base_grad if base.requires_grad else None
        param_grads = tuple(returned) if fast else tuple(replay.param_grads)
        return (None,) * 10 + tuple(values_grads) + param_grads


class SequenceTiledCompute(torch.autograd.Function):
    """fn(**tile of kwargs_to_shard, **kwargs_to_pass) over tiles of dimension 1 (the sequence).
    Positional layout (DeepSpeed's): fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *values."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, fn: Callable, seqlen: int, shards: int, keys_to_shard: list,  # type: ignore[override]
              keys_to_pass: list, grad_requiring_tensor_key: str, compute_params: Any,
              output_unshard_dimension: int, output_reduction: Optional[str], *values: Any) -> Tensor:
        _check_tiled_args(shards, keys_to_shard, grad_requiring_tensor_key, output_reduction)
        if not torch.compiler.is_compiling() and transforms_active():  # torch.func: the tiles, plain autograd
            to_shard, passed, step = _split_values(seqlen, shards, keys_to_shard, keys_to_pass, values)
            return _tiled_outputs(fn, to_shard, passed, step, shards, output_unshard_dimension, output_reduction)
        return _SequenceTiledComputeNode.apply(fn, seqlen, shards, list(keys_to_shard), list(keys_to_pass),
                                               grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                               output_reduction, len(values), *values,
                                               *_graph_params(None, compute_params))


def _check_tiled_args(shards: int, keys_to_shard: Sequence[str], key: str, reduction: Optional[str]) -> None:
    if reduction not in (None, "mean", "sum"):
        raise ValueError(f"unknown value {reduction}: valid values are: none/mean/sum")
    if key not in keys_to_shard:
        raise ValueError(f"grad_requiring_tensor_key={key!r} must be one of the sharded kwargs {list(keys_to_shard)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")


def _split_values(seqlen: int, shards: int, keys_to_shard: Sequence[str], keys_to_pass: Sequence[str],
                  values: Sequence[Any]) -> tuple:
    to_shard = dict(zip(keys_to_shard, values[:len(keys_to_shard)]))
    passed = dict(zip(keys_to_pass, values[len(keys_to_shard):]))
    return to_shard, passed, math.ceil(seqlen / shards)


def _tiled_outputs(fn: Callable, to_shard: dict, passed: dict, step: int, shards: int, dim: int,
                   reduction: Optional[str]) -> Tensor:
    outs = [fn(**{k: v[:, i * step:(i + 1) * step] for k, v in to_shard.items()}, **passed) for i in range(shards)]
    out = torch.stack(outs) if dim == 0 else torch.cat(outs, dim=dim)
    return _reduce(out, reduction)


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict, kwargs_to_pass: dict,
                           grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: Optional[str] = "mean") -> Tensor:
    """Runs fn over `shards` tiles of the sequence dimension (1) of every kwargs_to_shard value and
    joins the outputs on output_unshard_dimension (0: one value per tile, stacked), then applies
    output_reduction (None, "mean" or "sum"). Only kwargs_to_shard[grad_requiring_tensor_key] gets a
    gradient from the tiles (and compute_params, which are also the parameters autograd.grad can ask
    for); the tiles are recomputed in backward."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class _TiledMLPNode(torch.autograd.Function):
    """TiledMLP's autograd node (see TiledMLP)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: Tensor, shards: int,  # type: ignore[override]
                compute_params: Any, *params: Tensor) -> Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.graph_params = params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, t) for t in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        tiles = torch.chunk(x, ctx.shards, dim=-2)
        if not _accumulating(ctx.graph_params):
            replay = _Replay(ctx.graph_params)
            parts, offset = [], 0
            for t in tiles:
                leaf = replay.tile_input(t)
                with torch.enable_grad():
                    parts.append(replay.run(leaf, ctx.fn(ctx.module, leaf), grads[0].narrow(-2, offset, t.shape[-2])))
                offset += t.shape[-2]
            x_grad = torch.cat(parts, dim=-2) if x.requires_grad else None
            return (None, None, x_grad, None, None) + tuple(replay.param_grads)
        x_grad = torch.zeros_like(x)
        returned: List[Optional[Tensor]] = [None] * len(ctx.graph_params)
        offset = 0
        for i, t in enumerate(tiles):
            _mark_ready(ctx.params, i + 1 == len(tiles))
            n = t.shape[-2]
            leaf = _leaf(t, True)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            tile_grad = _fast_tile(out, grads[0].narrow(-2, offset, n), leaf, ctx.graph_params, i + 1 == len(tiles),
                                   returned)
            if tile_grad is not None:
                x_grad.narrow(-2, offset, n).copy_(tile_grad)
            offset += n
        return (None, None, x_grad if x.requires_grad else None, None, None) + tuple(returned)


class TiledMLP(torch.autograd.Function):
    """fn(self, x) applied to `shards` tiles of x's second-to-last dimension (the sequence for
    [batch, seq, hidden] or [tokens, hidden]); the tiles are recomputed in backward."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, fn: Callable, self: Any, x: Tensor, shards: int,  # type: ignore[override]
              compute_params: Any = None) -> Tensor:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be at least 2-D ([..., seq, hidden]), got shape {tuple(x.shape)}")
        if not torch.compiler.is_compiling() and transforms_active():
            return torch.cat([fn(self, t) for t in torch.chunk(x, shards, dim=-2)], dim=-2)
        return _TiledMLPNode.apply(fn, self, x, shards, compute_params, *_graph_params(self, compute_params))


class _TiledFusedLogitsLossNode(torch.autograd.Function):
    """TiledFusedLogitsLoss's autograd node (see TiledFusedLogitsLoss)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: Tensor, y: Tensor,  # type: ignore[override]
                mask: Optional[Tensor], shards: int, compute_params: Any, output_reduction: str,
                *params: Tensor) -> Tensor:
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, self, shards, output_reduction
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.graph_params = params
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
        tiles = _loss_tiles(x, y, mask, ctx.shards)
        head = (None, None)
        tail = (None, None, None, None, None)  # y, mask, shards, compute_params, output_reduction
        if not _accumulating(ctx.graph_params):
            replay = _Replay(ctx.graph_params)
            parts = []
            for xt, *others in tiles:
                leaf = replay.tile_input(xt)
                with torch.enable_grad():
                    parts.append(replay.run(leaf, ctx.fn(ctx.module, leaf, *others), g))
            x_grad = torch.cat(parts, dim=0).view(x.shape) if x.requires_grad else None
            return head + (x_grad,) + tail + tuple(replay.param_grads)
        flat_grad = torch.zeros(x.shape[0] * x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
        returned: List[Optional[Tensor]] = [None] * len(ctx.graph_params)
        offset = 0
        for i, (xt, *others) in enumerate(tiles):
            _mark_ready(ctx.params, i + 1 == len(tiles))
            leaf = _leaf(xt, True)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, leaf, *others)
            tile_grad = _fast_tile(loss, g, leaf, ctx.graph_params, i + 1 == len(tiles), returned)
            if tile_grad is not None:
                flat_grad.narrow(0, offset, xt.shape[0]).copy_(tile_grad)
            offset += xt.shape[0]
        x_grad = flat_grad.view(x.shape) if x.requires_grad else None
        return head + (x_grad,) + tail + tuple(returned)


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over logits that never exist whole: fn(self, x_tile, y_tile[, mask_tile]) returns one
    tile's loss, x [batch, seq, hidden] and y [batch, seq] are flattened to tokens and cut into
    `shards` tiles, and the tile losses are averaged ("mean") or summed ("sum"). With tiles of
    unequal size or masks, "sum" of per-tile sums divided by the token count is the exact mean."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, fn: Callable, self: Any, x: Tensor, y: Tensor, mask: Optional[Tensor],  # type: ignore[override]
              shards: int, compute_params: Any = None, output_reduction: str = "mean") -> Tensor:
        _check_loss_args(x, y, mask, shards, output_reduction)
        if not torch.compiler.is_compiling() and transforms_active():
            return _reduce(torch.stack([fn(self, *tile) for tile in _loss_tiles(x, y, mask, shards)]),
                           output_reduction)
        return _TiledFusedLogitsLossNode.apply(fn, self, x, y, mask, shards, compute_params, output_reduction,
                             *_graph_params(self, compute_params))


def _check_loss_args(x: Tensor, y: Tensor, mask: Optional[Tensor], shards: int, output_reduction: str) -> None:
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


def _loss_tiles(x: Tensor, y: Tensor, mask: Optional[Tensor], shards: int) -> list[tuple]:
    xs = torch.chunk(x.reshape(-1, *x.shape[2:]), shards, dim=0)
    ys = torch.chunk(y.reshape(-1, *y.shape[2:]), shards, dim=0)
    if mask is None:
        return [(a, b) for a, b in zip(xs, ys)]
    ms = torch.chunk(mask.reshape(-1), shards, dim=0)
    return [(a, b, m) for a, b, m in zip(xs, ys, ms)]

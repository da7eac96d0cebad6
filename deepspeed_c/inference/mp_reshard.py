"""Loading a save_mp_checkpoint_path folder written at another tp_size: each part index m of every saved rank
(`tp_{r}_{m}.pt`, r < S) holds the same names, so the parts are read together, each tensor is rebuilt whole
from its S pieces and this rank's piece for the run's N ranks is cut from it; then the part is dropped (a rank
holds one part of the whole model at a time, not all of it).

How a tensor is split, by the module that holds it at load time:
- injected blocks (FusedDecoderBlock / TPFusedDecoderBlock): wqkv / bqkv rows as heads of q, k and v; w1 / b1
  rows as the MLP's (gate and up) halves; wo / w2 columns; norms and the two output biases whole;
- AutoTP's LinearLayer (rows) and LinearAllreduce (weight columns, bias whole), vocabulary-parallel
  embedding / head (rows, zero-padded to a multiple of the size: the padding is dropped before cutting)."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import Tensor, nn

from deepspeed_c.module_inject import hybrid_tp
from deepspeed_c.module_inject.fused_block import FusedDecoderBlock
from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer, _split

Reshard = Callable[[list[Tensor]], Tensor]


def _block_rule(block: FusedDecoderBlock, attr: str, run_tp: int, rank: int) -> Reshard:
    """An injected block's tensor: wqkv / bqkv by heads of q, k and v; w1 / b1 by the MLP's halves (gate, up);
    wo / w2 by columns; the rest whole."""
    s = block.spec  # the run's (local) spec: whole counts are its counts times run_tp
    heads, kv, d = s.n_heads * run_tp, s.n_kv * run_tp, s.head_dim

    def rows(segments: Callable[[list[Tensor]], list[int]]) -> Reshard:
        def merge(pieces: list[Tensor]) -> Tensor:
            segs = segments(pieces)  # segment sizes within one saved piece
            starts = [sum(segs[:i]) for i in range(len(segs))]
            whole = torch.cat([torch.cat([p[a:a + n] for p in pieces]) for a, n in zip(starts, segs)])
            return hybrid_tp._rows(whole, [n * len(pieces) for n in segs], rank, run_tp)
        return merge

    if attr in ("wqkv", "bqkv"):
        return rows(lambda pieces: [heads // len(pieces) * d, kv // len(pieces) * d, kv // len(pieces) * d])
    if attr in ("w1", "b1"):
        halves = 2 if s.gated_silu else 1
        return rows(lambda pieces: [pieces[0].shape[0] // halves] * halves)
    if attr in ("wo", "w2"):
        return lambda pieces: hybrid_tp._rows(torch.cat(pieces, dim=1).t(), [sum(p.shape[1] for p in pieces)],
                                              rank, run_tp).t()
    return lambda pieces: pieces[0]


def _rule(module: nn.Module, attr: str, run_tp: int, rank: int, key: str) -> Reshard:
    if isinstance(module, FusedDecoderBlock):
        return _block_rule(module, attr, run_tp, rank)
    if type(module) is LinearLayer:
        return lambda pieces: module.cut_shard(torch.cat(pieces), 0, key)
    if type(module) is LinearAllreduce:
        if attr == "bias":
            return lambda pieces: pieces[0]
        return lambda pieces: _split(torch.cat(pieces, dim=1), 1, module.tp_world_size, module.tp_index, key)
    if hasattr(module, "shard_of"):
        whole_rows = getattr(module, "num_embeddings", None) or getattr(module, "out_features", None)
        return lambda pieces: module.shard_of(attr, torch.cat(pieces)[:whole_rows])
    if run_tp == 1:  # a whole (unsharded) module: the pieces' split is read off the shapes
        dest = getattr(module, attr)
        return lambda pieces: _whole_from_shapes(pieces, tuple(dest.shape), key)
    raise ValueError(f"cannot reshard '{key}' held by {type(module).__name__}")


def _whole_from_shapes(pieces: list[Tensor], shape: tuple, key: str) -> Tensor:
    """The whole tensor of `shape` whose pieces these are: replicated, rows (a vocabulary split may be padded
    past the whole) or columns; GPT-2's Conv1D ([in, out]) was saved transposed by AutoTP."""
    for flip in (False, True):
        ps = [p.t() for p in pieces] if flip else pieces
        want = shape[::-1] if flip else shape
        if tuple(ps[0].shape) == want:
            whole = ps[0]
        elif len(want) >= 1 and sum(p.shape[0] for p in ps) >= want[0] and tuple(ps[0].shape[1:]) == want[1:]:
            whole = torch.cat(ps)[:want[0]]
        elif len(want) == 2 and ps[0].shape[0] == want[0] and sum(p.shape[1] for p in ps) == want[1]:
            whole = torch.cat(ps, dim=1)
        else:
            continue
        return whole.t() if flip else whole
    raise ValueError(f"cannot rebuild '{key}' of shape {shape} from pieces {[tuple(p.shape) for p in pieces]}")


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    owners: dict[str, tuple[nn.Module, str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name in list(module._parameters) + list(module._buffers):
            owners[f"{prefix}.{name}" if prefix else name] = (module, name)
    return owners


def cut_whole(model: nn.Module, key: str, whole: Tensor, saved_tp: int, rank: int, run_tp: int) -> Tensor:
    """This rank's piece of a tensor saved whole (a non-tp file: the saving run did not shard its module) that
    the run's model holds sharded over run_tp ranks."""
    owner = _owners(model).get(key)
    if owner is None:
        raise ValueError(f"init_inference: checkpoint tensor '{key}' matches no parameter of {type(model).__name__}")
    from deepspeed_c.inference.checkpoint_loader import _slicer

    module, attr = owner
    try:
        if isinstance(module, FusedDecoderBlock):
            return _block_rule(module, attr, run_tp, rank)([whole])
        cut = _slicer(module, attr)  # AutoTP layers and vocabulary splits, as from a whole HF checkpoint
        if cut is None:
            raise ValueError(f"cannot reshard '{key}' held by {type(module).__name__}")
        return cut(whole)
    except ValueError as e:
        raise ValueError(f"init_inference: the checkpoint was saved with tp_size={saved_tp} but this run has "
                         f"tensor_parallel.tp_size={run_tp}: {e}") from None


@torch.no_grad()
def load_resharded(model: nn.Module, paths: list[str], saved_tp: int, rank: int, run_tp: int) -> set[str]:
    """Copies every tp tensor into `model` (this rank of run_tp) from the saved_tp ranks' files; returns the
    names filled."""
    from deepspeed_c.inference.checkpoint_loader import _read

    owners = _owners(model)
    state = model.state_dict(keep_vars=True)
    done: set[str] = set()
    parts = len(paths) // saved_tp
    for m in range(parts):
        pieces: list[dict[str, Any]] = [dict(_read(paths[m * saved_tp + r])) for r in range(saved_tp)]
        for key in pieces[0]:
            if key not in owners:
                raise ValueError(f"init_inference: checkpoint tensor '{key}' ({os.path.basename(paths[m * saved_tp])}) "
                                 f"matches no parameter of {type(model).__name__}")
            module, attr = owners[key]
            if attr in ("qweight", "scales"):
                raise ValueError(f"init_inference: the checkpoint was saved with tp_size={saved_tp} but this run has "
                                 f"tensor_parallel.tp_size={run_tp}, and its quantized weights ('{key}') cannot be "
                                 f"resharded (their groups follow the saved split): run with tp_size={saved_tp}")
            try:
                value = _rule(module, attr, run_tp, rank, key)([p[key] for p in pieces])
            except ValueError as e:
                raise ValueError(f"init_inference: the checkpoint was saved with tp_size={saved_tp} but this run has "
                                 f"tensor_parallel.tp_size={run_tp}: {e}") from None
            dest = state[key]
            if tuple(dest.shape) != tuple(value.shape):
                raise ValueError(f"init_inference: resharding '{key}' from tp_size={saved_tp} to {run_tp} gave shape "
                                 f"{tuple(value.shape)}, the model expects {tuple(dest.shape)}")
            dest.data.copy_(value)
            done.add(key)
        del pieces
    return done

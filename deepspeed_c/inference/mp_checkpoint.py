"""Tensor-parallel sharded inference checkpoints: `save_mp_checkpoint_path` writes them, `checkpoint=` reads them.

Layout (DeepSpeed's): in the folder, `non-tp.pt` (written by the first rank: every tensor every rank holds
whole: embeddings not split, final norm, ...), `tp_{rank:02d}_{part:02d}.pt` for each tensor-parallel rank
and part 0..7 (that rank's sharded tensors: AutoTP's LinearLayer / LinearAllreduce and vocabulary-parallel
layers, and every kernel-injected block, split or not), and `ds_inference_config.json`:
    {"type": "ds_model", "base_dir": folder, "checkpoints": {"non_tp": ["non-tp.pt"], "tp": [...]},
     "version": 1.0, "parallelization": "tp", "tp_size": N, "dtype": "float16", "deepspeed_c": {...}}
The tp list is ordered part-major (all ranks of part 0, then part 1, ...), as DeepSpeed orders it.
The extra "deepspeed_c" entry records how the weights were laid out (kernel-injected or AutoTP), so loading
them into a model prepared the other way fails naming both instead of a list of unknown keys.

Loading: the model is prepared as it was when saved (sharded / injected; on the meta device it stays
unallocated until here), then each rank reads only non-tp.pt and its own tp files: no rank ever holds
the whole model. A checkpoint saved at another tp_size is resharded (mp_reshard.py: every saved rank's tp files
are read part by part, each tensor rebuilt whole and cut for this rank); what cannot be (quantized weights,
AutoTP layers with a custom split) raises naming both sizes. DeepSpeed's own files of this form carry
DeepSpeed's injected-module names (`attn_qkvw`, ...), which the error lists as names our model lacks."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import Tensor, nn

from deepspeed_c import comm as dist

CONFIG_NAME = "ds_inference_config.json"
NON_TP = "non-tp.pt"
PARTS = 8  # DeepSpeed writes each rank's tensors in 8 files
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8"}


def is_sharded(desc: Any) -> bool:
    """A description of pre-sharded files ({"checkpoints": {"tp": [...], "non_tp": [...]}})."""
    return isinstance(desc, dict) and isinstance(desc.get("checkpoints"), dict)


def read_description(checkpoint: Any) -> Any:
    """The JSON a path names, or the dict as given (other values are checked by checkpoint_files)."""
    if isinstance(checkpoint, str) and os.path.isfile(checkpoint):
        with open(checkpoint, "r") as f:
            return json.load(f)
    return checkpoint


def _is_tp_module(module: nn.Module) -> bool:
    from deepspeed_c.module_inject.fused_block import FusedDecoderBlock
    from deepspeed_c.module_inject.layers import TensorParallel_Layer

    return isinstance(module, (TensorParallel_Layer, FusedDecoderBlock)) or hasattr(module, "shard_of")


def _split_state(model: nn.Module) -> tuple[OrderedDict, OrderedDict]:
    """(non-tp, tp) state dicts: a tensor belongs to tp when a sharded or injected module holds it."""
    tp_keys = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        if _is_tp_module(module):
            for name in module.state_dict().keys():
                tp_keys.add(f"{prefix}.{name}" if prefix else name)
    state = model.state_dict()
    non_tp = OrderedDict((k, v) for k, v in state.items() if k not in tp_keys)
    tp = OrderedDict((k, v) for k, v in state.items() if k in tp_keys)
    return non_tp, tp


def _tp_names(tp_size: int) -> list[str]:
    return [f"tp_{r:0>2d}_{m:0>2d}.pt" for m in range(PARTS) for r in range(tp_size)]


@torch.no_grad()
def save(model: nn.Module, path: str, group: Any, dtype: torch.dtype, injected: bool, kind: str = "ds_model") -> str:
    """Writes this rank's shards (ranks of the first tensor-parallel group only: other groups hold
    replicas) and, on the first rank, non-tp.pt and the JSON. Returns the JSON's path."""
    tp_size = dist.get_world_size(group) if group is not None else 1
    tp_rank = dist.get_rank(group) if group is not None else 0
    writer = (not dist.is_initialized()) or dist.get_rank() < tp_size  # the group of global rank 0
    os.makedirs(path, exist_ok=True)
    non_tp, tp = _split_state(model)
    if writer:
        keys = list(tp)
        size = len(keys) // PARTS + 1
        for m in range(PARTS):
            part = OrderedDict((k, tp[k].detach().cpu()) for k in keys[m * size:(m + 1) * size])
            torch.save(part, os.path.join(path, f"tp_{tp_rank:0>2d}_{m:0>2d}.pt"))
    if writer and tp_rank == 0:
        torch.save(OrderedDict((k, v.detach().cpu()) for k, v in non_tp.items()), os.path.join(path, NON_TP))
        desc = {"type": kind, "base_dir": path, "checkpoints": {"non_tp": [NON_TP], "tp": _tp_names(tp_size)},
                "version": 1.0, "parallelization": "tp", "tp_size": tp_size, "dtype": _DTYPE_NAMES[dtype],
                "deepspeed_c": {"kernel_inject": bool(injected)}}
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(desc, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
    return os.path.join(path, CONFIG_NAME)


def check(desc: dict, tp_size: int, injected: bool) -> None:
    """The run must match the layout the files were written in."""
    for key in ("type", "checkpoints", "version"):
        if key not in desc:
            raise ValueError(f"init_inference: the checkpoint description has no '{key}' key (expected 'type', "
                             f"'checkpoints', 'version'; got {sorted(desc)})")
    files = desc["checkpoints"]
    if "tp" not in files:
        raise ValueError(f"init_inference: a sharded checkpoint description needs checkpoints['tp'] (got "
                         f"{sorted(files)})")
    kind = desc.get("parallelization", "tp")
    if kind != "tp":
        raise NotImplementedError(f"init_inference: checkpoint parallelization={kind!r} is not built (only 'tp')")
    ours = desc.get("deepspeed_c")
    if isinstance(ours, dict) and bool(ours.get("kernel_inject")) != injected:
        said = "replace_with_kernel_inject=True" if ours.get("kernel_inject") else "replace_with_kernel_inject=False"
        raise ValueError(f"init_inference: the checkpoint holds weights saved with {said}; this run has "
                         f"replace_with_kernel_inject={injected}: prepare the model the same way")


def real_buffers(model: nn.Module) -> None:
    """Non-persistent buffers a meta-built model never got (rotary inv_freq): recomputed by building a fresh
    copy of their module from its config on the host (needed before kernel injection reads them)."""
    for module in model.modules():
        todo = [n for n in module._non_persistent_buffers_set
                if module._buffers.get(n) is not None and module._buffers[n].is_meta]
        if not todo:
            continue
        cfg = getattr(module, "config", None)
        if cfg is None:
            continue
        with torch.device("cpu"):
            fresh = type(module)(cfg)
        for n in todo:
            module._buffers[n] = getattr(fresh, n).to(module._buffers[n].dtype)


@torch.no_grad()
def load(model: nn.Module, desc: dict, tp_rank: int, base_dir: str = "", run_tp: Optional[int] = None) -> None:
    """Fills `model` (prepared as when saved) from non-tp.pt and this rank's tp files only; saved at another
    tp_size (`run_tp` differs), from every saved rank's files, resharded (mp_reshard)."""
    from deepspeed_c.inference.checkpoint_loader import _materialize, _read

    _materialize(model, torch.device("cpu"))
    files = desc["checkpoints"]
    tp_size = int(desc.get("tp_size", desc.get("mp_size", 1)))
    root = desc.get("base_dir") or base_dir
    tp_list = list(files["tp"])
    resharding = run_tp is not None and run_tp != tp_size
    if resharding:
        from deepspeed_c.inference.mp_reshard import load_resharded

        names = list(files.get("non_tp", []))
        paths = [os.path.join(root, n) if root else n for n in tp_list]
        loaded_tp = load_resharded(model, paths, tp_size, tp_rank, run_tp)
    else:
        names = list(files.get("non_tp", [])) + [tp_list[i] for i in range(len(tp_list)) if i % tp_size == tp_rank]
        loaded_tp = set()
    state = model.state_dict(keep_vars=True)
    loaded: set[str] = set(loaded_tp)
    unexpected: list[str] = []
    for name in names:
        path = os.path.join(root, name) if root else name
        for key, value in _read(path):
            dest: Optional[Tensor] = state.get(key)
            if dest is None:
                unexpected.append(key)
                continue
            if isinstance(value, (list, tuple)):  # DeepSpeed's [weight, scale] for int8
                raise ValueError(f"init_inference: checkpoint tensor '{key}' in {path} is a DeepSpeed int8 "
                                 "[weight, scale] pair, which deepspeed_c does not read")
            if resharding and tuple(dest.shape) != tuple(value.shape):  # saved whole, held sharded by this run
                from deepspeed_c.inference.mp_reshard import cut_whole

                value = cut_whole(model, key, value, tp_size, tp_rank, run_tp)
            if tuple(dest.shape) != tuple(value.shape):
                sizes = f" (saved with tp_size={tp_size}, this run has tp_size={run_tp})" if resharding else ""
                raise ValueError(f"init_inference: checkpoint tensor '{key}' in {path} has shape {tuple(value.shape)} "
                                 f"but this rank's model expects {tuple(dest.shape)}{sizes}")
            dest.data.copy_(value)
            loaded.add(key)
    if unexpected:
        raise ValueError(f"init_inference: {len(unexpected)} tensor(s) of the sharded checkpoint match no parameter of "
                         f"{type(model).__name__}: {unexpected[:8]}")
    missing = [k for k in state if k not in loaded and not _shares_loaded(state, k, loaded)]
    if missing:
        raise ValueError(f"init_inference: the sharded checkpoint {names[:3]}... holds no value for {missing[:8]}")


def _shares_loaded(state: dict, key: str, loaded: set[str]) -> bool:
    """A tied tensor (lm_head and the embedding) is loaded when any of its names was."""
    ptr = state[key].data_ptr() if not state[key].is_meta else None
    return ptr is not None and any(state[k].data_ptr() == ptr for k in loaded)

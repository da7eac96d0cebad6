"""init_inference's `checkpoint`: DeepSpeed's checkpoint description, loaded one file at a time.

The description (a dict or a JSON file path) is {"type": "ds_model" | "bloom", "checkpoints": [file, ...],
"version": ..., optional "base_dir"}: the files together hold one unsharded state dict (Hugging Face names,
e.g. a model saved in several shards). Each file is read (memory-mapped where torch allows), every tensor in
it is cut to this rank's shard of the (already tensor-parallel) module that owns it and copied in, and the
file is dropped before the next: a rank never holds more than its shard plus one file. The model may have
been built on the meta device (deepspeed.OnDevice) -- its parameters are then allocated shard-sized here.
"Megatron" descriptions (mp_rank_XX files of Megatron-LM) are not built here."""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer, _split

_ACCEPTED = ("ds_model", "bloom")


def checkpoint_files(checkpoint: Union[str, dict], base_dir: str = "") -> list[str]:
    """The files a checkpoint description names, joined to its base_dir (else the config's)."""
    if isinstance(checkpoint, str):
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f"init_inference: checkpoint={checkpoint!r} is not a file (expected a checkpoint "
                                    "JSON description or a dict)")
        with open(checkpoint, "r") as f:
            data = json.load(f)
    elif isinstance(checkpoint, dict):
        data = checkpoint
    else:
        raise ValueError(f"init_inference: checkpoint must be a JSON path or a dict, got {type(checkpoint).__name__}")
    for key in ("type", "checkpoints", "version"):
        if key not in data:
            raise ValueError(f"init_inference: the checkpoint description has no '{key}' key (expected 'type', "
                             f"'checkpoints', 'version'; got {sorted(data)})")
    kind = str(data["type"])
    if kind.lower() == "megatron":
        raise NotImplementedError("init_inference: checkpoint type 'Megatron' (Megatron-LM mp_rank files) is not "
                                  "built in deepspeed_c; describe Hugging Face state-dict files with type 'ds_model'")
    if kind.lower() not in _ACCEPTED:
        raise ValueError(f"init_inference: checkpoint type {kind!r} is not supported (expected one of {_ACCEPTED})")
    files = data["checkpoints"]
    if isinstance(files, dict):
        raise NotImplementedError("init_inference: a checkpoint description with 'tp'/'non_tp' lists (DeepSpeed's "
                                  "pre-sharded save_mp_checkpoint_path output) is not built in deepspeed_c")
    if isinstance(files, str):
        files = [files]
    root = data.get("base_dir") or base_dir
    return [os.path.join(root, f) if root else f for f in files]


def _read(path: str) -> Iterator[tuple[str, Tensor]]:
    """The file's (name, tensor) pairs, one tensor materialised at a time (safetensors read per tensor,
    torch files memory-mapped)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"init_inference: checkpoint file {path!r} does not exist (check base_dir)")
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for key in ("module", "model"):  # a DeepSpeed model-states file wraps the state dict
        if isinstance(state.get(key), dict):
            state = state[key]
    yield from state.items()


Slicer = Optional[Callable[[Tensor], Tensor]]


def _slicer(module: nn.Module, attr: str) -> Slicer:
    """How a full checkpoint tensor becomes this rank's piece of `module.attr`."""
    if hasattr(module, "shard_of"):  # vocabulary-parallel layers, per-head tables
        return lambda full: module.shard_of(attr, full)
    if not isinstance(module, TensorParallel_Layer):
        return None
    conv1d = getattr(module, "conv1d", False)

    def cut(full: Tensor) -> Tensor:
        if attr == "weight" and conv1d:
            full = full.t()  # GPT-2's Conv1D stores [in, out]
        if isinstance(module, LinearLayer):
            return module.cut_shard(full, 0, f"{module.label()}.{attr}")
        if isinstance(module, LinearAllreduce) and attr == "weight":
            return _split(full, 1, module.tp_world_size, module.tp_index, f"{module.label()}.weight")
        return full

    return cut


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Meta parameters become empty tensors on `device` (shared parameters stay shared)."""
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in fresh:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # tensor-parallel markers
                fresh[id(p)] = new
            module._parameters[name] = fresh[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _recompute_buffers(model: nn.Module, loaded: set[str]) -> list[str]:
    """Non-persistent buffers a meta-built model never got (rotary inv_freq): rebuilt from a fresh copy of
    their module made from its config on the host; returns the names that could not be rebuilt."""
    missing = []
    for prefix, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        todo = [n for n in names if f"{prefix}.{n}".lstrip(".") not in loaded and getattr(module, "_dsc_meta_" + n,
                                                                                            False)]
        if not todo:
            continue
        fresh = None
        cfg = getattr(module, "config", None)
        if cfg is not None:
            try:
                with torch.device("cpu"):
                    fresh = type(module)(cfg)
            except Exception:  # noqa: BLE001 -- a module whose constructor wants more than its config
                fresh = None
        for n in todo:
            if fresh is not None and isinstance(getattr(fresh, n, None), Tensor):
                module._buffers[n].copy_(getattr(fresh, n))
            else:
                missing.append(f"{prefix}.{n}")
    return missing


@torch.no_grad()
def load_checkpoint_shards(model: nn.Module, files: list[str], dtype: Optional[torch.dtype] = None) -> None:
    """Copies every file's tensors into `model` (shard by shard for tensor-parallel layers). `dtype` is the
    engine's target dtype; tensors take each parameter's own dtype (the model was converted before)."""
    meta_keys = set()
    for prefix, module in model.named_modules():  # remember what was never real
        for n, b in module._buffers.items():
            if b is not None and b.is_meta:
                setattr(module, "_dsc_meta_" + n, True)
        for n, p in module._parameters.items():
            if p is not None and p.is_meta:
                meta_keys.add(f"{prefix}.{n}" if prefix else n)
    _materialize(model, torch.device("cpu"))
    targets: dict[str, tuple[nn.Module, str, Slicer]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):  # a shared module answers to each name
        for name, p in module._parameters.items():
            if p is not None:
                targets[f"{prefix}.{name}" if prefix else name] = (module, name, _slicer(module, name))
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                targets[f"{prefix}.{name}" if prefix else name] = (module, name, None)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        for key, full in _read(path):
            target = targets.get(key)
            if target is None:
                unexpected.append(key)
                continue
            module, name, slicer = target
            value = slicer(full) if slicer is not None else full
            dest = module._parameters.get(name) if name in module._parameters else module._buffers[name]
            if tuple(dest.shape) != tuple(value.shape):
                raise ValueError(f"init_inference: checkpoint tensor '{key}' in {path} has shape {tuple(full.shape)}; "
                                 f"this rank's piece is {tuple(value.shape)} but the model expects {tuple(dest.shape)}")
            dest.data.copy_(value)  # cast to the model's dtype (the engine converted it already)
            loaded.add(key)
    if unexpected:
        raise ValueError(f"init_inference: {len(unexpected)} checkpoint tensor(s) match no parameter of "
                         f"{type(model).__name__}: {unexpected[:8]}")
    never = _never_loaded(targets, loaded, meta_keys)
    never += _recompute_buffers(model, loaded)
    if never:
        raise ValueError(f"init_inference: the checkpoint files {files} hold no value for {never[:8]} of a model built "
                         "on the meta device")


def _never_loaded(targets: dict, loaded: set[str], meta_keys: set[str]) -> list[str]:
    """Parameters that were meta before loading and got no value (a tied parameter counts once)."""
    got = {id(targets[k][0]._parameters[targets[k][1]]) for k in loaded if targets[k][1] in targets[k][0]._parameters}
    return [k for k in sorted(meta_keys) if k not in loaded and id(targets[k][0]._parameters[targets[k][1]]) not in got]

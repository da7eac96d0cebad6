#!/usr/bin/env python
"""Recover consolidated fp32 weights from a DeepSpeed(-c) checkpoint directory.

Standalone: imports only torch and the standard library, because a copy of this file is written
into every checkpoint directory and must run where deepspeed_c is not installed.

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--tag TAG] [--safe_serialization]

ZeRO stage 0 checkpoints hold the weights in mp_rank_00_model_states.pt (the fp32 masters in the
optimizer state when training in bf16/fp16). ZeRO stage 1/2 checkpoints in DeepSpeed's flat layout
hold each rank's slice of every parameter group in [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt;
concatenated over ranks they are the group's parameters in param_shapes order, padded at the end.
"""
from __future__ import annotations

import argparse
import enum
import glob
import json
import os
import re
from collections import OrderedDict
from typing import Any

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"


class _Attrs:
    """Stands in for the objects DeepSpeed (and deepspeed_c, for DeepSpeed's sake) pickle into ZeRO files:
    the loss scaler and fragment_address records; only their attributes are kept."""


class _ZeroStage(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# weights_only loading with exactly these of DeepSpeed's globals allowed (nothing they name is run)
_DEEPSPEED_GLOBALS = [(_Attrs, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
                      (_Attrs, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
                      (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
                      (_Attrs, "deepspeed.utils.tensor_fragment.fragment_address")]


def _load(path: str) -> Any:
    with torch.serialization.safe_globals(_DEEPSPEED_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def _tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"no 'latest' file in {checkpoint_dir}; pass tag= (directory holds: "
                                    f"{sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else '-'})")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    return path


def _zero_files(tag_dir: str) -> list[str]:
    files = glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return sorted(files, key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1)))


def _stage0_fp32(states: dict) -> "OrderedDict[str, torch.Tensor]":
    module = states["module"]
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict((k, v.float()) for k, v in module.items()
                                                        if isinstance(v, torch.Tensor) and v.is_floating_point())
    opt = states.get("optimizer")
    masters = opt.get("fp32_groups") if isinstance(opt, dict) else None
    if masters:
        # Mixed precision: the module holds rounded weights; the fp32 masters are the real ones.
        for shapes, group in zip(states["param_shapes"], masters):
            for (name, shape), tensor in zip(shapes.items(), group):
                out[name] = tensor.float().reshape(shape)
    for k, v in module.items():
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            out[k] = v
    return out


def _zero_fp32(states: dict, files: list[str]) -> "OrderedDict[str, torch.Tensor]":
    parts = [_load(f)["optimizer_state_dict"] for f in files]
    if any(p.get("layout") == "runtime" for p in parts):
        raise NotImplementedError("this ZeRO checkpoint stores partitions in deepspeed_c's runtime layout; "
                                  "load it with engine.load_checkpoint (same world size) and save a stage-0 copy")
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    groups = list(zip(*[p["single_partition_of_fp32_groups"] for p in parts]))
    for shapes, pieces in zip(states["param_shapes"], groups):
        flat = torch.cat([t.float().reshape(-1) for t in pieces])
        offset = 0
        for name, shape in shapes.items():
            n = int(torch.Size(shape).numel())
            if offset + n > flat.numel():
                raise ValueError(f"ZeRO partitions hold {flat.numel()} elements, too few for parameter {name}")
            out[name] = flat[offset:offset + n].clone().reshape(shape)
            offset += n
    for k, v in states["module"].items():  # buffers and frozen parameters come from the module
        if k not in out and isinstance(v, torch.Tensor):
            out[k] = v.float() if v.is_floating_point() else v
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The consolidated fp32 state_dict (lazy_mode is accepted; tensors are always materialised)."""
    tag_dir = _tag_dir(checkpoint_dir, tag)
    states = _load(os.path.join(tag_dir, MODEL_FILE))
    files = _zero_files(tag_dir)
    sd = _zero_fp32(states, files) if files else _stage0_fp32(states)
    if exclude_frozen_parameters:
        trainable = {n for shapes in states.get("param_shapes") or [] for n in shapes}
        buffers = set(states.get("buffer_names") or [])
        sd = OrderedDict((k, v) for k, v in sd.items() if k in trainable or k in buffers)
    for alias, target in (states.get("shared_params") or {}).items():
        if target in sd:
            sd[alias] = sd[target]
    return sd


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (moved to CPU, as DeepSpeed does)."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(sd, strict=False)
    return model


def _parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not like '5GB' or '500MB'")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}[m.group(2)])


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the consolidated fp32 weights as pytorch_model.bin / model.safetensors (sharded with an
    index json above max_shard_size, named as Hugging Face does)."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    limit = _parse_size(max_shard_size)
    shards: list[OrderedDict] = [OrderedDict()]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append(OrderedDict())
            size = 0
        shards[-1][k] = v.contiguous()
        size += nbytes
    os.makedirs(output_dir, exist_ok=True)
    ext = "safetensors" if safe_serialization else "bin"
    stem = "model" if safe_serialization else "pytorch_model"
    names = [f"{stem}.{ext}"] if len(shards) == 1 else \
        [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        path = os.path.join(output_dir, name)
        if safe_serialization:
            from safetensors.torch import save_file

            # safetensors refuses aliased storage (tied weights): give each name its own copy
            shard = OrderedDict((k, v.clone()) for k, v in shard.items())
            save_file(shard, path, metadata={"format": "pt"})
        else:
            torch.save(shard, path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        with open(os.path.join(output_dir, f"{names[0].split('-')[0]}.{ext}.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="directory holding the 'latest' file and tag folders")
    parser.add_argument("output_dir", help="directory for the fp32 weights")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()

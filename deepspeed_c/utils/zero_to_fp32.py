#!/usr/bin/env python
"""Recover consolidated fp32 weights from a DeepSpeed(-c) checkpoint directory.

Standalone: imports only torch and the standard library, because a copy of this file is written
into every checkpoint directory and must run where deepspeed_c is not installed.

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--tag TAG] [--safe_serialization]

ZeRO stage 0 checkpoints hold the weights in mp_rank_00_model_states.pt (the fp32 masters in the
optimizer state when training in bf16/fp16). ZeRO stage 1/2 checkpoints in DeepSpeed's flat layout
hold each rank's slice of every parameter group in [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt;
concatenated over ranks they are the group's parameters in param_shapes order, padded at the end.

ZeRO stage 3 checkpoints (DeepSpeed's layout) have no mp_rank_00_model_states.pt; each rank r of the
W data-parallel ranks writes two files, and these fields of them are read:

* zero_pp_rank_{r}_mp_rank_00_model_states.pt (rank 0's copy unless said otherwise):
  ``buffer_names`` (persistent buffer names; their values are taken from ``module``, whose parameter
  entries are empty placeholders), ``param_shapes`` (one ordered name -> shape mapping per optimizer
  sub-group; taken together, in order, they list the trainable parameters as laid out in
  fp32_flat_groups), ``frozen_param_shapes`` (ordered name -> full shape of every parameter the
  optimizer does not own, or None) with ``frozen_param_fragments`` read from EVERY rank's file (name ->
  that rank's 1-D shard of the parameter), ``shared_params`` (tied name -> name holding the data;
  only rank 0's file fills it).
* [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt: ``optimizer_state_dict`` with ``zero_stage`` == 3,
  ``partition_count`` (W; a list means its max) and ``fp32_flat_groups`` (rank r's flat fp32 tensor
  per sub-group).

Every parameter p (trainable or frozen) of n elements is cut into W shards of s = ceil(n / W)
elements: rank r holds elements [r*s, (r+1)*s) of the flattened p, the last rank's shard zero-padded
to s. A rank's fp32_flat_groups, concatenated, are its shards of the trainable parameters in
param_shapes order (a parameter's shard may straddle two sub-groups' tensors); so every rank's
concatenation has sum(s) elements. The result holds the buffers, then the frozen parameters, then the
trainable ones, then tied names aliasing their targets, as DeepSpeed's zero_to_fp32 orders them.
"""
from __future__ import annotations

import argparse
import enum
import glob
import json
import math
import os
import re
from collections import OrderedDict
from typing import Any, Sequence

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


def _load(path: str, mmap: bool = False) -> Any:
    with torch.serialization.safe_globals(_DEEPSPEED_GLOBALS):
        if mmap:  # tensors read only when touched (the optimizer moments never are)
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
                pass
        return torch.load(path, map_location="cpu", weights_only=True)


def _rank(path: str) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))


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
    return sorted(files, key=_rank)


def _zero3_model_files(tag_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt")), key=_rank)


def _expert_files(tag_dir: str) -> list[str]:
    """MoE checkpoints (DeepSpeed's layout): one file per expert of each MoE layer, keys in global ids."""
    return sorted(glob.glob(os.path.join(tag_dir, "layer_*_expert_*_mp_rank_*_model_states.pt")))


# DeepSpeed's public file helpers (PyTorch Lightning's convert_zero_checkpoint_to_fp32_state_dict calls
# get_optim_files and get_model_state_file on a tag directory)
def _numbers_in_order(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def get_checkpoint_files(checkpoint_dir: str, glob_pattern: str) -> list[str]:
    """The files of a tag directory that match glob_pattern, rank 10 after rank 9; raises when none do."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_numbers_in_order)
    if not files:
        raise FileNotFoundError(f"no {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir: str) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """The one model-states file that holds the client state: mp_rank_00 at stages 0-2, rank 0's at stage 3."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = MODEL_FILE if int(zero_stage) <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


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


def _zero_fp32(states: dict, parts: list[dict]) -> "OrderedDict[str, torch.Tensor]":
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


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _zero3_world(parts: list[dict], files: list[str], model_files: list[str], tag_dir: str) -> int:
    world = parts[0].get("partition_count")
    world = max(world) if isinstance(world, (list, tuple)) else int(world)
    for what, found in (("*_optim_states.pt", files), ("zero_pp_rank_*_mp_rank_00_model_states.pt", model_files)):
        ranks = [_rank(f) for f in found]
        if ranks != list(range(world)):
            raise ValueError(f"ZeRO-3 checkpoint {tag_dir} was saved by {world} ranks (partition_count) but holds "
                             f"{what} files of ranks {ranks}; a rank's files are missing or another save's are left "
                             "over: re-save the checkpoint or remove the strays")
    return world


def _zero3_fp32(model_states: list[dict], parts: list[dict], world: int,
                exclude_frozen_parameters: bool) -> "OrderedDict[str, torch.Tensor]":
    """Stage 3: every parameter is rebuilt from its ceil(numel / world)-element shard on each rank."""
    states = model_states[0]
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    buffer_names = set(states.get("buffer_names") or [])
    for name, value in states["module"].items():
        if name in buffer_names and isinstance(value, torch.Tensor):
            out[name] = _fp32(value)

    def unshard(name: str, shape: Any, shards: list[torch.Tensor]) -> torch.Tensor:
        shape = torch.Size(shape)
        numel = shape.numel()
        per_rank = math.ceil(numel / world)
        if any(t.numel() != per_rank for t in shards):
            raise ValueError(f"parameter {name} of shape {tuple(shape)} over {world} ranks needs {per_rank}-element "
                             f"shards, found {[t.numel() for t in shards]}")
        full = torch.cat([t.reshape(-1) for t in shards]) if shards else torch.empty(0)
        return full[:numel].view(shape) if full.numel() == numel else full[:numel].clone().view(shape)

    frozen_shapes = states.get("frozen_param_shapes") or {}
    if not exclude_frozen_parameters:
        for name, shape in frozen_shapes.items():
            try:
                shards = [ms["frozen_param_fragments"][name] for ms in model_states]
            except (KeyError, TypeError):
                raise ValueError(f"frozen parameter {name} is in frozen_param_shapes but a rank's model-states file "
                                 "holds no frozen_param_fragments entry for it") from None
            out[name] = _fp32(unshard(name, shape, shards))

    # each rank's sub-group tensors, read as one concatenation
    flats = [[t.reshape(-1) for t in p["fp32_flat_groups"]] for p in parts]
    sizes = [t.numel() for t in flats[0]]
    for r, groups in enumerate(flats):
        if [t.numel() for t in groups] != sizes:
            raise ValueError(f"rank {r}'s fp32_flat_groups have sizes {[t.numel() for t in groups]}, rank 0's {sizes}: "
                             "the files come from different saves")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)

    def rank_slice(groups: list[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
        pieces, end = [], start + length
        for g, tensor in enumerate(groups):
            lo, hi = max(start, bounds[g]), min(end, bounds[g + 1])
            if lo < hi:
                pieces.append(tensor[lo - bounds[g]:hi - bounds[g]])
        return pieces

    offset = 0
    for shapes in states["param_shapes"]:
        for name, shape in shapes.items():
            per_rank = math.ceil(torch.Size(shape).numel() / world)
            if offset + per_rank > bounds[-1]:
                raise ValueError(f"fp32_flat_groups hold {bounds[-1]} elements a rank, too few for parameter {name} "
                                 f"(its shard starts at {offset} and has {per_rank})")
            shards = [torch.cat(rank_slice(groups, offset, per_rank)) if per_rank else torch.empty(0)
                      for groups in flats]
            out[name] = unshard(name, shape, [t.float() for t in shards])
            offset += per_rank
    if offset != bounds[-1]:
        raise ValueError(f"param_shapes account for {offset} of the {bounds[-1]} elements each rank's fp32_flat_groups "
                         "hold: the model-states and optimizer files do not belong together")
    return out


def _check_one_model_parallel_rank(tag_dir: str) -> None:
    """The conversion consolidates data-parallel partitions; a checkpoint cut over model-parallel ranks too (a
    client mpu's, AutoTP's at ZeRO-3) would come out as rank 0's tensor-parallel shards under the whole names."""
    pattern = re.compile(r"^(?:.*zero_pp_rank_\d+_)?mp_rank_(\d+)_(?:model|optim)_states\.pt$")
    ranks = {int(m.group(1)) for f in os.listdir(tag_dir) if (m := pattern.match(f))}
    if len(ranks) > 1:
        raise ValueError(f"{tag_dir} holds the files of {len(ranks)} model-parallel (tensor-parallel) ranks: this "
                         "conversion joins data-parallel partitions only and would return model-parallel rank 0's "
                         "shards; save the whole weights with engine.save_16bit_model (it gathers both ways)")


def _fuse_autoep_experts(sd: dict, layers: Any, tag_dir: str) -> None:
    """deepspeed_c's AutoEP layers back into the model's fused expert tensors, every expert in order: gate_up =
    [w1; w3] and down = w2 per expert, from the expert files' entries (which replace both them and the fused
    tensor of the saving rank's own experts). Layers without `expert_fused_names` (DeepSpeed's own AutoEP
    layer) keep DeepSpeed's per-expert keys."""
    for entry in layers or ():
        names = entry.get("expert_fused_names") if isinstance(entry, dict) else None
        if not names:
            continue
        prefix, count = entry["expert_key_prefix"], int(entry["num_experts"])
        parts: dict[str, list] = {}
        for w in ("w1", "w2", "w3"):
            keys = [f"{prefix}.{w}.{g}" for g in range(count)]
            missing = [k for k in keys if k not in sd]
            if missing:
                raise ValueError(f"{tag_dir}: AutoEP layer {entry.get('moe_layer_id')} ('{prefix}') lacks expert "
                                 f"entries {missing[:4]}: the layer_*_expert_* files are incomplete")
            parts[w] = [sd.pop(k) for k in keys]
        sd[f"{prefix}.{names[0]}"] = torch.stack([torch.cat([a, b]) for a, b in zip(parts["w1"], parts["w3"])])
        sd[f"{prefix}.{names[1]}"] = torch.stack(parts["w2"])


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The consolidated fp32 state_dict of a stage 0-3 checkpoint (lazy_mode is accepted; tensors are
    always materialised, and each has the `.contiguous()` that DeepSpeed's lazy tensors offer)."""
    tag_dir = _tag_dir(checkpoint_dir, tag)
    _check_one_model_parallel_rank(tag_dir)
    files = _zero_files(tag_dir)
    parts = []
    for f in files:
        part = _load(f, mmap=True)["optimizer_state_dict"]
        part.pop("optimizer_state_dict", None)  # the wrapped optimizer's moments are not needed
        parts.append(part)
    if parts and int(parts[0].get("zero_stage", 0)) == 3:
        model_files = _zero3_model_files(tag_dir)
        world = _zero3_world(parts, files, model_files, tag_dir)
        model_states = [_load(f) for f in model_files]
        states = model_states[0]
        sd = _zero3_fp32(model_states, parts, world, exclude_frozen_parameters)
    else:
        states = _load(os.path.join(tag_dir, MODEL_FILE))
        sd = _zero_fp32(states, parts) if parts else _stage0_fp32(states)
    if exclude_frozen_parameters:
        trainable = {n for shapes in states.get("param_shapes") or [] for n in shapes}
        buffers = set(states.get("buffer_names") or [])
        sd = OrderedDict((k, v) for k, v in sd.items() if k in trainable or k in buffers)
    for f in _expert_files(tag_dir):  # MoE: the model file holds the non-expert weights only
        for k, v in _load(f).items():
            sd[k] = v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    _fuse_autoep_experts(sd, states.get("ds_autoep_layers"), tag_dir)
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


# names the converters accept for their output dtype (DeepSpeed's spellings; "torch.x" also works)
OUTPUT_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                      "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _output_dtype(dtype: "str | torch.dtype") -> torch.dtype:
    got = OUTPUT_DTYPE_NAMES.get(dtype.lower().removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if got not in OUTPUT_DTYPE_NAMES.values():
        raise ValueError(f"dtype {dtype!r} is not an output dtype; choose one of {sorted(OUTPUT_DTYPE_NAMES)}")
    return got


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
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                          safe_serialization, tag, exclude_frozen_parameters)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str,
                                          dtype: "str | torch.dtype" = torch.float32, max_shard_size: str = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """As convert_zero_checkpoint_to_fp32_state_dict, with the floating-point tensors cast to `dtype`
    (float32/float16/bfloat16, a name or a torch dtype); integer buffers keep theirs. Tied names stay
    one tensor after the cast."""
    out = _output_dtype(dtype)
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    cast: dict[int, torch.Tensor] = {}
    for k, v in sd.items():
        if v.is_floating_point() and v.dtype != out:
            sd[k] = cast.setdefault(id(v), v.to(out))
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


def build_parser(description: str, output_help: str,
                 dtypes: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line of this script and of zero_to_torch.py (always copied beside it, and importing it):
    DeepSpeed's options, with a required --dtype among `dtypes` where given."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("checkpoint_dir", help="directory holding the 'latest' file and tag folders")
    parser.add_argument("output_dir", help=output_help)
    if dtypes is not None:
        parser.add_argument("--dtype", required=True, choices=sorted(dtypes),
                            help="dtype of the floating-point tensors written")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest output file before the weights are split into shards with an index (e.g. 5GB, "
                             "500MB)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors files instead of torch.save pickles")
    parser.add_argument("-t", "--tag", default=None,
                        help="tag folder to convert (e.g. global_step10); default: the one named in 'latest'")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters that were not trained (requires_grad=False)")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser(__doc__.split("\n\n")[0], "directory for the fp32 weights").parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()

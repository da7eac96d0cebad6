"""AutoTP with ZeRO 1/2: the optimizer's partitions saved and loaded as the unsharded model's.

Each rank's ZeRO partitions hold the elements of its tensor-parallel shards. A save writes exactly the ZeRO
files the unsharded model trained at the same data-parallel size would have (DeepSpeed's flat layout,
zero_pp_rank_{d}_mp_rank_00_optim_states.pt), so the checkpoint loads at any TP degree, TP 1 included, and
with any data-parallel size: parameter by parameter, the fp32 master and each same-shaped optimizer state
(Adam's moments) are all-gathered over the data-parallel group (safe_get_full_*'s collective, which moves
only that parameter's elements), then over the tensor-parallel group (GPT-2's Conv1D weights back in their
layout), and the ranks of TP rank 0 keep and write the elements their file holds. A load reads the saved
files mapped, whole parameter by whole parameter, cuts this rank's TP shard and writes its slices of the
runtime partitions; the optimizer takes the result once the parameters are back to their shards (its
load re-fills the model from the masters). At most one whole parameter is held at a time.

Both run inside tensor_parallel.checkpoint_view.full_view, where every TP parameter's data is whole.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.runtime.checkpointing.zero import FP32_KEY, flat_state_keys, new_moments, runtime_state
from deepspeed_c.version import DEEPSPEED_API_VERSION


@dataclass
class TPParams:
    """What full_view knows of each tensor-parallel parameter: id -> (to_whole, to_shard, shard shape)."""
    to_whole: dict[int, Callable[[torch.Tensor], torch.Tensor]]
    to_shard: dict[int, Callable[[torch.Tensor], torch.Tensor]]
    shard_shape: dict[int, torch.Size]
    tp_rank: int


def _plans(numels: list[list[int]], world: int) -> list[PartitionPlan]:
    return [PartitionPlan.build(n, world, max(max(n, default=1), 1), DEEPSPEED_ALIGNMENT) for n in numels]


def _whole_numels(opt: Any) -> list[list[int]]:
    return [[p.numel() for p in params] for params in opt.bit16_groups]  # whole: inside full_view


def save_state(opt: Any, tp: TPParams, param_name: Callable[[torch.nn.Parameter], str]) -> Optional[tuple[int, dict]]:
    """(data-parallel rank, its ZeRO file's optimizer_state_dict) on TP rank 0's ranks, None on the others
    (the same file). A collective over the data- and tensor-parallel groups: every rank must call it."""
    from deepspeed_c.utils.tensor_fragment import _gather_param

    with opt.resident():
        sd = opt.state_dict(clone_masters=False)
        base = copy.copy(sd["base_optimizer_state"])
        base["state"] = {k: dict(v) for k, v in base["state"].items()}
        numels = _whole_numels(opt)
        plans = _plans(numels, opt.world_size)
        masters = []
        for g, plan in enumerate(plans):
            keys = flat_state_keys(base, g, sd[FP32_KEY][g].numel())
            rows = plan.slices("deepspeed", opt.rank)
            for key in [None] + keys:
                part = opt.fp32_partitions[g] if key is None else base["state"][g][key]
                dst = torch.zeros(plan.ds_partition_size, dtype=part.dtype)
                for i, p in enumerate(opt.bit16_groups[g]):
                    shape = tp.shard_shape.get(id(p), p.shape)
                    value = _gather_param(opt, g, i, part, shape.numel(), part.device).view(shape)
                    if id(p) in tp.to_whole:
                        value = tp.to_whole[id(p)](value)
                    flat = value.reshape(-1).cpu()
                    for param, _, ps, ls, n, _ in rows:
                        if param == i:
                            dst[ls:ls + n] = flat[ps:ps + n]
                if key is None:
                    masters.append(dst)
                else:
                    base["state"][g][key] = dst
    if tp.tp_rank != 0:
        return None
    out = dict(sd, base_optimizer_state=base, group_numels=numels, partition_count=opt.world_size,
               layout="deepspeed", ds_version=DEEPSPEED_API_VERSION,
               ds_partition_sizes=[plan.ds_partition_size for plan in plans])
    out[FP32_KEY] = masters
    out = deepspeed_format.with_deepspeed_fields(out, stage=opt.stage, scaler=opt.loss_scaler, plans=plans,
                                                 rank=opt.rank,
                                                 names=[[param_name(p) for p in ps] for ps in opt.bit16_groups])
    return opt.rank, out


def load_state(opt: Any, tp: TPParams, saved: Any, load_optimizer_states: bool) -> Callable[[], None]:
    """Reads the unsharded model's ZeRO files (saved at any data-parallel size) into this rank's partitions;
    returns what applies them to the optimizer, to run once the parameters are shards again. Not a collective:
    every rank reads the files it needs (a node-local checkpoint, holding only its node's files, cannot)."""
    if saved.node_local:
        raise NotImplementedError("load_checkpoint with tensor_parallel.autotp_size > 1, ZeRO 1/2 and "
                                  "checkpoint.use_node_local_storage: each rank needs every rank's ZeRO file; "
                                  "copy them into one directory and load with use_node_local_storage off")
    world = saved.model_state.get("dp_world_size") or 1
    numels = _whole_numels(opt)
    plans = _plans(numels, world)
    shape_numels = deepspeed_format.group_numels_from_shapes(saved.model_state.get("param_shapes"))
    parts = []  # mapped (torch.load mmap): only the pages of the elements read come in
    for r in range(world):
        name = deepspeed_format.find_zero_file(saved.tag_dir, r, saved.bf16, saved.mp_rank)
        obj, _ = store.load_file_mapped(saved.tag_dir, name, saved.manifest)
        part = deepspeed_format.normalize_zero_state(obj["optimizer_state_dict"], shape_numels, world)
        if part.get("group_numels") != numels:
            raise ValueError(f"ZeRO checkpoint file {name} holds parameter groups of sizes {part.get('group_numels')}; "
                             f"this model (unsharded) has {numels}: the checkpoint belongs to a different model")
        parts.append(part)
    keys = [flat_state_keys(parts[0]["base_optimizer_state"], g, parts[0][FP32_KEY][g].numel())
            for g in range(len(plans))]
    masters = bool(saved.load_from_fp32_weights)
    states = bool(load_optimizer_states)
    with opt.resident():
        moments = new_moments(opt, parts[0], keys) if states else None
        with torch.no_grad():
            for g, plan in enumerate(plans):
                by_param: dict[int, list[tuple[int, int, int, int]]] = {}
                for param, r, ps, ls, n, _ in plan.slices("deepspeed"):
                    by_param.setdefault(param, []).append((r, ps, ls, n))
                targets: list[tuple[Callable[[dict], torch.Tensor], torch.Tensor]] = []
                if masters:
                    targets.append((lambda part, g=g: part[FP32_KEY][g], opt.fp32_partitions[g].detach()))
                for key in (keys[g] if moments is not None else []):
                    targets.append((lambda part, g=g, key=key: part["base_optimizer_state"]["state"][g][key],
                                    moments[g][key]))
                for i, p in enumerate(opt.bit16_groups[g]):
                    slices = opt.param_slices(g, i)
                    for source, dst in targets:
                        whole = torch.empty(p.numel(), dtype=dst.dtype)
                        for r, ps, ls, n in by_param.get(i, []):
                            whole[ps:ps + n] = source(parts[r]).reshape(-1)[ls:ls + n]
                        value = whole.view(p.shape)  # p is whole here (full_view), in the saved layout
                        if id(p) in tp.to_shard:
                            value = tp.to_shard[id(p)](value)
                        flat = value.reshape(-1).to(dst.device)
                        for ps, ls, n in slices:
                            dst[ls:ls + n].copy_(flat[ps:ps + n])
        state = runtime_state(opt, parts[0], keys, moments)
    del parts  # runtime_state cloned what it keeps: the mappings go

    def apply() -> None:
        opt.load_state_dict(state, load_optimizer_states=states, load_from_fp32_weights=masters)

    return apply

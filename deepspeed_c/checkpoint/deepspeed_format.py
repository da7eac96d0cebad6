"""Reading checkpoints the real DeepSpeed wrote: its file names and its ZeRO-1/2 optimizer-state form,
normalised into the form deepspeed_c's loader applies (DeepSpeed's flat layout, padded partitions).

DeepSpeed (0.19.8) names ZeRO files `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt` whenever bf16 is
enabled and `zero_pp_rank_...` otherwise, and its loader tries both; it saves the fp32 partitions
without the group's trailing padding, the loss scaler as an object, and no group sizes (those come
from the model file's `param_shapes`). Pure functions over state dicts; no runtime/ imports."""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import torch

from deepspeed_c.checkpoint import ds_pickle
from deepspeed_c.checkpoint.safe_load import scaler_state
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan

FP32_KEY = "single_partition_of_fp32_groups"


def zero_file_name(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    """mp_rank: the pipeline stage in a pipeline checkpoint (00 otherwise)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def find_zero_file(tag_dir: str, dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    """The name of rank `dp_rank`'s ZeRO file in `tag_dir`: the one this precision writes first, else the
    other (as DeepSpeed's loader does, so a bf16 run loads an fp32 run's files and back)."""
    for name in (zero_file_name(dp_rank, bf16, mp_rank), zero_file_name(dp_rank, not bf16, mp_rank)):
        if os.path.isfile(os.path.join(tag_dir, name)):
            return name
    return zero_file_name(dp_rank, bf16, mp_rank)


def group_numels_from_shapes(param_shapes: Any) -> list[list[int]] | None:
    """Per-group parameter sizes from a model file's `param_shapes` (a list of name -> shape maps)."""
    if not isinstance(param_shapes, (list, tuple)) or not param_shapes:
        return None
    return [[math.prod(tuple(s)) for s in group.values()] for group in param_shapes]


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() == size:
        return flat
    if flat.numel() > size:
        raise ValueError(f"ZeRO partition holds {flat.numel()} elements; the layout allows {size}")
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def normalize_zero_state(part: dict, group_numels: Sequence[Sequence[int]] | None, world: int) -> dict:
    """One saved rank's `optimizer_state_dict` in the form from_deepspeed_layout applies. Files written by
    deepspeed_c (layout == "deepspeed") pass through; DeepSpeed's own get padded partitions, their group
    sizes and a dict loss-scaler state."""
    if part.get("layout") == "deepspeed":  # written by deepspeed_c: padded already; DeepSpeed's object fields
        count = part.get("partition_count", world)
        return dict(part, loss_scaler=scaler_state(part.get("loss_scaler")),
                    partition_count=count[0] if isinstance(count, (list, tuple)) else count)
    if group_numels is None:
        raise ValueError("a DeepSpeed-written ZeRO checkpoint needs the model file's param_shapes to know its "
                         "parameter groups; mp_rank_00_model_states.pt has none")
    base = part.get("base_optimizer_state")
    if not isinstance(base, dict) or "state" not in base:
        raise ValueError("ZeRO checkpoint's base_optimizer_state is not a torch optimizer state_dict (elastic "
                         "checkpoints are not supported yet)")
    out = dict(part)
    align = DEEPSPEED_ALIGNMENT * world
    sizes = [(-(-sum(n) // align) * align) // world for n in group_numels]
    masters = part[FP32_KEY]
    if len(masters) != len(sizes):
        raise ValueError(f"ZeRO checkpoint has {len(masters)} parameter groups; its param_shapes name {len(sizes)}")
    out[FP32_KEY] = [_padded(m, p) for m, p in zip(masters, sizes)]
    state = {}
    for g, entry in base["state"].items():
        size, have = sizes[int(g)], masters[int(g)].numel()
        state[g] = {k: _padded(v, size) if torch.is_tensor(v) and v.dim() == 1 and v.numel() in (have, size) else v
                    for k, v in entry.items()}
    out["base_optimizer_state"] = dict(base, state=state)
    out["loss_scaler"] = scaler_state(part.get("loss_scaler"))
    count = part.get("partition_count", world)
    out["partition_count"] = count[0] if isinstance(count, (list, tuple)) else count
    out.update(layout="deepspeed", group_numels=[list(n) for n in group_numels],
               ds_partition_sizes=sizes)
    return out


def normalize_mixed_state(saved: dict) -> dict:
    """DeepSpeed's FP16_Optimizer/bf16 (ZeRO-0) state keeps the scale as loose keys; ours as `loss_scaler`."""
    if "loss_scaler" in saved or "fp32_groups" not in saved:
        return saved
    out = dict(saved)
    scaler = {"cur_scale": saved.get("cur_scale", 1.0)}
    for key in ("cur_iter", "last_overflow_iter"):
        if key in saved:
            scaler[key] = saved[key]
    out["loss_scaler"] = scaler
    return out


def with_deepspeed_fields(part: dict, *, stage: int, scaler: Any, plans: Sequence[PartitionPlan],
                          names: Sequence[Sequence[str]], rank: int) -> dict:
    """One rank's ZeRO-1/2 `optimizer_state_dict` (deepspeed_c's, in DeepSpeed's flat layout) with the
    fields DeepSpeed 0.19.8's loader and tools read, in the types DeepSpeed writes them: the loss
    scaler as a LossScaler/DynamicLossScaler object (its loader calls it), the stage as ZeroStageEnum,
    per-group partition counts, the group padding this rank holds, per-parameter alignment paddings
    (none: deepspeed_c has no parameter_alignment) and param_slice_mappings (universal checkpoints).
    The partitions stay padded (DeepSpeed trims its own and pads them back on load)."""
    out = dict(part)
    out["loss_scaler"] = ds_pickle.loss_scaler_record(scaler)
    out["zero_stage"] = ds_pickle.zero_stage_record(stage)
    out["partition_count"] = [plan.world_size for plan in plans]
    paddings, slices = [], []
    for plan in plans:
        size, total = plan.ds_partition_size, sum(plan.numels)
        paddings.append(max(0, min(size, (rank + 1) * size - total)))
        slices.append([(param, lstart, length) for param, _, _, lstart, length, _ in plan.slices("deepspeed", rank)])
    out["group_paddings"] = paddings
    out["param_alignment_paddings"] = [[0] * len(plan.numels) for plan in plans]
    out["param_slice_mappings"] = ds_pickle.param_slice_mappings(names, slices)
    return out

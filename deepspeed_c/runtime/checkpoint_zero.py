"""ZeRO-1/2 optimizer state <-> DeepSpeed's on-disk layout.

The ZeRO optimizer keeps each rank's fp32 masters and Adam moments in deepspeed_c's bucketed
runtime layout. On disk, DeepSpeed's layout is used: per parameter group one flat buffer of the
parameters in order, padded to a multiple of 2 * world, rank r holding the r-th equal slice. Saving
all-gathers each group's runtime partitions and re-cuts them (PartitionPlan.convert); loading reads
every rank's file and re-cuts for this run's plan, which is also how N ranks' checkpoints load on M."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_c.version import DEEPSPEED_API_VERSION
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan

FP32_KEY = "single_partition_of_fp32_groups"


def _flat_state_keys(base: dict, g: int, numel: int) -> list[str]:
    """Names of group g's optimizer-state tensors laid out like its partition (exp_avg, exp_avg_sq...)."""
    state = base["state"].get(g, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel)


def _gather(t: torch.Tensor, world: int, group: Any) -> list[torch.Tensor]:
    if world == 1:
        return [t]
    from deepspeed_c.comm import collective_device

    dev = collective_device(group)
    send = t.detach().to(dev).contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send, group=group)
    return [p.to(t.device) for p in parts]


def to_deepspeed_layout(opt: Any) -> dict:
    """This rank's optimizer state_dict with partitions re-cut into DeepSpeed's layout (collective)."""
    sd = opt.state_dict()
    out = dict(sd)
    out["base_optimizer_state"] = base = copy.copy(sd["base_optimizer_state"])
    base["state"] = {k: dict(v) for k, v in base["state"].items()}
    out[FP32_KEY] = []
    for g, plan in enumerate(opt.partition_plans):
        master = sd[FP32_KEY][g]
        parts = _gather(master.detach().cpu(), opt.world_size, opt.dp_process_group)
        out[FP32_KEY].append(plan.convert(parts, "runtime", "deepspeed")[opt.rank].clone())
        for key in _flat_state_keys(base, g, master.numel()):
            parts = _gather(base["state"][g][key].detach().cpu(), opt.world_size, opt.dp_process_group)
            base["state"][g][key] = plan.convert(parts, "runtime", "deepspeed")[opt.rank].clone()
    out["ds_version"] = DEEPSPEED_API_VERSION  # DeepSpeed's ZeRO loader asserts it is present
    out["layout"] = "deepspeed"
    out["ds_partition_sizes"] = [plan.ds_partition_size for plan in opt.partition_plans]
    return out


def from_deepspeed_layout(opt: Any, saved: list[dict]) -> dict:
    """A state_dict for this rank's optimizer from every saved rank's DeepSpeed-layout state."""
    old_world = len(saved)
    mine = saved[min(opt.rank, old_world - 1)]
    numels = [list(plan.numels) for plan in opt.partition_plans]
    if mine.get("group_numels") != numels:
        raise ValueError(f"ZeRO checkpoint groups hold parameters of sizes {mine.get('group_numels')}, this model's "
                         f"groups {numels}: the checkpoint belongs to a different model")
    out = dict(mine)
    out.update(partition_count=opt.world_size, rank=opt.rank, layout="runtime", group_numels=numels)
    out["base_optimizer_state"] = base = copy.copy(mine["base_optimizer_state"])
    base["state"] = {k: dict(v) for k, v in base["state"].items()}
    out[FP32_KEY] = []
    for g, plan in enumerate(opt.partition_plans):
        old_plan = PartitionPlan.build(plan.numels, old_world, max(plan.numels), DEEPSPEED_ALIGNMENT)
        parts = [s[FP32_KEY][g] for s in saved]
        out[FP32_KEY].append(old_plan.convert(parts, "deepspeed", "runtime", dst_plan=plan)[opt.rank])
        for key in _flat_state_keys(mine["base_optimizer_state"], g, parts[0].numel()):
            pieces = [s["base_optimizer_state"]["state"][g][key] for s in saved]
            base["state"][g][key] = old_plan.convert(pieces, "deepspeed", "runtime", dst_plan=plan)[opt.rank]
    return out

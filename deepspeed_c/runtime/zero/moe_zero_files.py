"""ZeRO-1/2 files of a model with MoE layers: one file per data-parallel rank
([bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt) holding every MoE ZeRO member's groups in
DeepSpeed's flat layout, one member after the other; an expert group's partitions are cut over its
expert-data-parallel group (its partition_count says how many), as in DeepSpeed's MoE ZeRO files.
Loading reads, for each member, the file of the global rank that held its partition. Like DeepSpeed
(which needs a universal checkpoint for this), loading at another world size or ep_size is refused;
stage-0 MoE checkpoints load at any (runtime/checkpointing/moe.py)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.checkpoint.mapped_pages import MappedPages
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.runtime.optimizer_seam import SavedCheckpoint

LISTS = ("partition_count", "group_numels", "single_partition_of_fp32_groups", "ds_partition_sizes", "group_paddings",
         "param_alignment_paddings", "param_slice_mappings")


def member_state(m: Any, param_name: Callable[[torch.nn.Parameter], str]) -> dict:
    from deepspeed_c.runtime.checkpointing.zero import file_state

    with m.partition_export() as ex:
        ex.loss_scaler = getattr(ex.loss_scaler, "leader", ex.loss_scaler)  # followers save the leader's scale
        return file_state(ex, param_name)


def merge_member_states(states: Sequence[dict]) -> dict:
    out = dict(states[0])
    for key in LISTS:
        out[key] = [v for st in states for v in st[key]]
    base_state: dict = {}
    base_groups: list = []
    offset = 0
    for st in states:
        base = st["base_optimizer_state"]
        for g, group in enumerate(base["param_groups"]):
            base_groups.append(dict(group, params=[offset + g]))
            if g in base["state"]:
                base_state[offset + g] = base["state"][g]
        offset += len(base["param_groups"])
    out["base_optimizer_state"] = {"state": base_state, "param_groups": base_groups}
    return out


def _slice(full: dict, offset: int, n: int) -> dict:
    part = dict(full)
    for key in LISTS:
        if key in full:
            part[key] = full[key][offset:offset + n]
    base = full["base_optimizer_state"]
    part["base_optimizer_state"] = {
        "state": {g - offset: v for g, v in base["state"].items() if offset <= g < offset + n},
        "param_groups": [dict(grp, params=[i]) for i, grp in enumerate(base["param_groups"][offset:offset + n])],
    }
    return part


class _MemberFiles:
    """checkpoint_zero's saved-files interface for one member: its rank r is global rank ranks[r]; its
    groups are [offset, offset + n) of each file."""

    layout = "deepspeed"

    def __init__(self, ex: Any, ranks: list[int], offset: int, saved: SavedCheckpoint) -> None:
        self.tag_dir, self.manifest, self.bf16 = saved.tag_dir, saved.manifest, saved.bf16
        self.ranks, self.offset, self.n = ranks, offset, len(ex.plans)
        self.world = ex.world_size
        self.numels = [list(plan.numels) for plan in ex.plans]
        self.plans = [PartitionPlan.build(plan.numels, self.world, max(max(plan.numels, default=1), 1),
                                          DEEPSPEED_ALIGNMENT) for plan in ex.plans]

    def open(self, r: int) -> tuple[dict, MappedPages]:
        name = deepspeed_format.find_zero_file(self.tag_dir, self.ranks[r], self.bf16)
        obj, mapped = store.load_file_mapped(self.tag_dir, name, self.manifest)
        part = _slice(obj["optimizer_state_dict"], self.offset, self.n)
        if part.get("layout") != "deepspeed":
            raise NotImplementedError(f"load_checkpoint: {name} was not written by deepspeed_c; DeepSpeed-written "
                                      "MoE ZeRO files are not read yet")
        if part.get("group_numels") != self.numels or part.get("partition_count") != [self.world] * self.n:
            raise NotImplementedError(
                f"load_checkpoint: {name} holds groups of sizes {part.get('group_numels')} partitioned over "
                f"{part.get('partition_count')} ranks where this model's MoE ZeRO member has {self.numels} over "
                f"{self.world}: another ep_size (or model). A model with MoE layers at ZeRO stage 1/2 loads its ZeRO "
                "files only at the same world size and ep_size, as DeepSpeed; checkpoints saved at stage 0 load at any")
        return deepspeed_format.normalize_zero_state(part, None, self.world), MappedPages(obj, mapped)

    def keys(self, part: dict) -> list[list[str]]:
        from deepspeed_c.runtime.checkpointing.zero import FP32_KEY, flat_state_keys

        base = part["base_optimizer_state"]
        return [flat_state_keys(base, g, part[FP32_KEY][g].numel()) for g in range(self.n)]


def load_members(opt: Any, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
    from deepspeed_c.runtime.checkpointing.zero import load_same_world
    from deepspeed_c.utils import groups

    saved_world = saved.model_state.get("dp_world_size") or 1
    if saved.partitioned_weights or saved_world != opt.dp_world_size:
        raise NotImplementedError(
            f"load_checkpoint: {saved.tag_dir} was saved by {saved_world} data-parallel ranks"
            f"{' at ZeRO stage 3' if saved.partitioned_weights else ''}; a model with MoE layers at ZeRO stage 1/2 "
            f"loads its ZeRO files only at the same world size and ep_size ({opt.dp_world_size} ranks now), as "
            "DeepSpeed; checkpoints saved at stage 0 load at any")
    masters, states = bool(saved.load_from_fp32_weights), bool(load_optimizer_states)
    offset = 0
    for m, name in zip(opt.members, opt.member_names):
        ranks = (list(groups._get_expert_data_parallel_group_ranks(name)) if name is not None
                 else list(range(opt.dp_world_size)))
        with m.partition_export() as ex:
            state = load_same_world(ex, _MemberFiles(ex, ranks, offset, saved), masters, states)
            m.import_partition_state(state, states, masters)
            offset += len(ex.plans)

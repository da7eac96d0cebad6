"""ZeRO-1/2 files of a model with MoE layers: one file per data-parallel rank
([bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt) holding every MoE ZeRO member's groups in
DeepSpeed's flat layout, one member after the other; an expert group's partitions are cut over its
expert-data-parallel group (its partition_count says how many), as in DeepSpeed's MoE ZeRO files.
Loading reads, for each member, the file of the global rank that held its partition. Like DeepSpeed
(which needs a universal checkpoint for this), loading at another world size or ep_size is refused;
stage-0 MoE checkpoints load at any. The layout is runtime/checkpointing/moe.py's, which converts each
member's partition_export; what is left here is the MoE ZeRO optimizer's side of it (which member, which
ranks), called from its checkpoint methods (runtime/zero/moe_zero.py) until the checkpointer takes an
export of the whole MoE optimizer."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from deepspeed_c.runtime.optimizer_seam import SavedCheckpoint


def member_state(m: Any, param_name: Callable[[torch.nn.Parameter], str]) -> dict:
    from deepspeed_c.runtime.checkpointing.moe import member_file_state

    with m.partition_export() as ex:
        return member_file_state(ex, param_name)


def merge_member_states(states: Sequence[dict]) -> dict:
    from deepspeed_c.runtime.checkpointing.moe import merge_member_states as merge

    return merge(states)


def load_members(opt: Any, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
    from deepspeed_c.runtime.checkpointing.moe import check_zero_world, read_member_state
    from deepspeed_c.utils import groups

    check_zero_world(saved, opt.dp_world_size)
    masters, states = bool(saved.load_from_fp32_weights), bool(load_optimizer_states)
    offset = 0
    for m, name in zip(opt.members, opt.member_names):
        ranks = (list(groups._get_expert_data_parallel_group_ranks(name)) if name is not None
                 else list(range(opt.dp_world_size)))
        with m.partition_export() as ex:
            state = read_member_state(ex, ranks, offset, saved, masters, states)
            m.import_partition_state(state, states, masters)
            offset += len(ex.plans)

"""deepspeed.utils.groups: the process groups DeepSpeed's code and users query.

Data parallel runs over the whole world, or over the ranks holding the same tensor-parallel shard once
_init_tp_mesh_device built the (data, tensor) mesh (AutoTP); the sequence parallel queries answer from
runtime/sequence_parallel/parallel_state_sp once its groups exist (size 1 before: DistributedAttention takes
its group directly); MoE layers add expert-parallel and expert-data-parallel groups named ep_size_{n}."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    if mpu is not None:
        raise NotImplementedError("deepspeed_c.utils.groups.initialize(mpu=...): model parallel groups are not built "
                                  "yet (tensor parallel issue)")
    _create_expert_and_data_parallel(ep_size)


# -- tensor parallelism (AutoTP) ---------------------------------------------------------------------
# A (data, tensor) mesh: tensor-parallel groups are consecutive ranks [i*tp, (i+1)*tp), the data-parallel
# groups the strided ranks [j, j+tp, ...] (DeepSpeed's mesh order). Unset, both worlds are as above.
_TP_GROUPS: Any = None  # (tp_size, tp_group, tp_ranks, dp_group, dp_ranks) once _init_tp_mesh_device ran


def tensor_parallel_layout(world_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tensor-parallel groups, data-parallel groups) as rank lists; pure arithmetic."""
    if tp_size < 1 or world_size % tp_size != 0:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} does not divide the world size ({world_size}): "
                         "every rank must belong to one tensor-parallel group of autotp_size ranks")
    tp = [list(range(i * tp_size, (i + 1) * tp_size)) for i in range(world_size // tp_size)]
    dp = [list(range(j, world_size, tp_size)) for j in range(tp_size)]
    return tp, dp


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: Any = None) -> tuple[Any, Any]:
    """Builds the tensor- and data-parallel groups (every rank must call it); returns (dp group, tp group)."""
    global _TP_GROUPS
    if _TP_GROUPS is not None:
        if _TP_GROUPS[0] != tensor_model_parallel_size:
            raise ValueError(f"tensor-parallel groups of size {_TP_GROUPS[0]} already exist; cannot rebuild them "
                             f"with size {tensor_model_parallel_size} in the same process")
        return _TP_GROUPS[3], _TP_GROUPS[1]
    if not _initialized():
        raise RuntimeError("tensor-parallel groups need torch.distributed initialized (deepspeed.init_distributed())")
    world, rank = dist.get_world_size(), dist.get_rank()
    if data_parallel_size is not None and data_parallel_size * tensor_model_parallel_size != world:
        raise ValueError(f"data_parallel_size={data_parallel_size} x autotp_size={tensor_model_parallel_size} "
                         f"!= world size {world}")
    tps, dps = tensor_parallel_layout(world, tensor_model_parallel_size)
    mine: dict[str, Any] = {}
    for kind, layout in (("tp", tps), ("dp", dps)):
        for ranks in layout:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = (group, ranks)
    _TP_GROUPS = (tensor_model_parallel_size, mine["tp"][0], mine["tp"][1], mine["dp"][0], mine["dp"][1])
    return _TP_GROUPS[3], _TP_GROUPS[1]


def _reset_tp_groups() -> None:
    global _TP_GROUPS
    _TP_GROUPS = None


# A client's model-parallel mpu (initialize(mpu=...) with Megatron-style tensor parallelism): DeepSpeed's
# `groups.mpu`, which the data- and model-parallel queries below answer from once the engine set it.
_CLIENT_MPU: Any = None


def _set_client_mpu(mpu: Any) -> None:
    global _CLIENT_MPU
    _CLIENT_MPU = mpu


def _tensor_call(name: str) -> Any:
    """The client mpu's Megatron tensor-parallel getter `name`, else DeepSpeed's model-parallel one."""
    fn = getattr(_CLIENT_MPU, name.replace("model_parallel", "tensor_model_parallel"), None)
    return fn() if callable(fn) else getattr(_CLIENT_MPU, name)()


def get_data_parallel_group() -> Any:
    if _CLIENT_MPU is not None:
        return _CLIENT_MPU.get_data_parallel_group()
    if _TP_GROUPS is not None:
        return _TP_GROUPS[3]
    return dist.group.WORLD if _initialized() else None


_get_data_parallel_group = get_data_parallel_group


def get_data_parallel_world_size() -> int:
    if _CLIENT_MPU is not None:
        return int(_CLIENT_MPU.get_data_parallel_world_size())
    if _TP_GROUPS is not None:
        return len(_TP_GROUPS[4])
    return dist.get_world_size() if _initialized() else 1


_get_data_parallel_world_size = get_data_parallel_world_size


def get_data_parallel_rank() -> int:
    if _CLIENT_MPU is not None:
        return int(_CLIENT_MPU.get_data_parallel_rank())
    if _TP_GROUPS is not None:
        return _TP_GROUPS[4].index(dist.get_rank())
    return dist.get_rank() if _initialized() else 0


_get_data_parallel_rank = get_data_parallel_rank


def _get_data_parallel_group_ranks() -> list[int]:
    if _CLIENT_MPU is not None:
        return sorted(dist.get_process_group_ranks(_CLIENT_MPU.get_data_parallel_group()))
    if _TP_GROUPS is not None:
        return list(_TP_GROUPS[4])
    return list(range(get_data_parallel_world_size()))


def _get_broadcast_src_rank() -> int:
    return _TP_GROUPS[4][0] if _TP_GROUPS is not None else 0


def get_model_parallel_world_size() -> int:
    if _CLIENT_MPU is not None:
        return int(_tensor_call("get_model_parallel_world_size"))
    return _TP_GROUPS[0] if _TP_GROUPS is not None else 1


get_tensor_model_parallel_world_size = _get_model_parallel_world_size = get_model_parallel_world_size


def get_model_parallel_rank() -> int:
    if _CLIENT_MPU is not None:
        return int(_tensor_call("get_model_parallel_rank"))
    return _TP_GROUPS[2].index(dist.get_rank()) if _TP_GROUPS is not None else 0


get_tensor_model_parallel_rank = get_model_parallel_rank


def get_model_parallel_group() -> Any:
    if _CLIENT_MPU is not None:
        return _tensor_call("get_model_parallel_group")
    return _TP_GROUPS[1] if _TP_GROUPS is not None else None


def get_tensor_model_parallel_src_rank() -> int:
    if _CLIENT_MPU is not None:
        return min(dist.get_process_group_ranks(get_model_parallel_group()))
    return _TP_GROUPS[2][0] if _TP_GROUPS is not None else 0


get_tensor_model_parallel_group = get_model_parallel_group


def _sp_state() -> Any:
    """parallel_state_sp once Ulysses groups exist (register_with_transformers, mesh_param, or the config's
    data_parallel_size x sequence_parallel_size), else None."""
    import sys

    state = sys.modules.get("deepspeed_c.runtime.sequence_parallel.parallel_state_sp")
    return state if state is not None and state.is_initialized() else None


def _get_sequence_parallel_world_size() -> int:
    state = _sp_state()
    return state.get_sequence_parallel_world_size() if state is not None else 1


def _get_sequence_parallel_rank() -> int:
    state = _sp_state()
    return state.get_sequence_parallel_rank() if state is not None else 0


def _get_sequence_parallel_group() -> Any:
    state = _sp_state()
    return state.get_sequence_parallel_group() if state is not None else None


def _get_sequence_data_parallel_world_size() -> int:
    state = _sp_state()
    return state.get_sequence_data_parallel_world_size() if state is not None else get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    state = _sp_state()
    return state.get_sequence_data_parallel_rank() if state is not None else get_data_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    state = _sp_state()
    return state.get_sequence_data_parallel_group() if state is not None else get_data_parallel_group()


# -- expert parallelism (MoE) ------------------------------------------------------------------------
# Named by ep_size ("ep_size_{n}"). With world size W and ep size n (E + D order, DeepSpeed's default):
# expert-parallel groups are consecutive ranks [i*n, (i+1)*n) (the all-to-all runs there); the
# expert-data-parallel groups are the strided ranks [j, j+n, j+2n, ...] (ranks holding the same
# experts: their expert gradients are reduced there). use_data_before_expert_parallel_ swaps the two.
_EXPERT_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}


def _ensure_divisibility(numerator: int, denominator: int) -> None:
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def expert_layout(world_size: int, ep_size: int, use_data_before_expert_parallel_: bool = False
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as rank lists; pure arithmetic."""
    if ep_size > world_size:
        raise ValueError(f"ep_size={ep_size} is larger than the world size ({world_size}): an expert-parallel group "
                         "cannot have more ranks than there are")
    if world_size % ep_size != 0:
        raise ValueError(f"ep_size={ep_size} does not divide the world size ({world_size}): every rank must belong to "
                         "one expert-parallel group of ep_size ranks")
    dp = world_size // ep_size
    if use_data_before_expert_parallel_:
        edp = [list(range(i * dp, (i + 1) * dp)) for i in range(ep_size)]
        ep = [list(range(i, world_size, dp)) for i in range(dp)]
    else:
        ep = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(dp)]
        edp = [list(range(i, world_size, ep_size)) for i in range(ep_size)]
    return ep, edp


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: Any = None, pp_size: Any = None,
                                     mp_mode: str = "tp", use_data_before_expert_parallel_: bool = False,
                                     folding_spec: Any = None) -> None:
    """Creates the ep_size_{n} expert and expert-data-parallel groups (every rank must call it)."""
    if not _initialized():
        raise RuntimeError("expert-parallel groups need torch.distributed initialized (deepspeed.init_distributed())")
    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or folding_spec is not None:
        raise NotImplementedError("expert parallelism combined with tensor/pipeline parallelism is not built yet")
    name = f"ep_size_{expert_parallel_size_}"
    if name in _EXPERT_PARALLEL_GROUP:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    ep, edp = expert_layout(world, expert_parallel_size_, use_data_before_expert_parallel_)
    for ranks in edp:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        if rank in ranks:
            _EXPERT_DATA_PARALLEL_GROUP[name], _EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = group, ranks
    for ranks in ep:
        group = dist.new_group(ranks)
        if rank in ranks:
            _EXPERT_PARALLEL_GROUP[name], _EXPERT_PARALLEL_GROUP_RANKS[name] = group, ranks


def _lookup(table: dict[str, Any], group_name: str, what: str) -> Any:
    if group_name not in table:
        raise AssertionError(f"{what} group {group_name!r} is not initialized (known: {sorted(table)}); "
                             "deepspeed.initialize creates the groups of the model's MoE layers")
    return table[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _lookup(_EXPERT_PARALLEL_GROUP, group_name, "expert parallel")


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _lookup(_EXPERT_PARALLEL_GROUP_RANKS, group_name, "expert parallel")


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP, group_name, "expert data parallel")


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP_RANKS, group_name, "expert data parallel")


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    return _get_expert_parallel_group_ranks(group_name)[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_max_expert_size() -> Any:
    sizes = [int(k.split("_")[2]) for k in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    return 1  # no expert tensor parallelism


def _reset_expert_groups() -> None:
    """Forget every expert group (tests that re-initialise torch.distributed in one process)."""
    for table in (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, _EXPERT_DATA_PARALLEL_GROUP,
                  _EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()

"""MiCS's process groups (DeepSpeed 0.19.6's `zero_optimization.mics_shard_size`, `mics_hierarchical_params_gather`).

The data-parallel ranks (in their group's order) are cut into shard groups of `mics_shard_size` consecutive
ranks: ZeRO-3's parameters, gradients and optimizer states are partitioned inside a shard group, and every
shard group holds a whole replica of the model states. The ranks at the same place of every shard group form
a replica group, over which the gradient partitions are all-reduced once per step. With hierarchical gather,
a shard group spanning several nodes is cut once more: the ranks of one node (intra-node group) and the ranks
at the same place of each node (inter-node group), so a parameter gather is one all-gather across nodes of
1/S of the unit, then one inside the node.

Ranks per node: the NDEV_PER_NODE environment variable (DeepSpeed's debugging knob), else LOCAL_WORLD_SIZE
(the launcher's), else the accelerator's device count. The groups are created once per layout (every rank
creates every group in the same order, as torch.distributed requires) and shared by MiCS_Init and the
engine."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

SHARD_KEY = "zero_optimization.mics_shard_size"
HIER_KEY = "zero_optimization.mics_hierarchical_params_gather"


@dataclass
class MiCS_CommGroups:  # noqa: N801 (DeepSpeed's class name and field names)
    """This rank's MiCS groups: shard (partition) group, replica group, and the hierarchical gather's two."""
    param_shard_group: Any = None
    param_shard_size: int = -1
    param_shard_rank: int = -1
    param_repli_group: Any = None
    param_repli_size: int = -1
    param_repli_rank: int = -1
    param_intra_node_group: Any = None
    param_inter_node_shard_group: Any = None
    intra_node_size: int = 1  # ranks of one node inside the shard group (hierarchical gather)
    inter_node_size: int = 1  # nodes the shard group spans (hierarchical gather)

    @property
    def hierarchical(self) -> bool:
        return self.param_intra_node_group is not None and self.param_inter_node_shard_group is not None


@dataclass(frozen=True)
class MiCSLayout:
    """Global ranks of every group, the same on every rank."""
    shard_groups: list[list[int]]
    replica_groups: list[list[int]]
    intra_node_groups: list[list[int]]  # empty without hierarchical gather
    inter_node_groups: list[list[int]]


def devices_per_node() -> int:
    for var in ("NDEV_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(var, "").strip()
        if value:
            return max(1, int(value))
    from deepspeed_c.accelerator import get_accelerator

    return max(1, int(get_accelerator().device_count() or 1))


def check_shard_size(shard_size: int, world_size: int) -> None:
    """DeepSpeed's rule: the shard size divides the data-parallel world."""
    if shard_size <= 0 or world_size % shard_size != 0:
        raise ValueError(f"{SHARD_KEY}={shard_size} must divide the data-parallel world size ({world_size}): the model "
                         f"states are sharded over groups of {shard_size} consecutive ranks and replicated across "
                         "the groups")


def mics_layout(ranks: list[int], shard_size: int, hierarchical: bool = False, per_node: int = 1) -> MiCSLayout:
    """The groups of `ranks` (the data-parallel group's global ranks, in order) for `shard_size`."""
    check_shard_size(shard_size, len(ranks))
    shards = [ranks[i:i + shard_size] for i in range(0, len(ranks), shard_size)]
    replicas = [ranks[j::shard_size] for j in range(shard_size)]
    intra: list[list[int]] = []
    inter: list[list[int]] = []
    if hierarchical:
        span = shard_size // per_node if shard_size % per_node == 0 else 0
        if span <= 1:
            raise ValueError(f"{HIER_KEY}: a shard group of {shard_size} ranks ({SHARD_KEY}) with {per_node} ranks "
                             "per node (NDEV_PER_NODE, else LOCAL_WORLD_SIZE) does not span whole nodes: the "
                             "hierarchical gather needs the shard size to be a multiple (> 1) of the ranks per node; "
                             f"set {HIER_KEY} false")
        for shard in shards:
            nodes = [shard[i:i + per_node] for i in range(0, shard_size, per_node)]
            intra += nodes
            inter += [[node[k] for node in nodes] for k in range(per_node)]
    return MiCSLayout(shards, replicas, intra, inter)


_CACHE: dict[tuple, MiCS_CommGroups] = {}


def _group_ranks(dp_group: Any) -> list[int]:
    import torch.distributed as dist

    if dp_group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(dp_group))


def create_mics_comm_groups(shard_size: int, dp_group: Any, hierarchical_allgather: bool = False,
                            mpu: Optional[Any] = None) -> MiCS_CommGroups:
    """This rank's groups for `shard_size` over `dp_group` (None: the world), created on first use of a layout
    (collective: every rank of the world calls it) and cached."""
    import torch.distributed as dist

    import deepspeed_c.comm as comm

    if dp_group is None and mpu is not None:
        dp_group = mpu.get_data_parallel_group()
    ranks = _group_ranks(dp_group)
    per_node = devices_per_node() if hierarchical_allgather else 1
    key = (tuple(ranks), int(shard_size), bool(hierarchical_allgather), per_node)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    layout = mics_layout(ranks, int(shard_size), bool(hierarchical_allgather), per_node)
    me = dist.get_rank()
    fields: dict[str, Any] = {}

    def make(blocks: list[list[int]]) -> tuple[Any, list[int]]:
        mine: tuple[Any, list[int]] = (None, [])
        for block in blocks:
            group = comm.new_group(block) if len(blocks) > 1 or len(block) < dist.get_world_size() else None
            if me in block:
                mine = (group, block)
        return mine

    fields["param_shard_group"], shard = make(layout.shard_groups)
    fields["param_shard_size"], fields["param_shard_rank"] = len(shard), shard.index(me)
    if len(layout.replica_groups[0]) > 1:
        fields["param_repli_group"], replica = make(layout.replica_groups)
        fields["param_repli_size"], fields["param_repli_rank"] = len(replica), replica.index(me)
    else:  # one shard group: nothing to replicate over
        fields.update(param_repli_group=None, param_repli_size=1, param_repli_rank=0)
    if layout.intra_node_groups:
        fields["param_intra_node_group"], intra = make(layout.intra_node_groups)
        fields["param_inter_node_shard_group"], inter = make(layout.inter_node_groups)
        fields["intra_node_size"], fields["inter_node_size"] = len(intra), len(inter)
    out = MiCS_CommGroups(**fields)
    _CACHE[key] = out
    return out

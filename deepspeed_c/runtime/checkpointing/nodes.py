"""Which ranks share a checkpoint directory: `checkpoint.use_node_local_storage`.

Off (DeepSpeed's default), save_dir is one directory every rank sees: global rank 0 writes the
model-states file, `latest` and the manifest, and every rank its own ZeRO file. On, as in
DeepSpeed, save_dir names a directory on each node's own disk: each node's local rank 0 writes the
model-states file, `latest` and the manifest of the files of its node, every rank writes its ZeRO
file into its node's directory, and on load each rank reads only what its node holds.

A node is the set of ranks with the same node rank (CROSS_RANK from our launcher, GROUP_RANK from
torchrun, NODE_RANK), or, without one, the same `rank - LOCAL_RANK` (launchers number a node's
ranks contiguously). Should the nodes' directories turn out to be one shared directory after all
(the key set on a shared filesystem), the save sees that through probe files and lets one rank write
for all the nodes that share it, so two writers never race over one staging directory."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from deepspeed_c.runtime.checkpointing.collective_guard import rank_local_step
from deepspeed_c.utils.logging import logger

NODE_RANK_VARS = ("CROSS_RANK", "GROUP_RANK", "NODE_RANK")
_PROBE = ".dsc_node_probe"


@dataclass(frozen=True)
class StorageScope:
    """This rank's part in a save: whether it begins/commits the tag directory and writes the
    model-states file, and which global ranks' files land in the directory it sees."""
    writer: bool
    members: tuple[int, ...]


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def node_local_enabled(configured: bool) -> bool:
    """checkpoint.use_node_local_storage takes effect only in a distributed run."""
    return bool(configured) and _dist()


def node_key(rank: int, local_rank: int) -> str:
    for var in NODE_RANK_VARS:
        value = os.environ.get(var)
        if value not in (None, ""):
            return f"{var}={value}"
    return f"first_rank={rank - local_rank}"


def _nodes(layout: list[tuple[str, int]]) -> list[list[int]]:
    """Global ranks per node, nodes in the order of their lowest rank; raises unless each node's
    local ranks are distinct and one of them is 0 (that rank writes for the node)."""
    by_key: dict[str, list[int]] = {}
    for rank, (key, _) in enumerate(layout):
        by_key.setdefault(key, []).append(rank)
    for key, ranks in by_key.items():
        locals_ = [layout[r][1] for r in ranks]
        if len(set(locals_)) != len(locals_) or 0 not in locals_:
            raise RuntimeError(f"checkpoint.use_node_local_storage: the ranks {ranks} of node {key} have local ranks "
                               f"{locals_}; each node needs distinct local ranks including 0 (set LOCAL_RANK and "
                               f"a node rank ({', '.join(NODE_RANK_VARS)}) as the launcher does)")
    return sorted(by_key.values(), key=min)


def _probe(save_dir: str, token: str, node: int) -> str:
    return os.path.join(save_dir, f"{_PROBE}.{token}.{node}")


def global_scope() -> StorageScope:
    world = dist.get_world_size() if _dist() else 1
    rank = dist.get_rank() if _dist() else 0
    return StorageScope(writer=rank == 0, members=tuple(range(world)))


def split_scope(members: tuple[int, ...], warn: bool = True) -> StorageScope:
    """A save whose ranks were told different directories (or tags): `members` share this rank's; the lowest
    writes the tag directory's model-states file and commits it. `warn`: say so (the tag case has already
    been reported, or not, by checkpoint.tag_validation)."""
    rank = dist.get_rank()
    if rank == 0 and warn:
        logger.warning("save_checkpoint: the ranks name different save_dir directories; each directory holds its "
                       "ranks' files and a model-states file of its own (DeepSpeed writes a split checkpoint there)")
    return StorageScope(writer=rank == min(members), members=members)


def save_scope(save_dir: str, node_local: bool, local_rank: int) -> StorageScope:
    """Collective when node-local storage is on (`node_local`: checkpoint.use_node_local_storage): every
    rank must call it. `local_rank`: this rank's on its node."""
    if not node_local_enabled(node_local):
        return global_scope()
    rank, local_rank = dist.get_rank(), int(local_rank)
    layout: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layout, (node_key(rank, local_rank), local_rank, uuid.uuid4().hex))
    token = layout[0][2]  # rank 0's: one name for this save on every node
    nodes = _nodes([(key, lr) for key, lr, _ in layout])
    mine = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    lead = local_rank == 0
    with rank_local_step("save_checkpoint (probing node-local storage)"):
        if lead:
            os.makedirs(save_dir, exist_ok=True)
            open(_probe(save_dir, token, mine), "wb").close()
    seen: Optional[list[int]] = None
    with rank_local_step("save_checkpoint (probing node-local storage)"):
        if lead:  # unique names: no cached lookup can hide another node's probe
            seen = [j for j in range(len(nodes)) if os.path.exists(_probe(save_dir, token, j))]
    views: list[Any] = [None] * len(layout)
    dist.all_gather_object(views, seen)
    if lead:  # every lead has looked (the gather above): the probe has done its work
        try:
            os.remove(_probe(save_dir, token, mine))
        except OSError:
            pass
    leads = {i: next(r for r in ranks if layout[r][1] == 0) for i, ranks in enumerate(nodes)}
    shared = {i: tuple(views[leads[i]]) for i in leads}
    for i, group in shared.items():
        if any(shared[j] != group for j in group):
            raise RuntimeError(f"checkpoint.use_node_local_storage: nodes disagree on which of them share save_dir "
                               f"({shared}); give every node the same kind of directory")
    group = shared[mine]
    members = tuple(sorted(r for j in group for r in nodes[j]))
    return StorageScope(writer=lead and mine == min(group), members=members)


def agree_on_latest(tag: Optional[str], load_dir: str, node_local: bool = True) -> Optional[str]:
    """The tag every rank's `latest` names; raises when they differ (a save that one node committed
    and another did not, or ranks given load directories that hold different checkpoints), since
    ranks resuming from different steps would silently diverge. Collective over the default group."""
    tags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        by_tag: dict[Any, list[int]] = {}
        for r, t in enumerate(tags):
            by_tag.setdefault(t, []).append(r)
        whose = "checkpoint.use_node_local_storage: the nodes'" if node_local else "the ranks'"
        raise RuntimeError(f"load_checkpoint: {whose} {load_dir}/latest name different tags (tag: ranks) {by_tag} "
                           "(None: no latest file); pass the tag to load explicitly")
    return tag

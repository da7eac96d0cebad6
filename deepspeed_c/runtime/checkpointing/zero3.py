"""ZeRO stage-3 checkpoints in DeepSpeed's stage-3 layout, without un-partitioning.

DeepSpeed's stage 3 cuts every parameter p (trainable or frozen) of n elements into W shards of
s = ceil(n / W) elements: rank r holds elements [r*s, (r+1)*s) of the flattened p, the last rank's shard
zero-padded to s. Per optimizer param group, a rank's fp32 masters are the concatenation of its shards
of the group's parameters, cut into sub-groups (parameters added in order while the running sum of
their shard sizes stays under zero_optimization.sub_group_size); its files hold one flat fp32 tensor
(`fp32_flat_groups`) and one torch-optimizer state entry per sub-group. Parameters the optimizer does
not own go, shard by shard, into each rank's model-states file (`frozen_param_fragments`).

In per-parameter terms that concatenation is exactly the runtime layout of a PartitionPlan with one
bucket per parameter and alignment 1 (`per_param_plan`). deepspeed_c's stage-3 runtime keeps the same
elements bucketed by module (ParamStore plans), so saving is, per group, one point-to-point exchange
between the two runtime layouts (ops.partition_route + checkpoint.zero_exchange): a rank only ever
holds its own partitions. Loading is the reverse, through zero.py's loader (which reads a
stage-3 checkpoint's files through `Stage3Files`): at the saved world size each rank reads only its own
files, at another only the files whose shards overlap its new partition. Frozen parameters are re-cut
the same way from the model-states files."""
from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.checkpoint import deepspeed_format, ds_pickle, store
from deepspeed_c.checkpoint.mapped_pages import MappedPages
from deepspeed_c.checkpoint.safe_load import scaler_state
from deepspeed_c.checkpoint.zero_exchange import exchange
from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.ops.partition_route import layout_route
from deepspeed_c.runtime.checkpointing.collective_guard import rank_local_step
from deepspeed_c.runtime.optimizer_seam import PartitionExport

FP32_KEY = "single_partition_of_fp32_groups"  # zero.py's name for a group's flat masters
FLAT_GROUPS = "fp32_flat_groups"
MIN_ROUND = 1 << 20


ZENFLOW_KEY = "zenflow"  # runtime/zenflow: carried beside DeepSpeed's stage-3 fields


def model_file_name(dp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"


def is_stage3_checkpoint(tag_dir: str, dp_rank: int = 0) -> bool:
    """A stage-3 checkpoint has per-rank model-states files instead of mp_rank_00_model_states.pt."""
    if os.path.isfile(os.path.join(tag_dir, "mp_rank_00_model_states.pt")):
        return False
    return any(os.path.isfile(os.path.join(tag_dir, model_file_name(r))) for r in (0, dp_rank))


def check_model_parallel_degree(tag_dir: str, mp_world_size: int) -> None:
    """A stage-3 checkpoint holds one set of files per model-parallel rank (a client mpu's, or AutoTP's at ZeRO-3):
    loading it at another model-parallel degree is refused, naming both (DeepSpeed converts such checkpoints with
    ds_to_universal.py)."""
    pattern = re.compile(r"^zero_pp_rank_\d+_mp_rank_(\d+)_model_states\.pt$")
    saved = {int(m.group(1)) for f in os.listdir(tag_dir) if (m := pattern.match(f))}
    if saved and len(saved) != mp_world_size:
        raise NotImplementedError(
            f"load_checkpoint: {tag_dir} holds ZeRO-3 partitions of {len(saved)} model-parallel (tensor-parallel) "
            f"ranks; this engine runs {mp_world_size} (tensor_parallel.autotp_size or the mpu's model-parallel "
            "size): a ZeRO-3 checkpoint loads only at the model-parallel degree it was saved at")


def saved_partition_world(model_state: dict) -> int:
    """The ranks a stage-3 checkpoint's partitions are cut over: its dp_world_size, except under MiCS, whose
    model-states files record the whole data-parallel world (DeepSpeed's layout) while the partitions (and
    the zero_pp_rank files) are the saved config's mics_shard_size."""
    world = int(model_state.get("dp_world_size") or 1)
    cfg = model_state.get("ds_config")
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    mics = zero.get("mics_shard_size") if isinstance(zero, dict) else None
    if isinstance(mics, int) and not isinstance(mics, bool) and 0 < mics < world and world % mics == 0:
        return mics
    return world


def shard_size(numel: int, world: int) -> int:
    return -(-int(numel) // int(world))


def per_param_plan(numels: Sequence[int], world: int) -> Optional[PartitionPlan]:
    """DeepSpeed's stage-3 shards of `numels` as a plan: one bucket per parameter, alignment 1 (its runtime
    layout gives rank r the concatenation of its ceil(n/W)-element shards)."""
    if not numels:
        return None
    return PartitionPlan.build(list(numels), world, 1, 1, None, list(range(len(numels))))


def sub_group_bounds(numels: Sequence[int], world: int, sub_group_size: int) -> list[tuple[int, int]]:
    """[start, end) parameter ranges of DeepSpeed's sub-groups of one param group: parameters are added in
    order with a running sum of their shard sizes; a sub-group closes when the sum reaches sub_group_size
    or at the group's last parameter."""
    out: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, n in enumerate(numels):
        acc += shard_size(n, world)
        if acc >= sub_group_size or i == len(numels) - 1:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    return out


def _offsets(numels: Sequence[int], world: int) -> list[int]:
    """Start of each parameter's shard in a rank's per-parameter partition (and the total at the end)."""
    out = [0]
    for n in numels:
        out.append(out[-1] + shard_size(n, world))
    return out


def _round_cap(plan: PartitionPlan) -> int:
    return max(max(plan.bucket_size, default=1), MIN_ROUND)


def _to_per_param(plan: PartitionPlan, t: torch.Tensor, rank: int, group: Any) -> torch.Tensor:
    """This rank's partition `t` (runtime layout of `plan`) re-cut into the per-parameter layout, on the
    host (collective over `group`)."""
    dst_plan = per_param_plan(plan.numels, plan.world_size)
    assert dst_plan is not None
    dst = torch.zeros(dst_plan.runtime_partition_size, dtype=t.dtype)
    exchange(layout_route(plan, "runtime", dst_plan, "runtime"), t.detach(), dst, rank, group, _round_cap(plan))
    return dst


# -- save -------------------------------------------------------------------------------------------
def optimizer_file_state(ex: Any) -> dict:
    """This rank's `optimizer_state_dict` of its ZeRO file in DeepSpeed's stage-3 layout (collective over
    ex.group). `ex` is the stage-3 optimizer's PartitionExport: plans (runtime layout), its state (masters,
    the wrapped optimizer's state per group), sub_group_size."""
    sd = ex.state
    base = sd["base_optimizer_state"]
    world, rank, group, sub_group_size = ex.world_size, ex.rank, ex.group, ex.sub_group_size
    flat_groups: list[torch.Tensor] = []
    state: dict[int, dict] = {}
    param_groups: list[dict] = []
    for g, plan in enumerate(ex.plans):
        master = sd[FP32_KEY][g]
        entry = base["state"].get(g, {})
        flat_keys = [k for k, v in entry.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == master.numel()]
        per_param = {k: _to_per_param(plan, entry[k], rank, group) for k in flat_keys}
        per_master = _to_per_param(plan, master, rank, group)
        offsets = _offsets(plan.numels, world)
        ids = []
        for a, b in sub_group_bounds(plan.numels, world, sub_group_size):
            lo, hi = offsets[a], offsets[b]
            i = len(flat_groups)
            ids.append(i)
            flat_groups.append(per_master[lo:hi].clone())
            sub: dict[str, Any] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in entry.items()
                                   if k not in per_param}
            sub.update({k: v[lo:hi].clone() for k, v in per_param.items()})
            state[i] = sub
        hyper = {k: v for k, v in base["param_groups"][g].items() if k != "params"}
        param_groups.append(dict(hyper, params=ids))
    return {
        "zero_stage": ds_pickle.zero_stage_record(3),
        "loss_scaler": ds_pickle.loss_scaler_record(ex.loss_scaler),
        "dynamic_loss_scale": sd["dynamic_loss_scale"],
        "overflow": sd["overflow"],
        "partition_count": world,
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        FLAT_GROUPS: flat_groups,
        # ZenFlow's own rank-local state (accumulated gradient, selected columns), when the optimizer has one
        **({ZENFLOW_KEY: sd[ZENFLOW_KEY]} if ZENFLOW_KEY in sd else {}),
    }


def model_file_fields(store_: Any, trainable: Sequence[Sequence[torch.nn.Parameter]], sub_group_size: int,
                      param_name: Callable[[torch.nn.Parameter], str], exclude_frozen: bool) -> dict:
    """The fields of this rank's zero_pp_rank_{r}_mp_rank_00_model_states.pt that depend on the shards:
    param_shapes (one name -> full shape map per sub-group), frozen_param_shapes and this rank's
    frozen_param_fragments (every parameter in the store's last group; collective over the store's group
    unless excluded)."""
    world = store_.world_size
    param_shapes = []
    for params in trainable:
        numels = [int(p.ds_numel) for p in params]
        for a, b in sub_group_bounds(numels, world, sub_group_size):
            param_shapes.append(OrderedDict((param_name(p), torch.Size(p.ds_shape)) for p in params[a:b]))
    out: dict[str, Any] = {"param_shapes": param_shapes, "frozen_param_shapes": None,
                           "frozen_param_fragments": None}
    if exclude_frozen:
        return out
    frozen, plan = store_.groups[-1], store_.plans[-1]
    out["frozen_param_shapes"] = OrderedDict((param_name(p), torch.Size(p.ds_shape)) for p in frozen)
    fragments: OrderedDict[str, torch.Tensor] = OrderedDict()
    if plan is not None:
        flat = _to_per_param(plan, store_.shards[-1], store_.rank, store_.group)
        offsets = _offsets(plan.numels, world)
        for i, p in enumerate(frozen):
            fragments[param_name(p)] = flat[offsets[i]:offsets[i + 1]].clone()
    out["frozen_param_fragments"] = fragments
    return out


def partitioned_model_state(stepper: Any, param_name: Callable[[torch.nn.Parameter], str],
                            exclude_frozen: bool) -> Optional[tuple[int, dict]]:
    """ZeRO-3: (data-parallel rank, the fields of its own model-states file that depend on the weight shards)
    from the optimizer's partition_export; None where one model-states file holds whole weights. A
    collective where it is not None."""
    with stepper.partition_export() as ex:
        if not isinstance(ex, PartitionExport) or ex.store is None:  # None; the MoE optimizer's MemberExports
            return stepper.partitioned_model_state(param_name, exclude_frozen)
        return ex.rank, model_file_fields(ex.store, ex.params, ex.sub_group_size, param_name, exclude_frozen)


# -- load: the optimizer's files ------------------------------------------------------------------------
class Stage3Files:
    """The ZeRO files of a stage-3 checkpoint, read as zero.py's loader reads stage 1/2 ones: per
    param group, rank r's sub-groups concatenated are its partition in the runtime layout of
    per_param_plan (`layout`), and the state of the group's first sub-group (moments concatenated too)
    stands for the group's."""

    layout = "runtime"

    def __init__(self, ex: Any, tag_dir: str, manifest: Any, model_state: dict, bf16: bool, mp_rank: int = 0) -> None:
        self.tag_dir, self.manifest, self.bf16, self.mp_rank = tag_dir, manifest, bf16, mp_rank
        self.world = saved_partition_world(model_state)
        self.shapes = model_state.get("param_shapes")
        if not isinstance(self.shapes, (list, tuple)) or not self.shapes:
            raise ValueError(f"ZeRO-3 checkpoint {tag_dir}: its model-states file names no param_shapes (saved without "
                             "an optimizer?); its trainable weights cannot be placed")
        self.sub_numels = [[math.prod(tuple(s)) for s in sub.values()] for sub in self.shapes]
        self.numels = [list(plan.numels) for plan in ex.plans]
        self.plans = [per_param_plan(n, self.world) for n in self.numels]

    def _groups(self, osd: dict, name: str) -> list[list[int]]:
        groups = [list(g["params"]) for g in osd["optimizer_state_dict"]["param_groups"]]
        numels = [[n for i in subs for n in self.sub_numels[i]] for subs in groups]
        if numels != self.numels:
            raise ValueError(f"ZeRO-3 checkpoint file {name}: its param groups hold parameters of sizes {numels}, this "
                             f"model's groups {self.numels}: the checkpoint belongs to a different model or grouping")
        return groups

    def open(self, r: int) -> tuple[dict, MappedPages]:
        name = deepspeed_format.find_zero_file(self.tag_dir, r, self.bf16, self.mp_rank)
        obj, mapped = store.load_file_mapped(self.tag_dir, name, self.manifest)
        osd = obj["optimizer_state_dict"]
        count = osd.get("partition_count", self.world)
        count = max(count) if isinstance(count, (list, tuple)) else int(count)
        if count != self.world:
            raise ValueError(f"ZeRO-3 checkpoint file {name} was written by {count} ranks, its model-states file says "
                             f"dp_world_size {self.world}")
        flats = osd[FLAT_GROUPS]
        torch_state = osd["optimizer_state_dict"]["state"]
        masters, state = [], {}
        for g, subs in enumerate(self._groups(osd, name)):
            want = self.plans[g].runtime_partition_size
            parts = [flats[i].reshape(-1) for i in subs]
            master = parts[0] if len(parts) == 1 else torch.cat(parts)
            if master.numel() != want:
                raise ValueError(f"ZeRO-3 checkpoint file {name}: group {g}'s fp32_flat_groups hold {master.numel()} "
                                 f"elements; {self.world} ranks give each {want}")
            masters.append(master)
            first = torch_state.get(subs[0], {})
            entry = {}
            for k, v in first.items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == parts[0].numel():
                    pieces = [torch_state[i][k].reshape(-1) for i in subs]
                    entry[k] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                else:
                    entry[k] = v
            if entry:  # saved before the first step: no state, and an empty entry is no state to load
                state[g] = entry
        base_groups = [dict({k: v for k, v in pg.items() if k != "params"}, params=[g])
                       for g, pg in enumerate(osd["optimizer_state_dict"]["param_groups"])]
        part = {
            "zero_stage": 3,
            "loss_scaler": scaler_state(osd.get("loss_scaler")),
            "dynamic_loss_scale": osd.get("dynamic_loss_scale", False),
            "overflow": bool(osd.get("overflow", False)),
            "partition_count": self.world,
            "layout": self.layout,
            "group_numels": self.numels,
            "base_optimizer_state": {"state": state, "param_groups": base_groups},
            FP32_KEY: masters,
        }
        if ZENFLOW_KEY in osd:
            part[ZENFLOW_KEY] = osd[ZENFLOW_KEY]
        return part, MappedPages(obj, mapped)

    def keys(self, part: dict) -> list[list[str]]:
        base = part["base_optimizer_state"]
        return [sorted(k for k, v in base["state"].get(g, {}).items()
                       if torch.is_tensor(v) and v.dim() == 1 and v.numel() == part[FP32_KEY][g].numel())
                for g in range(len(self.plans))]


# -- load: frozen parameters --------------------------------------------------------------------------
def _saved_frozen(model_state: dict) -> Optional["OrderedDict[str, Any]"]:
    shapes = model_state.get("frozen_param_shapes")
    return None if shapes is None else OrderedDict(shapes)


def _fragments_flat(model_state: dict, names: Sequence[str], numels: Sequence[int], world: int, dtype: torch.dtype,
                    where: str) -> torch.Tensor:
    """One rank's frozen fragments, concatenated in `names` order (its per-parameter partition)."""
    frags = model_state.get("frozen_param_fragments") or {}
    pieces = []
    for name, n in zip(names, numels):
        t = frags.get(name)
        if t is None or t.numel() != shard_size(n, world):
            raise ValueError(f"ZeRO-3 checkpoint file {where}: frozen parameter {name} needs a {shard_size(n, world)}"
                             f"-element fragment, found {None if t is None else t.numel()}")
        pieces.append(t.reshape(-1).to(dtype))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)


def load_frozen_shards(store_: Any, tag_dir: str, manifest: Any, model_state: dict, model_rank: Optional[int],
                       node_local: bool = False) -> None:
    """The store's last group (parameters no optimizer steps) from a stage-3 checkpoint's frozen_param_fragments,
    re-cut when the world size changed (collective over the store's group). `model_state` is rank
    `model_rank`'s model-states file. Nothing is loaded from a checkpoint saved with exclude_frozen_parameters."""
    saved = _saved_frozen(model_state)
    plan = store_.plans[-1]
    if saved is None or plan is None:
        return
    numels = [math.prod(tuple(s)) for s in saved.values()]
    if tuple(numels) != tuple(plan.numels):
        raise ValueError(f"ZeRO-3 checkpoint {tag_dir} holds frozen parameters of sizes {numels}; this model's "
                         f"parameters outside the optimizer have sizes {list(plan.numels)}")
    names = list(saved)
    world = saved_partition_world(model_state)
    src_plan = per_param_plan(numels, world)
    assert src_plan is not None
    routes = layout_route(src_plan, "runtime", plan, "runtime")
    shard, rank = store_.shards[-1], store_.rank
    dtype = shard.dtype
    if world == store_.world_size:
        own = model_state if model_rank == rank else None
        with rank_local_step("load_checkpoint (reading this rank's frozen fragments)", group=store_.group,
                             distributed=store_.world_size > 1):
            if own is None:
                own = store.load_file(tag_dir, model_file_name(rank), manifest)
            src = _fragments_flat(own, names, numels, world, dtype, model_file_name(rank))
        host = torch.zeros(shard.numel(), dtype=dtype)
        exchange(routes, src, host, rank, store_.group, _round_cap(plan))
        with torch.no_grad():
            shard.copy_(host)
        return
    if node_local:
        raise RuntimeError(f"load_checkpoint: checkpoint.use_node_local_storage: {tag_dir} was saved by {world} ranks "
                           f"and {store_.world_size} load it; resharding needs every rank's files in one directory")
    mine = routes[routes[:, 2] == rank]
    needed = sorted({int(s) for s in mine[:, 0].tolist()})
    with rank_local_step("load_checkpoint (reading the frozen fragments this rank's shard overlaps)",
                         group=store_.group, distributed=store_.world_size > 1):
        with torch.no_grad():
            for r in needed:
                src = _fragments_flat(store.load_file(tag_dir, model_file_name(r), manifest), names, numels, world,
                                      dtype, model_file_name(r))
                for _, a, _, b, n in mine[mine[:, 0] == r].tolist():
                    shard[b:b + n].copy_(src[a:a + n])


def whole_frozen_params(tag_dir: str, manifest: Any, model_state: dict,
                        model_rank: Optional[int]) -> "OrderedDict[str, torch.Tensor]":
    """name -> whole value of every frozen parameter of a stage-3 checkpoint, for an engine that keeps whole
    parameters (stage 0-2): every rank's fragments are read (each such rank holds the whole parameters anyway)."""
    saved = _saved_frozen(model_state)
    if not saved:
        return OrderedDict()
    world = saved_partition_world(model_state)
    per_rank = [model_state if model_rank == r else
                store.load_file(tag_dir, model_file_name(r), manifest) for r in range(world)]
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, shape in saved.items():
        shape = torch.Size(shape)
        frags = [(ms.get("frozen_param_fragments") or {}).get(name) for ms in per_rank]
        if any(f is None or f.numel() != shard_size(shape.numel(), world) for f in frags):
            raise ValueError(f"ZeRO-3 checkpoint {tag_dir}: a rank's model-states file lacks frozen parameter {name}'s "
                             f"{shard_size(shape.numel(), world)}-element fragment")
        out[name] = torch.cat([f.reshape(-1) for f in frags])[:shape.numel()].clone().view(shape)
    return out

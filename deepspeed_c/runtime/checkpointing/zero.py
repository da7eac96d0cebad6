"""ZeRO-1/2 optimizer state <-> DeepSpeed's on-disk layout, without un-partitioning.

The ZeRO optimizer keeps each rank's fp32 masters and Adam moments in deepspeed_c's bucketed runtime
layout and hands them over as data (EngineOptimizer.partition_export: plans, world and rank, the
runtime-layout state); the checkpointers call this module (save_partition, load_partition,
load_partition_weights), which converts that data and gives the optimizer back a runtime-layout state
(import_partition_state). The optimizer never calls into this module. On disk, DeepSpeed's layout is used: per parameter group one flat buffer of the parameters in
order, padded to a multiple of 2 * world, rank r holding the r-th equal slice.

No rank ever holds more than its own partitions: saving moves, point to point, only the elements whose
DeepSpeed-layout owner is another rank (checkpoint.zero_exchange over the routes of
ops.partition_route), and each rank writes its own slice. Loading at the saved world size reads only
this rank's own file (all a rank can see with node-local checkpoint storage) and runs the same exchange
in reverse. Loading at another world size opens only the saved files whose slices overlap this rank's
new partition, mapped (torch.load mmap=True), so only the byte ranges it needs are read; the pages of
each partition are given back as soon as it has been copied (checkpoint.mapped_pages)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.checkpoint.mapped_pages import MappedPages
from deepspeed_c.checkpoint.zero_exchange import exchange
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.ops.partition_route import layout_route
from deepspeed_c.runtime.checkpointing.collective_guard import rank_local_step
from deepspeed_c.runtime.optimizer_seam import MemberExports, PartitionExport, SavedCheckpoint
from deepspeed_c.version import DEEPSPEED_API_VERSION

FP32_KEY = "single_partition_of_fp32_groups"
MIN_ROUND = 1 << 20  # elements per rank per exchange round at least (rounds of tiny buckets cost latency)


def flat_state_keys(base: dict, g: int, numel: int) -> list[str]:
    """Names of group g's optimizer-state tensors laid out like its partition (exp_avg, exp_avg_sq...)."""
    state = base["state"].get(g, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel)


def _round_cap(plan: PartitionPlan) -> int:
    """Staging bound of the exchange: one bucket (what the runtime already holds in flight)."""
    return max(max(plan.bucket_size, default=1), MIN_ROUND)


def to_deepspeed_layout(ex: PartitionExport) -> dict:
    """This rank's optimizer state (`ex`, runtime layout) with partitions re-cut into DeepSpeed's layout
    (collective over ex.group)."""
    sd = ex.state
    out = dict(sd)
    out["base_optimizer_state"] = base = copy.copy(sd["base_optimizer_state"])
    base["state"] = {k: dict(v) for k, v in base["state"].items()}
    out[FP32_KEY] = []
    for g, plan in enumerate(ex.plans):
        routes = layout_route(plan, "runtime", plan, "deepspeed")

        def to_ds(t: torch.Tensor) -> torch.Tensor:
            dst = torch.zeros(plan.ds_partition_size, dtype=t.dtype)
            exchange(routes, t.detach(), dst, ex.rank, ex.group, _round_cap(plan))
            return dst

        master = sd[FP32_KEY][g]
        out[FP32_KEY].append(to_ds(master))
        for key in flat_state_keys(base, g, master.numel()):
            base["state"][g][key] = to_ds(base["state"][g][key])
    out["ds_version"] = DEEPSPEED_API_VERSION  # DeepSpeed's ZeRO loader asserts it is present
    out["layout"] = "deepspeed"
    out["ds_partition_sizes"] = [plan.ds_partition_size for plan in ex.plans]
    return out


def file_state(ex: PartitionExport, param_name: Callable[[torch.nn.Parameter], str]) -> dict:
    """The optimizer_state_dict of this rank's ZeRO-1/2 file, DeepSpeed's fields included (collective)."""
    return deepspeed_format.with_deepspeed_fields(to_deepspeed_layout(ex), stage=ex.stage, scaler=ex.loss_scaler,
                                                  plans=ex.plans, rank=ex.rank,
                                                  names=[[param_name(p) for p in ps] for ps in ex.params])


class _SavedFiles:
    """The ZeRO-1/2 files of one checkpoint tag, opened one at a time, mapped and validated. Each saved
    group's partition is in `layout` of `plans[g]` (the interface zero3.Stage3Files shares)."""

    layout = "deepspeed"

    def __init__(self, ex: PartitionExport, tag_dir: str, manifest: Any, model_state: dict, bf16: bool,
                 mp_rank: int = 0) -> None:
        self.tag_dir, self.manifest, self.bf16, self.mp_rank = tag_dir, manifest, bf16, mp_rank
        self.world = model_state.get("dp_world_size") or 1
        self.shape_numels = deepspeed_format.group_numels_from_shapes(model_state.get("param_shapes"))
        self.numels = [list(plan.numels) for plan in ex.plans]
        self.plans = [PartitionPlan.build(plan.numels, self.world, max(max(plan.numels, default=1), 1),
                                          DEEPSPEED_ALIGNMENT) for plan in ex.plans]

    def open(self, r: int) -> tuple[dict, MappedPages]:
        name = deepspeed_format.find_zero_file(self.tag_dir, r, self.bf16, self.mp_rank)
        obj, mapped = store.load_file_mapped(self.tag_dir, name, self.manifest)
        part = deepspeed_format.normalize_zero_state(obj["optimizer_state_dict"], self.shape_numels, self.world)
        if part.get("layout") != "deepspeed":
            raise RuntimeError(f"load_checkpoint: ZeRO files in {self.tag_dir} are not in DeepSpeed's flat layout")
        if part.get("group_numels") != self.numels:
            raise ValueError(f"ZeRO checkpoint groups hold parameters of sizes {part.get('group_numels')}, this "
                             f"model's groups {self.numels}: the checkpoint belongs to a different model")
        for g, plan in enumerate(self.plans):
            have = part[FP32_KEY][g].numel()
            if have != plan.ds_partition_size:
                raise ValueError(f"ZeRO checkpoint file {name}: group {g}'s {FP32_KEY} holds {have} elements; "
                                 f"DeepSpeed's layout at {self.world} ranks gives each rank {plan.ds_partition_size}")
        return part, MappedPages(obj, mapped)

    def keys(self, part: dict) -> list[list[str]]:
        base = part["base_optimizer_state"]
        return [flat_state_keys(base, g, part[FP32_KEY][g].numel()) for g in range(len(self.plans))]


def _owned(obj: Any, keep: set[int]) -> Any:
    """`obj` with every tensor not in `keep` cloned, so nothing the optimizer keeps maps the file."""
    if isinstance(obj, torch.Tensor):
        return obj if id(obj) in keep else obj.clone()
    if isinstance(obj, dict):
        return {k: _owned(v, keep) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_owned(v, keep) for v in obj)
    return obj


def _runtime_state(ex: PartitionExport, first: dict, keys: list[list[str]],
                   moments: list[dict[str, torch.Tensor]] | None) -> dict:
    """The runtime-layout state import_partition_state applies: `first`'s metadata, the (already filled)
    live masters, and the moments in the runtime layout (None: not loaded)."""
    out = dict(first)
    out.update(partition_count=ex.world_size, rank=ex.rank, layout="runtime",
               group_numels=[list(plan.numels) for plan in ex.plans])
    out["base_optimizer_state"] = base = copy.copy(first["base_optimizer_state"])
    base["state"] = {k: dict(v) for k, v in base["state"].items()}
    for g, names in enumerate(keys):
        for key in names:
            if moments is None:
                del base["state"][g][key]
            else:
                base["state"][g][key] = moments[g][key]
    out[FP32_KEY] = list(ex.masters)  # filled in place already: the optimizer's copy is a no-op
    keep = {id(t) for t in out[FP32_KEY]} | {id(t) for m in (moments or []) for t in m.values()}
    return _owned(out, keep)


def _new_moments(masters: list[torch.Tensor], part: dict, keys: list[list[str]]) -> list[dict[str, torch.Tensor]]:
    state = part["base_optimizer_state"]["state"]
    return [{k: torch.zeros(m.numel(), dtype=state[g][k].dtype, device=m.device) for k in keys[g]}
            for g, m in enumerate(masters)]


def runtime_state(opt: Any, first: dict, keys: list[list[str]], moments: list[dict[str, torch.Tensor]] | None) -> dict:
    """_runtime_state for a ZeRO-1/2 optimizer read directly (AutoTP's tensor_parallel/zero_checkpoint.py,
    which runs while its view shadows partition_export)."""
    facts = PartitionExport(stage=opt.stage, rank=opt.rank, world_size=opt.world_size, group=None,
                            plans=list(opt.partition_plans), params=[], masters=list(opt.fp32_partitions), state={})
    return _runtime_state(facts, first, keys, moments)


def new_moments(opt: Any, part: dict, keys: list[list[str]]) -> list[dict[str, torch.Tensor]]:
    """Zeroed runtime-layout moments beside a ZeRO-1/2 optimizer's masters (AutoTP's zero_checkpoint.py)."""
    return _new_moments([m.detach() for m in opt.fp32_partitions], part, keys)


def _pairs(ex: PartitionExport, part: dict, g: int, keys: list[str], moments: list[dict] | None,
           masters: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(saved DeepSpeed-layout tensor, runtime destination) of group g that this load fills."""
    out = [(part[FP32_KEY][g], ex.masters[g])] if masters else []
    if moments is not None:
        out += [(part["base_optimizer_state"]["state"][g][k], moments[g][k]) for k in keys]
    return out


def load_same_world(ex: PartitionExport, files: Any, masters: bool, states: bool) -> dict:
    """This rank's state from files saved at its world size (each rank reads only its own file, then the
    exchange re-cuts DeepSpeed's layout into the runtime one; collective over ex.group)."""
    distributed = ex.world_size > 1
    with rank_local_step("load_checkpoint (reading this rank's ZeRO file)", group=ex.group,
                         distributed=distributed):
        part, pages = files.open(ex.rank)
        keys = files.keys(part)
    if distributed:  # the exchange below is collective: every rank must move the same tensors
        every: list[Any] = [None] * ex.world_size
        dist.all_gather_object(every, keys, group=ex.group)
        if any(k != keys for k in every):
            raise ValueError(f"ZeRO checkpoint files in {files.tag_dir} hold different optimizer states per rank: "
                             f"{every}")
    moments = _new_moments(ex.masters, part, keys) if states else None
    for g, plan in enumerate(ex.plans):
        routes = layout_route(files.plans[g], files.layout, plan, "runtime")
        for src, dst in _pairs(ex, part, g, keys[g], moments, masters):
            exchange(routes, src, dst, ex.rank, ex.group, _round_cap(plan))
            pages.release(src)
    return _runtime_state(ex, part, keys, moments)


def _load_resharded(ex: PartitionExport, files: Any, masters: bool, states: bool) -> dict:
    routes = []
    for old, plan in zip(files.plans, ex.plans):
        r = layout_route(old, files.layout, plan, "runtime")
        routes.append(r[r[:, 2] == ex.rank])
    needed = sorted({int(s) for r in routes for s in r[:, 0].tolist()}) or [min(ex.rank, files.world - 1)]
    with rank_local_step("load_checkpoint (reading the ZeRO files this rank's partition overlaps)",
                         group=ex.group, distributed=ex.world_size > 1):
        first: dict | None = None
        for r in needed:
            part, pages = files.open(r)
            keys = files.keys(part)
            if first is None:
                first, first_keys = part, keys
                moments = _new_moments(ex.masters, part, keys) if states else None
            elif keys != first_keys:
                raise ValueError(f"ZeRO checkpoint files in {files.tag_dir} hold different optimizer states per "
                                 f"rank: {first_keys} vs {keys} (rank {r}'s file)")
            with torch.no_grad():
                for g, r_routes in enumerate(routes):
                    rows = r_routes[r_routes[:, 0] == r].tolist()
                    for src, dst in _pairs(ex, part, g, keys[g], moments, masters):
                        flat = src.reshape(-1)
                        for _, a, _, b, n in rows:
                            dst[b:b + n].copy_(flat[a:a + n])
                        pages.release(src)
        assert first is not None
        return _runtime_state(ex, first, first_keys, moments)


def read_zero_files(ex: PartitionExport, tag_dir: str, manifest: Any, model_state: dict, bf16: bool,
                    load_optimizer_states: bool, load_from_fp32_weights: bool, saved_stage3: bool = False,
                    module_only: bool = False, mp_rank: int = 0) -> Optional[dict]:
    """A tag's ZeRO files (ours or DeepSpeed's; stage 1/2, or stage 3 with `saved_stage3`) read into `ex` (a
    stage 1/2 or 3 optimizer's export), at the saved world size or another (collective over ex.group): the
    masters are filled in place, the returned runtime-layout state is what import_partition_state applies
    (None with `module_only`: the masters only, the model weights follow them). A stage-3 checkpoint's
    weights exist only as its fp32 partitions: they are always loaded. `mp_rank`: the pipeline stage, or a
    client mpu's model-parallel rank, whose files to read (zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt)."""
    if saved_stage3:
        from deepspeed_c.runtime.checkpointing.zero3 import Stage3Files

        files: Any = Stage3Files(ex, tag_dir, manifest, model_state, bf16, mp_rank)
    else:
        files = _SavedFiles(ex, tag_dir, manifest, model_state, bf16, mp_rank)
    masters = bool(load_from_fp32_weights) or saved_stage3 or module_only
    states = bool(load_optimizer_states) and not module_only
    if files.world == ex.world_size:
        state = load_same_world(ex, files, masters, states)
    else:
        state = _load_resharded(ex, files, masters, states)
    return None if module_only else state


def check_node_local(ex: PartitionExport, saved: SavedCheckpoint) -> None:
    from deepspeed_c.runtime.checkpointing.zero3 import saved_partition_world

    saved_world = saved_partition_world(saved.model_state)
    if saved.node_local and saved_world != ex.world_size:
        raise RuntimeError(
            f"load_checkpoint: the checkpoint in {saved.tag_dir} was saved by {saved_world} data-parallel ranks and "
            f"{ex.world_size} load it; each rank's directory holds only its own ranks' ZeRO files (node-local "
            "storage, or ranks given different directories), so resharding needs them all: copy every directory's "
            "files into one and load it from there on every rank (with use_node_local_storage off)")


# -- the checkpointers' entry points (runtime/checkpointing/engine.py, pipeline.py) ----------------------
def save_partition(stepper: Any, param_name: Callable[[torch.nn.Parameter], str]) -> Optional[tuple[int, dict]]:
    """(data-parallel rank, its ZeRO file's optimizer_state_dict), or None where the optimizer's state is not
    partitioned over ranks. A collective where it is not None."""
    with stepper.partition_export() as ex:
        if ex is None:
            return stepper.partition_checkpoint_state(param_name)
        if isinstance(ex, MemberExports):  # the MoE ZeRO optimizer: its members' groups in one file per rank
            from deepspeed_c.runtime.checkpointing.moe import save_members

            return save_members(ex, param_name)
        if ex.stage == 3:
            from deepspeed_c.runtime.checkpointing.zero3 import optimizer_file_state

            return ex.rank, optimizer_file_state(ex)
        return ex.rank, file_state(ex, param_name)


def _load_frozen(ex: PartitionExport, saved: SavedCheckpoint) -> None:
    if ex.stage == 3 and saved.partitioned_weights:  # a stage 1/2 checkpoint's frozen weights came with the module
        from deepspeed_c.runtime.checkpointing.zero3 import load_frozen_shards

        load_frozen_shards(ex.store, saved.tag_dir, saved.manifest, saved.model_state, saved.model_rank,
                           saved.node_local)


def load_partition(stepper: Any, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
    """The optimizer's state from a tag (its ZeRO files where it is partitioned; collective then)."""
    with stepper.partition_export() as ex:
        if ex is None:
            stepper.load_checkpoint_state(saved, load_optimizer_states)
            return
        if isinstance(ex, MemberExports):
            from deepspeed_c.runtime.checkpointing.moe import load_members

            stepper.import_partition_state(load_members(ex, saved, load_optimizer_states),
                                           bool(load_optimizer_states), bool(saved.load_from_fp32_weights))
            return
        check_node_local(ex, saved)
        _load_frozen(ex, saved)
        # at the saved world size each rank reads only its own ZeRO file (all a node-local checkpoint holds)
        state = read_zero_files(ex, saved.tag_dir, saved.manifest, saved.model_state, saved.bf16,
                                load_optimizer_states, saved.load_from_fp32_weights,
                                saved_stage3=saved.partitioned_weights, mp_rank=saved.mp_rank)
        states = bool(load_optimizer_states)
        masters = bool(saved.load_from_fp32_weights) or saved.partitioned_weights
        stepper.import_partition_state(state, states, masters)


def load_partition_weights(stepper: Any, saved: SavedCheckpoint) -> None:
    """load_module_only: the weights the model-states file does not hold (a ZeRO-3 checkpoint's are its fp32
    partitions), then the optimizer's masters follow the model's weights."""
    with stepper.partition_export() as ex:
        if ex is None or isinstance(ex, MemberExports):
            stepper.load_checkpoint_weights(saved)
            return
        if ex.stage == 3:
            check_node_local(ex, saved)
            _load_frozen(ex, saved)
        if not saved.partitioned_weights:
            stepper.refresh_masters()
            return
        # a stage-3 checkpoint: the weights are its fp32 partitions (masters), the model follows them
        check_node_local(ex, saved)
        read_zero_files(ex, saved.tag_dir, saved.manifest, saved.model_state, saved.bf16, False, True,
                        saved_stage3=True, module_only=True)
        stepper.import_partition_state(None, False, True)

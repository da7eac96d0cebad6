"""ZeRO-1/2 optimizer state <-> DeepSpeed's on-disk layout, without un-partitioning.

The ZeRO optimizer keeps each rank's fp32 masters and Adam moments in deepspeed_c's bucketed runtime
layout. On disk, DeepSpeed's layout is used: per parameter group one flat buffer of the parameters in
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
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.checkpoint.mapped_pages import MappedPages
from deepspeed_c.checkpoint.zero_exchange import exchange
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.ops.partition_route import layout_route
from deepspeed_c.runtime.checkpointing.collective_guard import rank_local_step
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


def to_deepspeed_layout(opt: Any) -> dict:
    """This rank's optimizer state_dict with partitions re-cut into DeepSpeed's layout (collective)."""
    sd = opt.state_dict(clone_masters=False)
    out = dict(sd)
    out["base_optimizer_state"] = base = copy.copy(sd["base_optimizer_state"])
    base["state"] = {k: dict(v) for k, v in base["state"].items()}
    out[FP32_KEY] = []
    for g, plan in enumerate(opt.partition_plans):
        routes = layout_route(plan, "runtime", plan, "deepspeed")

        def to_ds(t: torch.Tensor) -> torch.Tensor:
            dst = torch.zeros(plan.ds_partition_size, dtype=t.dtype)
            exchange(routes, t.detach(), dst, opt.rank, opt.dp_process_group, _round_cap(plan))
            return dst

        master = sd[FP32_KEY][g]
        out[FP32_KEY].append(to_ds(master))
        for key in flat_state_keys(base, g, master.numel()):
            base["state"][g][key] = to_ds(base["state"][g][key])
    out["ds_version"] = DEEPSPEED_API_VERSION  # DeepSpeed's ZeRO loader asserts it is present
    out["layout"] = "deepspeed"
    out["ds_partition_sizes"] = [plan.ds_partition_size for plan in opt.partition_plans]
    return out


class _SavedFiles:
    """The ZeRO-1/2 files of one checkpoint tag, opened one at a time, mapped and validated. Each saved
    group's partition is in `layout` of `plans[g]` (the interface checkpoint_zero3.Stage3Files shares)."""

    layout = "deepspeed"

    def __init__(self, opt: Any, tag_dir: str, manifest: Any, model_state: dict, bf16: bool,
                 mp_rank: int = 0) -> None:
        self.tag_dir, self.manifest, self.bf16, self.mp_rank = tag_dir, manifest, bf16, mp_rank
        self.world = model_state.get("dp_world_size") or 1
        self.shape_numels = deepspeed_format.group_numels_from_shapes(model_state.get("param_shapes"))
        self.numels = [list(plan.numels) for plan in opt.partition_plans]
        self.plans = [PartitionPlan.build(plan.numels, self.world, max(max(plan.numels, default=1), 1),
                                          DEEPSPEED_ALIGNMENT) for plan in opt.partition_plans]

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


def runtime_state(opt: Any, first: dict, keys: list[list[str]], moments: list[dict[str, torch.Tensor]] | None) -> dict:
    """The state_dict opt.load_state_dict applies: `first`'s metadata, the (already filled) live masters,
    and the moments in the runtime layout (None: not loaded)."""
    out = dict(first)
    out.update(partition_count=opt.world_size, rank=opt.rank, layout="runtime",
               group_numels=[list(plan.numels) for plan in opt.partition_plans])
    out["base_optimizer_state"] = base = copy.copy(first["base_optimizer_state"])
    base["state"] = {k: dict(v) for k, v in base["state"].items()}
    for g, names in enumerate(keys):
        for key in names:
            if moments is None:
                del base["state"][g][key]
            else:
                base["state"][g][key] = moments[g][key]
    out[FP32_KEY] = list(opt.fp32_partitions)  # filled in place already: load_state_dict's copy is a no-op
    keep = {id(t) for t in out[FP32_KEY]} | {id(t) for m in (moments or []) for t in m.values()}
    return _owned(out, keep)


def new_moments(opt: Any, part: dict, keys: list[list[str]]) -> list[dict[str, torch.Tensor]]:
    state = part["base_optimizer_state"]["state"]
    return [{k: torch.zeros(m.numel(), dtype=state[g][k].dtype, device=m.device) for k in keys[g]}
            for g, m in enumerate(opt.fp32_partitions)]


def _pairs(opt: Any, part: dict, g: int, keys: list[str], moments: list[dict] | None,
           masters: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(saved DeepSpeed-layout tensor, runtime destination) of group g that this load fills."""
    out = [(part[FP32_KEY][g], opt.fp32_partitions[g].detach())] if masters else []
    if moments is not None:
        out += [(part["base_optimizer_state"]["state"][g][k], moments[g][k]) for k in keys]
    return out


def load_same_world(opt: Any, files: _SavedFiles, masters: bool, states: bool) -> dict:
    distributed = opt.world_size > 1
    with rank_local_step("load_checkpoint (reading this rank's ZeRO file)", group=opt.dp_process_group,
                         distributed=distributed):
        part, pages = files.open(opt.rank)
        keys = files.keys(part)
    if distributed:  # the exchange below is collective: every rank must move the same tensors
        every: list[Any] = [None] * opt.world_size
        dist.all_gather_object(every, keys, group=opt.dp_process_group)
        if any(k != keys for k in every):
            raise ValueError(f"ZeRO checkpoint files in {files.tag_dir} hold different optimizer states per rank: "
                             f"{every}")
    moments = new_moments(opt, part, keys) if states else None
    for g, plan in enumerate(opt.partition_plans):
        routes = layout_route(files.plans[g], files.layout, plan, "runtime")
        for src, dst in _pairs(opt, part, g, keys[g], moments, masters):
            exchange(routes, src, dst, opt.rank, opt.dp_process_group, _round_cap(plan))
            pages.release(src)
    return runtime_state(opt, part, keys, moments)


def _load_resharded(opt: Any, files: _SavedFiles, masters: bool, states: bool) -> dict:
    routes = []
    for old, plan in zip(files.plans, opt.partition_plans):
        r = layout_route(old, files.layout, plan, "runtime")
        routes.append(r[r[:, 2] == opt.rank])
    needed = sorted({int(s) for r in routes for s in r[:, 0].tolist()}) or [min(opt.rank, files.world - 1)]
    with rank_local_step("load_checkpoint (reading the ZeRO files this rank's partition overlaps)",
                         group=opt.dp_process_group, distributed=opt.world_size > 1):
        first: dict | None = None
        for r in needed:
            part, pages = files.open(r)
            keys = files.keys(part)
            if first is None:
                first, first_keys = part, keys
                moments = new_moments(opt, part, keys) if states else None
            elif keys != first_keys:
                raise ValueError(f"ZeRO checkpoint files in {files.tag_dir} hold different optimizer states per "
                                 f"rank: {first_keys} vs {keys} (rank {r}'s file)")
            with torch.no_grad():
                for g, r_routes in enumerate(routes):
                    rows = r_routes[r_routes[:, 0] == r].tolist()
                    for src, dst in _pairs(opt, part, g, keys[g], moments, masters):
                        flat = src.reshape(-1)
                        for _, a, _, b, n in rows:
                            dst[b:b + n].copy_(flat[a:a + n])
                        pages.release(src)
        assert first is not None
        return runtime_state(opt, first, first_keys, moments)


def load_zero_checkpoint(opt: Any, tag_dir: str, manifest: Any, model_state: dict, bf16: bool,
                         load_optimizer_states: bool, load_from_fp32_weights: bool, saved_stage3: bool = False,
                         module_only: bool = False, mp_rank: int = 0) -> None:
    """Load a tag's ZeRO files (ours or DeepSpeed's; stage 1/2, or stage 3 with `saved_stage3`) into `opt`
    (a stage 1/2 or 3 optimizer), at the saved world size or another (collective over opt's data-parallel
    group). A stage-3 checkpoint's weights exist only as its fp32 partitions: they are always loaded.
    `module_only` (load_module_only): the masters only, then the model weights from them. `mp_rank`: the
    pipeline stage whose files to read (zero_pp_rank_{r}_mp_rank_{stage:02d}_optim_states.pt)."""
    if saved_stage3:
        from deepspeed_c.runtime.checkpointing.zero3 import Stage3Files

        files: Any = Stage3Files(opt, tag_dir, manifest, model_state, bf16)
    else:
        files = _SavedFiles(opt, tag_dir, manifest, model_state, bf16, mp_rank)
    masters = bool(load_from_fp32_weights) or saved_stage3 or module_only
    states = bool(load_optimizer_states) and not module_only
    if files.world == opt.world_size:
        state = load_same_world(opt, files, masters, states)
    else:
        state = _load_resharded(opt, files, masters, states)
    if module_only:
        opt.refresh_model_params()
        return
    opt.load_state_dict(state, load_optimizer_states=states, load_from_fp32_weights=masters)

"""ZeRO stage 3: parameters, gradients and optimizer states partitioned across the data-parallel ranks.

The model's parameters live in a ParamStore (param_store.py): per optimizer param group one flat shard
in the model dtype, laid out by a PartitionPlan whose buckets are runs of one module's parameters, so
a module's parameters are all-gathered by one collective per group it spans, and the same plan is the
ZeRO optimizer's: the fp32 master partition, the reduce-scattered gradient partition and the 16-bit
shard are one layout. Parameters nobody steps (frozen, or left out of the optimizer) are stored the
same way in a last group that is never reduced.

The optimizer is the stage 1/2 one (stage_1_and_2.DeepSpeedZeroOptimizer: reduce-scatter per bucket
into the partition on every micro-step, overflow check, clipping, fused epilogue or CPU offload) with
two differences: its masters come from the shards instead of whole parameters, and its updated
partitions are written into this rank's shard instead of all-gathered into the model (the next
forward gathers what it uses). Gather-on-use is param_hooks.ParamCoordinator."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_empty
from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.backward_round import BucketOrderKeeping
from deepspeed_c.runtime.optimizer_seam import EngineOptimizer, PartitionExport, SavedCheckpoint
from deepspeed_c.runtime.zero import auto_units
from deepspeed_c.runtime.zero.leaf_granularity import mark_leaves_by_granularity
from deepspeed_c.runtime.zero.param_hooks import ParamCoordinator, _is_leaf, mark_leaf_modules
from deepspeed_c.runtime.zero.param_store import ParamStore, placeholder
from deepspeed_c.runtime.zero.partition_parameters import adopt, is_zero_param
from deepspeed_c.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer, _states_resident
from deepspeed_c.runtime.zero.unwrap import unwrap_model_for_generation  # noqa: F401  (DeepSpeed defines it here)
from deepspeed_c.runtime.zero.step_strategy import FusedEpilogueStep, ZeroStepStrategy
from deepspeed_c.runtime.zero.zeropp import ZeroPlusPlus, check_hpz_size

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "build_param_store", "Zero3Params",
           "estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_live",
           "estimate_zero3_model_states_mem_needs_all_cold", "model_to_params"]


def _owners(module: torch.nn.Module, unit_roots: Sequence[torch.nn.Module] = ()) -> dict[int, int]:
    """Parameter -> the module whose unit holds it: its own module, or the outermost ZeRO-3 leaf or unit root
    (auto_units.py) above it (gathered whole, so its parameters share one unit per param group)."""
    owner: dict[int, int] = {}
    roots = {id(m) for m in unit_roots}
    index = {id(m): k for k, m in enumerate(module.modules())}
    covered: set[int] = set()
    for k, m in enumerate(module.modules()):
        if id(m) in covered:
            continue
        if (_is_leaf(m) or id(m) in roots) and m is not module:
            for c in m.modules():
                covered.add(id(c))
            for p in m.parameters():
                owner.setdefault(id(p), index[id(m)])
            continue
        for p in m._parameters.values():
            if p is not None:
                owner.setdefault(id(p), k)
    return owner


@torch.no_grad()
def build_param_store(module: torch.nn.Module, groups: Sequence[Sequence[torch.nn.Parameter]], *, rank: int,
                      world_size: int, group: Any, dtype: torch.dtype, compute_device: torch.device,
                      home_device: Optional[torch.device], pin_memory: bool, persistence_threshold: int,
                      model_persistence_threshold: int, param_swap: Optional[dict] = None,
                      unit_roots: Sequence[torch.nn.Module] = ()) -> ParamStore:
    """The engine's store over `groups` plus a last group of every other parameter of `module`. Values come
    from whole parameters (then freed) or, for a model built under zero.Init, from its shards, one old
    unit gathered at a time (never the whole model)."""
    seen = {id(p) for g in groups for p in g}
    rest = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            rest.append(p)
    all_groups = [list(g) for g in groups] + [rest]
    for params in all_groups:
        for p in params:
            if not is_zero_param(p):
                p.ds_shape, p.ds_numel = p.shape, p.numel()
    store_cls: Any = ParamStore
    if param_swap is not None:  # offload_param.device nvme: the shards are mappings of swap files
        from deepspeed_c.runtime.swap_tensor.partitioned_param_swapper import NVMeParamStore as store_cls
        param_swap = dict(param_swap, trainable_groups=len(groups))  # max_in_cpu counts the optimizer's groups
    store = store_cls(all_groups, _owners(module, unit_roots), rank=rank, world_size=world_size, group=group,
                      dtype=dtype, compute_device=compute_device, home_device=home_device, pin_memory=pin_memory,
                      persistence_threshold=persistence_threshold,
                      model_persistence_threshold=model_persistence_threshold, **(param_swap or {}))
    where = {id(p): (g, i) for g, params in enumerate(all_groups) for i, p in enumerate(params)}
    old_units: dict[tuple[int, int], tuple[ParamStore, int]] = {}
    for params in all_groups:
        for p in params:
            if is_zero_param(p):
                old, u = getattr(p, "_dsc_z3")
                old_units.setdefault((id(old), u), (old, u))
            else:
                store.load_full(*where[id(p)], p.data)
                p.data = placeholder(p.dtype, compute_device)
    for old, u in old_units.values():
        old.wait([u])
        for p, _ in old.unit_params[u]:
            if id(p) in where:
                store.load_full(*where[id(p)], p.data)
        old.pins[u] = 0
        old.release([u])
    adopt(store)
    return store


STEP_INTO_SHARD_ENV = "DSC_Z3_STEP_INTO_SHARD"  # 0: the fused step writes a scratch copy first (A/B runs)


class ShardSlots:
    """Where the fused step (step_strategy.FusedEpilogueStep) writes each updated 16-bit chunk: straight
    into this rank's shard, when the shard is an ordinary tensor of the step's dtype on its device. The
    step otherwise keeps a partition-sized 16-bit scratch (2 bytes a parameter over the world size, held
    between steps) that the shard writer then copies from."""

    def __init__(self, store: ParamStore) -> None:
        self.store = store

    def own_slot(self, g: int, b: int, rank: int, world_size: int) -> Optional[torch.Tensor]:
        store = self.store
        if store.file_backed or g >= len(store.shards):
            return None
        start, end = store.chunk_range(store.first_unit[g] + b)
        return store.shards[g][start:end]

    @staticmethod
    def usable(store: ParamStore, master: torch.Tensor, lp_dtype: torch.dtype) -> bool:
        if os.environ.get(STEP_INTO_SHARD_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
            return False
        return not store.file_backed and all(s.device == master.device and s.dtype == lp_dtype
                                             for s in store.shards)


PREFETCH_IN_STEP_ENV = "DSC_Z3_PREFETCH_IN_STEP"  # 0: the next forward gathers its first units itself (A/B runs)


class ShardWriter:
    """The stage-3 stand-in for the stage 1/2 all-gather of updated weights: each updated partition chunk
    is written into this rank's shard (unless the step wrote it there already: ShardSlots); once all are
    in, every gathered copy is stale and released.

    `ahead()` (optional) names the units the next forward gathers first (the fetch plan's first step). The
    step writes buckets in module order, so those come first: once all of them are written their all-gather
    goes out, while the step goes on with the rest of the model, and they stay gathered for the forward."""

    def __init__(self, store: ParamStore, ahead: Optional[Callable[[], Sequence[int]]] = None) -> None:
        self.store = store
        self.plans = store.plans
        self.ahead = ahead
        self._want: Optional[set[int]] = None  # this step's units to gather ahead, not yet written
        self._early: list[int] = []  # gathered ahead in this step (kept by finish)

    def submit(self, g: int, b: int, chunk: torch.Tensor) -> None:
        plan = self.store.plans[g]
        start = plan.bucket_offset[b] // self.store.world_size
        dst = self.store.shards[g][start:start + chunk.numel()]
        if dst.data_ptr() != chunk.data_ptr():
            dst.copy_(chunk, non_blocking=True)
        self.store.wrote(g, start, start + chunk.numel())
        u = self.store.first_unit[g] + b
        self.store.drop_secondary([u])
        if self.ahead is not None:
            self._gather_ahead(u)

    def _gather_ahead(self, u: int) -> None:
        store = self.store
        if self._want is None:  # the first chunk of this step
            self._early = []
            units = [v for v in self.ahead() if store.pins[v] == 0]
            # units of the store's last group (parameters nobody steps) are never written: current already
            self._want = {v for v in units if store.unit_of[v][0] < len(self.plans) - 1}
            self._units = units
        self._want.discard(u)
        if not self._want and self._units:
            units, self._units = self._units, []
            store.release(units, keep_secondary=False)  # stale copies from before the step
            store.fetch(units)
            self._early = units
            store.mark_early(units)

    def finish(self) -> None:
        # gathered copies are stale now (views of the shards, on one rank, are not); the units gathered ahead
        # in this step are current
        self._want = None
        early, self._early = set(self._early), []
        store = self.store
        if not early:
            store.release_all(keep_persistent=store.aliased)
            return
        store.unpin_all()
        store.drop_secondary()
        store.release([u for u in range(len(store.full)) if u not in early], keep_secondary=False)


class _Stage3Round(BucketOrderKeeping):
    """What the engine drives each backward: the gradient reduce-scatter, then the end of the parameters'
    iteration (everything still gathered released, the recorded trace becoming the fetch plan)."""

    def __init__(self, partitioner: Any, coordinator: Optional[ParamCoordinator], zeropp: Any = None) -> None:
        self.partitioner, self.coordinator, self.zeropp = partitioner, coordinator, zeropp

    def claim_round(self) -> None:
        if self.partitioner is not None:
            self.partitioner.claim_round()

    def register_inert_hook_test(self, is_inert: Callable[[Any], bool]) -> None:
        if self.partitioner is not None:
            self.partitioner.register_inert_hook_test(is_inert)

    def end_backward(self) -> None:
        if self.partitioner is not None:
            self.partitioner.end_backward()
        if self.zeropp is not None:
            self.zeropp.end_round()
        if self.coordinator is not None:
            self.coordinator.end_iteration()

    def remove(self) -> None:
        if self.partitioner is not None:
            self.partitioner.remove()
        if self.coordinator is not None:
            self.coordinator.remove()


def _attach_zeropp(store: ParamStore, zero_cfg: Any, *, rank: int, world_size: int,
                   group: Any) -> Optional[ZeroPlusPlus]:
    """ZeRO++ (zeropp.py) on the store's gathers when the config turns any of it on."""
    zpp = ZeroPlusPlus.from_config(zero_cfg, rank=rank, world_size=world_size, group=group)
    store.use_zeropp(zpp)
    return zpp


def _coordinator(module: torch.nn.Module, store: ParamStore, zero_cfg: Any,
                 unit_roots: Sequence[torch.nn.Module] = ()) -> ParamCoordinator:
    return ParamCoordinator(module, store, prefetch_bucket_size=zero_cfg.prefetch_bucket_size,
                            max_live_parameters=zero_cfg.max_live_parameters,
                            max_reuse_distance=zero_cfg.max_reuse_distance, leaf_modules=zero_cfg.leaf_module,
                            memory_efficient_linear=bool(zero_cfg.memory_efficient_linear), unit_roots=unit_roots)


def _unit_roots(module: torch.nn.Module, zero_cfg: Any, store_args: dict, world_size: int) -> list[torch.nn.Module]:
    """Leaves first (a user's leaf is a unit); then, without a granularity threshold, the automatic units."""
    mark_leaf_modules(module, zero_cfg.leaf_module)
    mark_leaves_by_granularity(module, zero_cfg.module_granularity_threshold)
    if int(zero_cfg.module_granularity_threshold or 0) > 0 or not auto_units.enabled():
        return []  # a threshold the user set is their choice of units
    swap = store_args.get("param_swap")
    return auto_units.choose_unit_roots(module, zero_cfg.max_live_parameters, is_leaf=_is_leaf,
                                        max_unit=int(swap["buffer_size"]) * world_size if swap else None)


def _prefetch_in_step(store: ParamStore) -> bool:
    """Whether the step may gather the next forward's first units: plain gathers of shards on the compute
    device across ranks (ZeRO++ gathers them its own way at use; one rank's units are views of the shards)."""
    if os.environ.get(PREFETCH_IN_STEP_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return store.world_size > 1 and store.zeropp is None and not store.file_backed and \
        store.home_device == store.compute_device


SEND_ORDER_ENV = "DSC_Z3_REDUCE_ORDER"  # "plan": buckets sent in the plans' (forward) order, for A/B runs


def backward_send_order(module: torch.nn.Module, groups: Sequence[Sequence[torch.nn.Parameter]],
                        plans: Sequence[PartitionPlan]) -> list[tuple[int, int]]:
    """The stage-3 gradient buckets, (group, bucket), latest-registered parameters first. The store lays a
    group's buckets out in module order (a unit's parameters together, as the forward meets them), and the
    reducer sends a bucket only once every bucket before it is complete: in that order the first bucket (the
    embeddings) completes last, so nothing went out before the end of backward and every bucket of the whole
    unsharded gradient was alive at once. Backward completes them roughly in reverse module order; groups
    interleave by position (a block's weights and its biases in two groups go out together)."""
    position = {id(p): k for k, p in enumerate(module.parameters())}
    keyed = []
    for g, (params, plan) in enumerate(zip(groups, plans)):
        first: dict[int, int] = {}
        for i, p in enumerate(params):
            b = plan.param_bucket[i]
            first[b] = min(first.get(b, 1 << 62), position.get(id(p), 1 << 62))
        keyed += [(-first.get(b, 0), g, b) for b in range(plan.num_buckets)]
    return [(g, b) for _, g, b in sorted(keyed)]


def loco_file(rank: int, world: int) -> str:
    return f"loco_errors_rank_{rank:05d}_of_{world:05d}.pt"


class DeepSpeedZeroOptimizer_Stage3(DeepSpeedZeroOptimizer):  # noqa: N801 (DeepSpeed's class name)
    STAGES = (3,)

    def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, *, store_args: dict,
                 zero_cfg: Any, **kwargs: Any) -> None:
        check_hpz_size(int(zero_cfg.zero_hpz_partition_size), kwargs["world_size"])  # before any collective
        groups = [[p for p in g["params"] if p.requires_grad] for g in init_optimizer.param_groups]
        # leaves and unit roots are known before the store is laid out: the parameters of each form one unit
        roots = _unit_roots(module, zero_cfg, store_args, kwargs["world_size"])
        self.store = build_param_store(module, groups, rank=kwargs["rank"], world_size=kwargs["world_size"],
                                       group=kwargs.get("dp_process_group"), unit_roots=roots, **store_args)
        # ZeRO++ before the optimizer: under qgZ its int4 all-to-all reduce-scatter is the gradient
        # partitioner's strategy from construction on
        self.zeropp = _attach_zeropp(self.store, zero_cfg, rank=kwargs["rank"], world_size=kwargs["world_size"],
                                     group=kwargs.get("dp_process_group"))
        qgz = self.zeropp is not None and self.zeropp.quantized_gradients and kwargs["world_size"] > 1
        super().__init__(init_optimizer, stage=3, quantized_reduce=self.zeropp.reduce_scatter if qgz else None,
                         **kwargs)
        if os.environ.get(SEND_ORDER_ENV, "").strip().lower() != "plan":
            self.reducer.set_send_order(backward_send_order(module, self.bit16_groups, self.partition_plans))
        self.sub_group_size = int(zero_cfg.sub_group_size)  # DeepSpeed's checkpoint sub-groups
        self.zero_quantized_nontrainable_weights = bool(zero_cfg.zero_quantized_nontrainable_weights)
        self.coordinator = _coordinator(module, self.store, zero_cfg, roots)
        self._round = _Stage3Round(self.reducer, self.coordinator, self.zeropp)
        self.store.follow_write_backs(self._master_follows_shard)

    def rank_checkpoint_file(self) -> Optional[tuple[str, dict]]:
        """LoCo's error buffers differ between ranks: this rank's own file (None without LoCo)."""
        loco = self.zeropp.loco if self.zeropp is not None else None
        if loco is None:
            return None
        return loco_file(self.rank, self.world_size), {"loco": loco.state_dict(), "world_size": self.world_size}

    def load_rank_checkpoint_file(self, saved: Any) -> None:
        """LoCo's error buffers back when the checkpoint has this rank's file at this world size; otherwise
        they start from zero (as after reset_T steps), said once."""
        loco = self.zeropp.loco if self.zeropp is not None else None
        if loco is None:
            return
        state = saved.read_rank_file(loco_file(self.rank, self.world_size))
        if state is not None and state.get("world_size") == self.world_size:
            loco.load_state_dict(state["loco"], self.store.compute_device)
            return
        if self.rank == 0:
            from deepspeed_c.utils.logging import logger

            logger.warning(f"zeropp_loco_param: the checkpoint in {saved.tag_dir} has no LoCo error buffers for "
                           f"{self.world_size} ranks; they start from zero")

    @_states_resident
    @torch.no_grad()
    def quantize_nontrainable_params(self) -> None:
        """DeepSpeed's call after changing which parameters train (LoRA): under
        zero_quantized_nontrainable_weights the units whose parameters are now all frozen travel as int8."""
        if not self.zero_quantized_nontrainable_weights:
            from deepspeed_c.utils.logging import logger

            logger.warning("quantize_nontrainable_params() called with zero_quantized_nontrainable_weights disabled, "
                           "return without doing anything")
            return
        self.store.mark_frozen_units()

    def _master_follows_shard(self, g: int, start: int, end: int) -> None:
        """Weights edited through GatheredParameters(modifier_rank=...) stay edited: the masters take them."""
        if g < len(self.fp32_partitions):
            self.fp32_partitions[g].detach()[start:end].copy_(self.store.shards[g][start:end])

    def _cut_group(self, g: int, params: list[torch.nn.Parameter], cap: int, master_dtype: torch.dtype,
                   master_device: torch.device, pin: bool) -> tuple[PartitionPlan, torch.Tensor]:
        shard = self.store.shards[g]
        flat = host_empty(shard.numel(), master_dtype, pin) if master_device.type == "cpu" else \
            torch.empty(shard.numel(), dtype=master_dtype, device=master_device)
        flat.copy_(shard)
        return self.store.plans[g], flat

    def _weights_writer(self) -> Any:
        # the host step (offload_optimizer) hands chunks back from its own pipeline: no gathers from there
        early = _prefetch_in_step(self.store) and getattr(self, "offload", None) is None
        return ShardWriter(self.store, ahead=self._units_ahead if early else None)

    def _units_ahead(self) -> list[int]:
        """The units the next forward gathers at its first step (none without a fetch plan yet)."""
        coordinator = getattr(self, "coordinator", None)
        plan = None if coordinator is None or not coordinator.use_plan else coordinator.plan
        if plan is None or plan.num_steps == 0:
            return []
        return sorted({u for group in plan.fetch_at(0) for u in group})

    def _step_strategy(self, epilogue: Any) -> ZeroStepStrategy:
        strategy = super()._step_strategy(epilogue)
        if isinstance(strategy, FusedEpilogueStep) and \
                ShardSlots.usable(self.store, self.fp32_partitions[0], strategy.lp_dtype):
            strategy.use_slots(ShardSlots(self.store))
        return strategy

    def owned_reducer(self) -> Any:
        return self._round

    def flat_grad_partitions(self) -> None:
        """Stage 3 steps from its store's gradient shards, not from ZeRO-1/2's partitioner."""
        return None

    @_states_resident
    @torch.no_grad()
    def masters_from_model(self) -> None:
        for g, master in enumerate(self.fp32_partitions):
            master.copy_(self.store.shards[g])

    def release_gathered_params(self) -> None:
        self.store.release_all(keep_persistent=False)

    def lp_storage(self) -> list[torch.Tensor]:
        """At stage 3 the 16-bit weights are the shards (gathered copies are dropped first)."""
        self.store.release_all(keep_persistent=False)
        return list(self.store.shards)

    def drop_device_scratch(self) -> None:
        super().drop_device_scratch()
        adopt(self.store)  # ds_tensor views follow the shards to wherever they moved

    # -- checkpoints in DeepSpeed's stage-3 layout (runtime/checkpointing/zero3.py converts the export) -------
    def _export(self) -> PartitionExport:
        return dataclasses.replace(super()._export(), sub_group_size=self.sub_group_size, store=self.store)

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        load_module_into_store(self.store, module, state_dict)

    def destroy(self) -> None:
        self._round.remove()

    def __repr__(self) -> str:
        return f"DeepSpeedZeroOptimizer_Stage3(world_size={self.world_size}, {self.optimizer!r})"


class Zero3Params(EngineOptimizer):
    """Stage 3 without an optimizer (evaluation or inference of a partitioned model): the store and the
    gather-on-use hooks only."""

    def __init__(self, module: torch.nn.Module, *, rank: int, world_size: int, group: Any, store_args: dict,
                 zero_cfg: Any) -> None:
        self.store = build_param_store(module, [], rank=rank, world_size=world_size, group=group, **store_args)
        self.zeropp = _attach_zeropp(self.store, zero_cfg, rank=rank, world_size=world_size, group=group)
        self.coordinator = _coordinator(module, self.store, zero_cfg)
        self._round = _Stage3Round(None, self.coordinator)

    def owned_reducer(self) -> Any:
        return self._round

    def release_gathered_params(self) -> None:
        self.store.release_all(keep_persistent=False)

    def model_file_state(self) -> Optional[dict]:
        raise NotImplementedError("deepspeed_c: save_checkpoint at ZeRO stage 3 without an optimizer is not built yet; "
                                  "save the weights with save_16bit_model (stage3_gather_16bit_weights_on_model_save)")

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        load_module_into_store(self.store, module, state_dict)

    def load_checkpoint_state(self, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
        if saved.partitioned_weights:
            raise NotImplementedError("deepspeed_c: loading a ZeRO stage-3 checkpoint into a stage-3 engine without an "
                                      "optimizer is not built yet; build the engine with its optimizer, or load whole "
                                      "weights (zero_to_fp32, or a stage 0-2 checkpoint)")

    def load_checkpoint_weights(self, saved: SavedCheckpoint) -> None:
        self.load_checkpoint_state(saved, False)

    def destroy(self) -> None:
        self._round.remove()


@torch.no_grad()
def load_module_into_store(store_: ParamStore, module: torch.nn.Module, saved: dict) -> bool:
    """A module state_dict (whole values) applied to a stage-3 model: each whole parameter value is cut into
    this rank's shard (no collective); placeholders (a partitioned checkpoint's parameters) are skipped;
    buffers go to the module. Returns whether any parameter was loaded."""
    where = {id(p): (g, i) for g, params in enumerate(store_.groups) for i, p in enumerate(params)}
    by_name = dict(module.named_parameters(remove_duplicate=False))
    rest, loaded = {}, False
    for key, value in saved.items():
        p = by_name.get(key)
        if p is None:
            rest[key] = value
            continue
        full = int(getattr(p, "ds_numel", p.numel()))
        if isinstance(value, torch.Tensor) and value.numel() == full and full > 0 and id(p) in where:
            store_.load_full(*where[id(p)], value)
            loaded = True
    store_.release_all(keep_persistent=False)  # any gathered copy is stale now
    module.load_state_dict(rest, strict=False)
    return loaded


def __getattr__(name: str) -> Any:
    # the memory estimators live in stage3_estimators.py (DeepSpeed exposes them here)
    if name.startswith("estimate_zero3") or name == "model_to_params":
        from deepspeed_c.runtime.zero import stage3_estimators

        return getattr(stage3_estimators, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""ZeRO stages 1 and 2: optimizer state (and, for stage 2, gradients) partitioned across the
data-parallel ranks.

Per parameter group, the trainable parameters get a PartitionPlan (deepspeed_c.ops.partition, runtime
layout): rank r owns chunk r of every bucket. This rank keeps only its fp32 master partition (one flat
tensor per group, on the device or, with offload_optimizer, in host memory), and the wrapped optimizer
steps that flat tensor as its only parameter, so its state is partitioned too. Gradients arrive already
reduce-scattered in the same layout (grad_partition.ZeroGradPartitioner: stage 2 every micro-step,
stage 1 on the accumulation boundary); the step checks overflow and computes the clipping coefficient
from one all-reduce of the partitions' squared norm, steps, and all-gathers the updated weights in the
model's dtype back into the model parameters, one collective per bucket (param_gather.BucketGatherer).
The parameters are views of one flat buffer per group in the plan's layout (flat_model_params, as
DeepSpeed's bit16_groups_flat), so each gather writes straight into them; with the fused epilogue a
bucket's chunk is stepped, written into this rank's slot and gathered in place while the next steps.
With offload_optimizer the host side is offload.CPUOffload: gradients staged to pinned host memory as
their buckets finish, the C CPU optimizer stepping in sub-chunks whose results go back to the device
and into their bucket's all-gather while it steps the next. How the step applies (fused epilogue,
separate passes on the device, host offload) is one step_strategy.ZeroStepStrategy chosen at construction.

For checkpointing: `partition_export()` (plans, world/rank facts and the runtime-layout state as data, which
runtime/checkpointing/zero.py converts; this module never calls checkpoint code) and
`import_partition_state()`, over `state_dict()` / `load_state_dict()`, `partition_plans` (one PartitionPlan per group),
`fp32_partitions` / `single_partition_of_fp32_groups` (this rank's flat masters, runtime layout),
`local_optimizer_state(g)`, `bit16_groups` (the model parameters of each group, in plan order) and
`refresh_model_params()` (model weights re-gathered from the masters)."""
from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_zeros
from deepspeed_c.ops.partition import DEEPSPEED_ALIGNMENT, PartitionPlan
from deepspeed_c.runtime.fused_epilogue import AdamEpilogue, device_global_norm
from deepspeed_c.runtime.optimizer_seam import EngineOptimizer, PartitionExport
from deepspeed_c.runtime.step_sequence import Norm, StepOutcome, overflow_checked_step
from deepspeed_c.runtime.zero.flat_model_params import FlatModelParams
from deepspeed_c.runtime.zero.grad_partition import ZeroGradPartitioner, chunk_range, grad_dtypes
from deepspeed_c.runtime.zero.offload import SUB_CHUNK as OFFLOAD_SUB_CHUNK
from deepspeed_c.runtime.zero.offload import CPUOffload
from deepspeed_c.runtime.zero.param_gather import BucketGatherer
from deepspeed_c.runtime.zero.stage2_estimators import (  # noqa: F401 (DeepSpeed's import path)
    estimate_zero2_model_states_mem_needs, estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live)
from deepspeed_c.runtime.zero.state_offload import ZeroStateOffload
from deepspeed_c.runtime.zero.step_strategy import (DeviceOptimizerStep, FusedEpilogueStep, HostOffloadStep,
                                                    ZeroStepStrategy)
from deepspeed_c.utils.logging import logger

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs",
           "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero2_model_states_mem_needs_all_cold"]

OWNER_ATTR = "_dsc_zero_owner"  # on each trainable param: (weakref to the optimizer, group, index)


def _states_resident(fn: Callable) -> Callable:
    """fn runs with the masters and optimizer state in memory (NVMe offload reads them back first
    and writes them out after)."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._resident():
            return fn(self, *args, **kwargs)
    return wrapper


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


class DeepSpeedZeroOptimizer(EngineOptimizer):
    """Wraps a torch optimizer built over the model's parameters; after construction the optimizer's
    param groups hold one flat fp32 partition each (hyperparameters stay in the same group dicts, so
    lr schedulers keep working)."""

    STAGES: tuple[int, ...] = (1, 2)

    def __init__(self, init_optimizer: torch.optim.Optimizer, *, stage: int, rank: int, world_size: int,
                 should_reduce: Callable[[], bool], dp_process_group: Any = None,
                 reduce_bucket_size: int = int(5e8), allgather_bucket_size: int = int(5e8),
                 clip_grad: float = 0.0, loss_scaler: Any = None, check_overflow: bool = False,
                 communication_dtype: Optional[torch.dtype] = None, offload_device: Optional[str] = None,
                 pin_memory: bool = False, overlap_comm: Optional[bool] = True, prescale_gradients: bool = False,
                 ignore_unused_parameters: bool = True, offload_threads: Optional[int] = None,
                 gradient_predivide_factor: float = 1.0, reduce_scatter: bool = True,
                 gradient_average: bool = True,
                 is_boundary: Optional[Callable[[], bool]] = None, offload_sub_chunk: Optional[int] = None,
                 offload_stage_on_host: Optional[bool] = None, master_dtype: torch.dtype = torch.float32,
                 accumulate_fp32: bool = False, nvme_offload: Optional[dict[str, Any]] = None,
                 sequence_parallel_size: int = 1,
                 quantized_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        if stage not in self.STAGES:
            raise ValueError(f"{type(self).__name__} runs ZeRO stage {' or '.join(map(str, self.STAGES))}, "
                             f"got stage={stage}")
        self.optimizer = init_optimizer
        self.stage = stage
        self.rank = rank
        self.world_size = world_size
        self.dp_process_group = dp_process_group
        self.clip_grad = clip_grad
        self.loss_scaler = loss_scaler
        self.check_overflow = check_overflow
        self.allgather_bucket_size = int(allgather_bucket_size)
        self.offload_device = offload_device
        self.overflow = False
        self._global_grad_norm: Optional[float] = None
        self.is_gradient_accumulation_boundary = True
        self.bit16_groups: list[list[torch.nn.Parameter]] = []
        self.partition_plans: list[PartitionPlan] = []
        self.fp32_partitions: list[torch.nn.Parameter] = []
        self.frozen_params: list[torch.nn.Parameter] = []
        cap = max(1, int(reduce_bucket_size))
        for g, group in enumerate(init_optimizer.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            self.frozen_params += [p for p in group["params"] if not p.requires_grad]
            if not params:
                raise ValueError(f"param group {g} has no trainable parameters; ZeRO needs at least one")
            master_device = torch.device(offload_device) if offload_device else params[0].device
            # NVMe offload empties the masters after writing them out: pinned, their memory would stay in
            # torch's pinned-memory cache
            pin = pin_memory and master_device.type == "cpu" and torch.cuda.is_available() and nvme_offload is None
            plan, flat = self._cut_group(g, params, cap, master_dtype, master_device, pin)
            master = torch.nn.Parameter(flat, requires_grad=True)
            group["params"] = [master]
            self.bit16_groups.append(params)
            self.partition_plans.append(plan)
            self.fp32_partitions.append(master)
            for i, p in enumerate(params):
                setattr(p, OWNER_ATTR, (weakref.ref(self), g, i))
        self.partition_numels = [m.numel() for m in self.fp32_partitions]  # masters may be emptied (NVMe)
        accumulate_fp32 = accumulate_fp32 and stage == 1
        # DeepSpeed builds its BF16_Optimizer for this case (runtime/optimizer_roles.py answers isinstance from it)
        self.deepspeed_role: Optional[str] = "BF16_Optimizer" if accumulate_fp32 else None
        # the offload path first: its side stream and per-bucket host copy are the partitioner's from the start
        self.offload: Optional[CPUOffload] = None
        if offload_device == "cpu":
            offload_cls: Any = self._offload_class()
            if nvme_offload is not None:  # ZeRO-Infinity: masters and moments in files under nvme_path
                from deepspeed_c.runtime.swap_tensor.pipelined_optimizer_swapper import NVMeOffload as offload_cls
            ranges = [[chunk_range(plan, b, world_size) for b in range(plan.num_buckets)]
                      for plan in self.partition_plans]
            self.offload = offload_cls(init_optimizer, self.fp32_partitions, self.bit16_groups,
                                       grad_dtypes(self.bit16_groups, communication_dtype, accumulate_fp32), ranges,
                                       stage_on_host=offload_stage_on_host,
                                       sub_chunk=offload_sub_chunk or OFFLOAD_SUB_CHUNK, pin_memory=pin_memory,
                                       threads=offload_threads, **(nvme_offload or {}))
        # stage 2 reduces every micro-step into the partition (the full gradient is freed as its bucket
        # goes out); stage 1 keeps full gradients between boundaries and reduces once per accumulation
        # boundary, freeing them then too (the reduced gradient lives in the partition; param.grad
        # would be the rank's unreduced one, which safe_get_full_grad would return)
        self.reducer = ZeroGradPartitioner(
            self.bit16_groups, self.partition_plans, rank=rank, world_size=world_size, should_reduce=should_reduce,
            is_boundary=is_boundary, group=dp_process_group, comm_dtype=communication_dtype,
            overlap=bool(overlap_comm) or stage >= 2,
            # stage 2 overlaps unless overlap_comm is false explicitly: then each bucket's reduction is
            # awaited as soon as it is issued, as DeepSpeed's non-overlapped stage 2 does
            wait_each_bucket=stage >= 2 and overlap_comm is False, accumulate_fp32=accumulate_fp32,
            use_reduce_scatter=reduce_scatter, prescale_gradients=prescale_gradients,
            gradient_predivide_factor=gradient_predivide_factor, gradient_average=gradient_average,
            sequence_parallel_size=sequence_parallel_size, quantized_reduce=quantized_reduce,
            side_stream=None if self.offload is None else self.offload.stream,
            on_bucket_final=None if self.offload is None else self.offload.bucket_sink())
        self.flat_params: Optional[FlatModelParams] = None
        self.gatherer = self._weights_writer()
        self.ignore_unused_parameters = ignore_unused_parameters
        # on CUDA with Adam/AdamW and fp32 masters on the device: the one-pass epilogue kernel
        epilogue = None
        if self.offload is None and master_dtype == torch.float32:
            epilogue = AdamEpilogue.for_optimizer(init_optimizer, self.fp32_partitions[0].device)
        self.step_strategy = self._step_strategy(epilogue)
        # AutoTP: (weight per slice of this rank's partitions, group) for the whole model's gradient norm
        self._tp_norm: Optional[tuple[list[list[tuple[int, int, float]]], Any]] = None
        self.state_offload = ZeroStateOffload(self)

    def _offload_class(self) -> type:
        """The host side of offload_optimizer (SuperOffload's speculative host step replaces it)."""
        return CPUOffload

    def _cut_group(self, g: int, params: list[torch.nn.Parameter], cap: int, master_dtype: torch.dtype,
                   master_device: torch.device, pin: bool) -> tuple[PartitionPlan, torch.Tensor]:
        """Group g's partition plan and this rank's master partition."""
        # backward produces gradients roughly in reverse order: so should the buckets fill
        order = list(range(len(params) - 1, -1, -1))
        plan = PartitionPlan.build([p.numel() for p in params], self.world_size, cap, DEEPSPEED_ALIGNMENT, order)
        # this rank's master partition is cut straight from the (16-bit) parameters slice by slice: no
        # fp32 copy of the whole model is ever made. master_dtype is fp32, or the model dtype under
        # {bf16,fp16}_master_weights_and_grads (DeepSpeed keeps the partition's masters and gradients
        # in 16 bits then)
        n = plan.partition_size("runtime")
        flat = host_zeros(n, master_dtype, pin) if master_device.type == "cpu" else \
            torch.zeros(n, dtype=master_dtype, device=master_device)
        with torch.no_grad():
            plan.scatter_params([p.detach() for p in params], "runtime", self.rank, out=flat)
        return plan, flat

    def _step_strategy(self, epilogue: Optional[AdamEpilogue]) -> ZeroStepStrategy:
        """offload_optimizer: the host step; else the fused epilogue when there is one; else separate passes."""
        if self.offload is not None:
            return HostOffloadStep(self.offload, self.gatherer)
        if epilogue is not None:
            return FusedEpilogueStep(epilogue, self.fp32_partitions, self.partition_plans, self.gatherer,
                                     self.flat_params, rank=self.rank, world_size=self.world_size,
                                     lp_dtype=self.bit16_groups[0][0].dtype)
        return DeviceOptimizerStep(self.optimizer, self.fp32_partitions, self._gather_from_masters)

    @property
    def epilogue(self) -> Optional[AdamEpilogue]:
        """The fused step's kernel (None when the step runs another way)."""
        return self.step_strategy.epilogue

    @epilogue.setter
    def epilogue(self, epilogue: Optional[AdamEpilogue]) -> None:
        """A subclass turning the fused step off (MoE members, whose norm is the composite's) gets the
        strategy that steps without it."""
        self.step_strategy = self._step_strategy(epilogue)

    def _weights_writer(self) -> Any:
        """Where updated partitions go, bucket by bucket (submit/finish): all-gathered into the model,
        whose parameters become views of one flat buffer per group (the gathers' destination)."""
        self.flat_params = FlatModelParams(self.partition_plans, self.bit16_groups)
        self.flat_params.ensure()
        return BucketGatherer(self.partition_plans, self.bit16_groups, world_size=self.world_size,
                              group=self.dp_process_group, cap=self.allgather_bucket_size, flat=self.flat_params)

    # -- the optimizer face ------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        from deepspeed_c.runtime.fp16.loss_scaler import DynamicLossScaler

        return isinstance(self.loss_scaler, DynamicLossScaler)

    def note_backward_scale(self, scale: float) -> None:
        self._backward_scale = scale

    @property
    def _scale_used(self) -> float:
        return getattr(self, "_backward_scale", self.cur_scale)

    # DeepSpeed's attribute names, which user code and tools read
    @property
    def single_partition_of_fp32_groups(self) -> list[torch.nn.Parameter]:
        return self.fp32_partitions

    @property
    def partition_count(self) -> int:
        return self.world_size

    # -- accessors for checkpointing and the safe_get_* helpers ---------------------------------------
    def local_optimizer_state(self, g: int) -> dict[str, Any]:
        """The wrapped optimizer's state for group g's flat partition (tensors in the runtime layout)."""
        return self.optimizer.state[self.fp32_partitions[g]]

    def param_slices(self, g: int, i: int, rank: Optional[int] = None) -> list[tuple[int, int, int]]:
        """(param_start, local_start, length) of param i of group g inside `rank`'s partition."""
        r = self.rank if rank is None else rank
        return [(ps, ls, n) for param, _, ps, ls, n, _ in self.partition_plans[g].slices("runtime", r) if param == i]

    def gather_partition(self, g: int, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a group-g partition-shaped tensor, cut back into whole flat params
        (a collective: every rank must call it)."""
        plan = self.partition_plans[g]
        if self.world_size == 1:
            return plan.gather_params([local.detach()], "runtime")
        dev = self.bit16_groups[g][0].device
        send = local.detach().to(dev).contiguous()
        out = torch.empty(send.numel() * self.world_size, dtype=send.dtype, device=dev)
        _comm().all_gather_into_tensor(out, send, group=self.dp_process_group)
        return plan.gather_params(list(out.chunk(self.world_size)), "runtime")

    def _resident(self) -> contextlib.AbstractContextManager:
        return self.offload.resident() if self.offload is not None else contextlib.nullcontext()

    # -- the engine seam (runtime/optimizer_seam.EngineOptimizer) ------------------------------------
    def before_step(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Nothing to fill: the reducer already sent zeros for parameters that got no gradient."""

    def owned_reducer(self) -> ZeroGradPartitioner:
        return self.reducer

    def flat_grad_partitions(self) -> Optional[Callable[[], Sequence[Optional[torch.Tensor]]]]:
        """The partitioner's reduced flat partitions as they are at each call (clear() replaces the list;
        None for a group without a reducing backward, unlike reduced_grad_partitions' zeros)."""
        reducer = self.reducer
        return lambda: reducer.grad_partitions

    def model_param_groups(self) -> list[list[torch.nn.Parameter]]:
        return [list(g) for g in self.bit16_groups]

    def model_file_state(self) -> Optional[dict]:
        return None  # each rank's partition goes to its own ZeRO file

    @contextlib.contextmanager
    def partition_export(self) -> Iterator[PartitionExport]:
        """This rank's partitions as data for the checkpointer (runtime/checkpointing/zero.py converts them to
        and from DeepSpeed's layout); the masters are the live ones (a load fills them in place)."""
        with self._resident():
            yield self._export()

    def _export(self) -> PartitionExport:
        return PartitionExport(stage=self.stage, rank=self.rank, world_size=self.world_size,
                               group=self.dp_process_group, plans=list(self.partition_plans),
                               params=[list(g) for g in self.bit16_groups],
                               masters=[m.detach() for m in self.fp32_partitions],
                               state=self.state_dict(clone_masters=False), loss_scaler=self.loss_scaler)

    def import_partition_state(self, state: Optional[dict], load_optimizer_states: bool,
                               load_from_fp32_weights: bool) -> None:
        if state is None:
            self.refresh_model_params()
            return
        self.load_state_dict(state, load_optimizer_states=load_optimizer_states,
                             load_from_fp32_weights=load_from_fp32_weights)

    def refresh_masters(self) -> None:
        self.masters_from_model()

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        self.state_offload.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.state_offload.reload(non_blocking)

    def lp_storage(self) -> list[torch.Tensor]:
        """The tensors holding the model's 16-bit weights (offload_states' lp_params)."""
        return [p for params in self.bit16_groups for p in params] + list(self.frozen_params)

    def drop_device_scratch(self) -> None:
        """Device buffers rebuilt on demand (after states moved between devices)."""
        self.step_strategy.drop_scratch()
        if self.flat_params is not None:  # the parameters moved out of it: rebuilt at the next gather
            self.flat_params.drop()

    # -- step ----------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for params in self.bit16_groups:
            for p in params:
                p.grad = None
        for m in self.fp32_partitions:
            m.grad = None
        self.reducer.clear()
        if self.offload is not None:
            self.offload.reset()

    def reduced_grad_partitions(self) -> list[torch.Tensor]:
        """Each group's reduced (averaged) gradient partition on the model's device; zeros for a group
        that had no reducing backward since the last step."""
        return [self.reducer.grad_partition(g) for g in range(len(self.bit16_groups))]

    def set_tensor_parallel_norm(self, tp_size: int, group: Any) -> None:
        """AutoTP: make the gradient norm (clipping, overflow) the whole unsharded model's. Each element's
        square is weighted 1 for a tensor-parallel shard (ds_is_tensor_model_parallel) and 1 / tp_size for a
        parameter replicated over the TP group, then summed over `group` (data x tensor ranks): shards
        add up over TP, replicas count once, as the norm of the unsharded model's gradient."""
        table = []
        for g, plan in enumerate(self.partition_plans):
            params = self.bit16_groups[g]
            table.append([(lstart, length, 1.0 if getattr(params[i], "ds_is_tensor_model_parallel", False)
                           else 1.0 / tp_size) for i, _, _, lstart, length, _ in plan.slices("runtime", self.rank)])
        self._tp_norm = (table, group)

    def _tp_sq_norm(self, parts: Sequence[torch.Tensor]) -> float:
        assert self._tp_norm is not None
        table, group = self._tp_norm
        dev = self.bit16_groups[0][0].device
        local = torch.zeros((), dtype=torch.float64, device=dev)
        for part, slices in zip(parts, table):
            flat = part.view(-1)
            for lstart, length, weight in slices:
                sq = torch.linalg.vector_norm(flat[lstart:lstart + length], 2.0, dtype=torch.float32) ** 2
                local += weight * sq.to(dev, torch.float64)
        _comm().all_reduce(local, group=group)
        return float(local.item())

    def _global_sq_norm(self, parts: Sequence[torch.Tensor]) -> float:
        """Squared L2 norm of the whole reduced gradient: each rank's partitions, then one scalar
        all-reduce (padding is zero, so it adds nothing)."""
        dev = self.bit16_groups[0][0].device
        local = torch.zeros((), dtype=torch.float32, device=dev)
        for t in parts:
            local += torch.linalg.vector_norm(t, 2.0, dtype=torch.float32).to(dev) ** 2
        if self.world_size > 1:
            _comm().all_reduce(local, group=self.dp_process_group)
        return float(local.item())

    def grad_norm(self, parts: Sequence[torch.Tensor], on_device: bool) -> Norm:
        """Global L2 norm of the reduced (scaled) gradient: a host float, or a device scalar for the fused
        step, which keeps it on the device (fp16 reads it once: the loss scaler decides on the host, as
        DeepSpeed's does)."""
        if self._tp_norm is not None:  # AutoTP: the unsharded model's norm (one host read, as the fp16 path has)
            tp_norm = math.sqrt(self._tp_sq_norm(parts))
            return torch.tensor([tp_norm], dtype=torch.float32, device=parts[0].device) if on_device else tp_norm
        if on_device:
            return device_global_norm(parts, self.dp_process_group, self.world_size)
        return math.sqrt(self._global_sq_norm(parts))

    def step(self, closure: Any = None) -> bool:
        """Returns True when the step was skipped for overflow (DeepSpeed's convention)."""
        if not self.ignore_unused_parameters:
            self._refuse_unused_parameters()
        if self.flat_params is not None:
            self.flat_params.ensure()
        outcome = self.step_strategy.step(self.reduced_grad_partitions(), clip_grad=self.clip_grad,
                                          grad_norm=self.grad_norm, decide=self._decide)
        self.overflow = outcome.skipped
        self._global_grad_norm = outcome.grad_norm
        if outcome.skipped:
            logger.info(f"[deepspeed_c] ZeRO stage {self.stage}: overflow, skipping step")
            self.zero_grad()
            return True
        for m in self.fp32_partitions:
            m.grad = None
        self.reducer.clear()
        return False

    def _decide(self, norm: Any, **apply: Any) -> StepOutcome:
        return overflow_checked_step(norm, check_overflow=self.check_overflow, sync_overflow=None,
                                     loss_scaler=self.loss_scaler,
                                     grad_scale=lambda: self._scale_used if self.loss_scaler is not None else 1.0,
                                     clip_grad=self.clip_grad, **apply)

    def _refuse_unused_parameters(self) -> None:
        """zero_optimization.ignore_unused_parameters=false: DeepSpeed asserts when a trainable
        parameter got no gradient in the backwards of this step."""
        touched = self.reducer.touched
        reduced = self.reducer.reduced_params
        unused = [k for k in range(len(reduced)) if k not in touched]
        if unused:
            shapes = [tuple(reduced[k].shape) for k in unused[:8]]
            raise AssertionError(
                f"{len(unused)} trainable parameter(s) (shapes {shapes}{'...' if len(unused) > 8 else ''}) were not "
                "used in producing the loss. Enable zero_optimization.ignore_unused_parameters (the default), or "
                "make every trainable parameter and the forward's outputs take part in the loss.")

    @torch.no_grad()
    def _gather_from_masters(self) -> None:
        """The updated masters, in the model dtype on the model device, all-gathered bucket by bucket."""
        self._gather_chunks([master.detach().to(device=params[0].device, dtype=params[0].dtype, non_blocking=True)
                             for master, params in zip(self.fp32_partitions, self.bit16_groups)])

    @torch.no_grad()
    def _gather_chunks(self, partitions: Sequence[torch.Tensor]) -> None:
        """Each group's updated partition (model dtype, model device) into the model, bucket by bucket."""
        for g, lp in enumerate(partitions):
            for b in range(self.partition_plans[g].num_buckets):
                start, end = self.reducer.chunk_range(g, b)
                self.gatherer.submit(g, b, lp[start:end])
        self.gatherer.finish()

    @torch.no_grad()
    @_states_resident
    def masters_from_model(self) -> None:
        """This rank's masters (fp32, or 16-bit under *_master_weights_and_grads) re-cut from the model's current (16-bit) parameters."""
        for plan, params, master in zip(self.partition_plans, self.bit16_groups, self.fp32_partitions):
            out = torch.zeros(master.numel(), dtype=master.dtype, device=params[0].device)
            master.copy_(plan.scatter_params([p.detach() for p in params], "runtime", self.rank, out=out))

    @_states_resident
    def refresh_model_params(self) -> None:
        """Model parameters re-filled from the fp32 masters of every rank (after loading a checkpoint)."""
        if self.flat_params is not None:
            self.flat_params.ensure()
        self._gather_from_masters()

    def offload_stats(self) -> Optional[dict[str, float]]:
        """Accumulated offload pipeline timings and bytes (None without offload_optimizer)."""
        return None if self.offload is None else self.offload.stats.as_dict()

    # -- checkpoint state ----------------------------------------------------------------------------
    @_states_resident
    def state_dict(self, clone_masters: bool = True) -> dict[str, Any]:
        """This rank's state; partitions are in the runtime layout of `partition_plans` (convert with
        PartitionPlan.convert(..., "runtime", "deepspeed") for DeepSpeed's on-disk layout). With
        clone_masters=False the fp32 partitions are the live masters (for a caller that only reads them)."""
        return {
            "zero_stage": self.stage,
            "partition_count": self.world_size,
            "rank": self.rank,
            "layout": "runtime",
            "group_numels": [list(plan.numels) for plan in self.partition_plans],
            "base_optimizer_state": self.optimizer.state_dict(),
            "single_partition_of_fp32_groups": [m.detach().clone() if clone_masters else m.detach()
                                                for m in self.fp32_partitions],
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
        }

    @_states_resident
    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True,
                        load_from_fp32_weights: bool = True) -> None:
        """Loads a state from this same world size and plan (resharding is the checkpoint layer's job:
        it re-cuts partitions with PartitionPlan.convert before calling this)."""
        numels = [list(plan.numels) for plan in self.partition_plans]
        if state_dict.get("group_numels", numels) != numels or state_dict.get("partition_count",
                                                                                 self.world_size) != self.world_size:
            raise ValueError("ZeRO state_dict was saved for a different parameter layout or world size; "
                             "re-cut it with PartitionPlan.convert before load_state_dict")
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["base_optimizer_state"])
            # torch's load_state_dict may re-create the param groups; keep our masters in them
            for group, master in zip(self.optimizer.param_groups, self.fp32_partitions):
                group["params"] = [master]
        if self.loss_scaler is not None and state_dict.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = state_dict.get("overflow", False)
        self.clip_grad = state_dict.get("clip_grad", self.clip_grad)
        if load_from_fp32_weights:
            with torch.no_grad():
                for master, saved in zip(self.fp32_partitions, state_dict["single_partition_of_fp32_groups"]):
                    master.copy_(saved)
        else:  # zero_optimization.load_from_fp32_weights=false: masters from the loaded 16-bit weights
            self.masters_from_model()
        self.refresh_model_params()

    def destroy(self) -> None:
        self.reducer.remove()
        if self.offload is not None:
            self.offload.close()

    def __repr__(self) -> str:
        return f"DeepSpeedZeroOptimizer(stage={self.stage}, world_size={self.world_size}, {self.optimizer!r})"

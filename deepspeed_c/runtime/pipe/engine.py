"""PipelineEngine (`deepspeed.runtime.pipe.engine`): what initialize returns for a PipelineModule.

train_batch() runs one batch of gradient_accumulation_steps micro-batches through the stages by
executing the schedule's instructions (runtime/pipe/schedule.py, generated in C) with the
executor in runtime/pipe/executor.py, each through DeepSpeed's `_INSTRUCTION_MAP` dispatch
(runtime/pipe/instruction_map.py: a client's own instructions and schedules plug in there); precision, the optimizer (plain, bf16/fp16 or ZeRO-1 over
the stage's data-parallel group), LR scheduling and checkpoint plumbing are the DeepSpeedEngine's.
engine.forward/backward/step raise, as DeepSpeed's: the pipeline drives them itself.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from deepspeed_c.runtime.engine import DeepSpeedEngine

from . import schedule
from .executor import PipeExecutor, PipeOptions
from .instruction_map import InstructionDispatch
from .loss_aggregation import aggregate
from .module import PipelineModule
from .schedule import ForwardOnlySchedule, schedule_for


class PipelineError(Exception):
    """Errors related to the use of deepspeed.PipelineEngine."""


class DataParallelView:
    """The slice of a PipelineParallelGrid the base engine sees: only the stage's data-parallel
    group (its reducer, ZeRO partitions and batch arithmetic are per stage)."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid

    def get_data_parallel_group(self) -> Any:
        return self.grid.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.grid.get_data_parallel_world_size()

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


class PipelineEngine(InstructionDispatch, DeepSpeedEngine):
    """A training engine for PipelineModules: train_batch / eval_batch."""

    ID_TO_DTYPE = [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16,
                   torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
    DTYPE_TO_ID = {dtype: i for i, dtype in enumerate(ID_TO_DTYPE)}

    def __init__(self, has_bool_tensors: bool = False, *super_args: Any, **super_kwargs: Any) -> None:
        model = super_kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise TypeError(f"model must be a PipelineModule, got {type(model).__name__}")
        self.grid = model.mpu()
        super_kwargs["mpu"] = DataParallelView(self.grid)
        cfg = super_kwargs.get("config_class")
        if cfg is None:
            from deepspeed_c.runtime.config import DeepSpeedConfig

            cfg = super_kwargs["config_class"] = DeepSpeedConfig(super_kwargs.get("config"), super_kwargs["mpu"])
        # Across stages the norm covers every stage's gradients: the optimizers are built without
        # clipping, and the executor clips with the pipeline-wide norm before each step.
        _apply_pipeline_section(cfg.pipeline_config, model)
        self._schedule_name, self.virtual_stages = _schedule_choice(cfg, model)
        if self.virtual_stages > 1:
            names_before = {id(p): n for n, p in model.named_parameters()}
            model.set_virtual_stages(self.virtual_stages)  # before the optimizer sees the parameters
            if super_kwargs.get("model_parameters") is not None:
                from .rebind import rebind_model_parameters

                super_kwargs["model_parameters"] = rebind_model_parameters(super_kwargs["model_parameters"],
                                                                           names_before, model)
            client = super_kwargs.get("optimizer")
            if isinstance(client, torch.optim.Optimizer):
                from .rebind import rebind_optimizer

                rebind_optimizer(client, names_before, model)
        self._pipe_max_norm = float(cfg.gradient_clipping or 0.0)
        # (tensor slicing too: the norm sums the shards over the grid's slice group, replicas once)
        self._pipe_clips = (self.grid.get_pipe_parallel_world_size() > 1 or
                            self.grid.get_slice_parallel_world_size() > 1) and self._pipe_max_norm > 0
        if self._pipe_clips:
            cfg.set_gradient_clipping(0.0)
        super().__init__(*super_args, **super_kwargs)
        if self._pipe_clips:
            cfg.set_gradient_clipping(self._pipe_max_norm)
        self.has_bool_tensors = has_bool_tensors
        self.pipeline_enable_backward_allreduce = True
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.data_iterator: Optional[Iterator] = None
        self.batch_fn: Optional[Any] = None  # set_batch_fn: applied to each micro-batch read
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.grid.data_parallel_size > 1
        self.is_model_parallel = self.grid.model_parallel_size > 1
        self.total_loss: Optional[torch.Tensor] = None
        self.total_additional_losses: Optional[OrderedDict] = None  # the last stage's sums over the batch
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.dp_group_loss: Optional[torch.Tensor] = None  # this data-parallel rank's batch loss
        # the module's get_additional_losses() of the last batch, averaged over micro-batches and data-parallel
        # ranks, on every stage (DeepSpeed's agg_additional_losses; None when the module returns None)
        self.agg_additional_losses: Optional[OrderedDict] = None
        self.dynamic_shape = bool(getattr(model, "dynamic_shape", False))
        if self.zero_optimization_stage() > 1:
            raise NotImplementedError(
                f"zero_optimization.stage={self.zero_optimization_stage()}: pipeline parallelism works with "
                "ZeRO stage 0 and 1 (as DeepSpeed)")
        model.set_checkpoint_parallel_write(self._config.checkpoint_parallel_write_pipeline)
        from deepspeed_c.runtime.checkpointing.options import CheckpointOptions

        from deepspeed_c.runtime.checkpointing.pipeline import PipeCheckpointer

        self.checkpointer = PipeCheckpointer(CheckpointOptions.from_config(self._config))
        self.deferred_wgrad: Optional[Any] = None  # ZB-H1: Linear weight gradients deferred from B to W
        if self._schedule_name == "zb_h1":
            from .deferred_wgrad import DeferredWeightGrads

            self.deferred_wgrad = DeferredWeightGrads()
            self.deferred_wgrad.install(self.module)
        self.executor = self._build_executor()
        if self.training_data is not None:
            self._build_data_iter(self.training_data)

    def destroy(self) -> None:
        if self.deferred_wgrad is not None:
            self.deferred_wgrad.uninstall()
        super().destroy()

    # -- DeepSpeed's refusals --------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def gradient_clipping(self) -> float:
        return self._pipe_max_norm if getattr(self, "_pipe_clips", False) and hasattr(self, "executor") \
            else super().gradient_clipping()

    @property
    def mp_world_size(self) -> int:
        """The grid's model-parallel size (stages x tensor slices), as in DeepSpeed's pipeline engine."""
        return self.grid.get_model_parallel_world_size()

    @property
    def checkpoint_mp_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def _checkpoint_model_parallel(self) -> dict:
        """DeepSpeed's pipeline names its files by the grid's model-parallel rank (the stage x tensor-slice index
        within a data-parallel replica; the stage without tensor slicing) and writes that group's size."""
        return {"mp_rank": self.grid.get_model_parallel_rank(), "mp_world_size": self.grid.get_model_parallel_world_size()}

    def _checkpoint_states(self, stepper: Any = None) -> Any:
        """The stage's states for its checkpointer (runtime/checkpointing/states.py)."""
        from deepspeed_c.runtime.checkpointing.states import PipeCheckpointStates

        return PipeCheckpointStates(**self._checkpoint_state_fields(stepper), stage_id=self.stage_id,
                                    num_stages=self.num_stages, stage_dp_rank=self.grid.get_data_parallel_rank())

    # -- the executor: what it gets, and what it calls back -----------------------------------------
    def _build_executor(self) -> PipeExecutor:
        options = PipeOptions(stage_id=self.stage_id, num_stages=self.num_stages, virtual_stages=self.virtual_stages,
                              dynamic_shape=self.dynamic_shape,
                              clip_norm=self._pipe_max_norm if self._pipe_clips else 0.0,
                              zero_stage=self.zero_optimization_stage())
        return PipeExecutor(module=self.module, grid=self.grid, device=self.device, options=options,
                            precision=self.precision, backward_state=self.backward_state, stepper=self.stepper,
                            deferred_wgrad=self.deferred_wgrad, gas=self.gradient_accumulation_steps,
                            set_boundary=self.set_gradient_accumulation_boundary, step=self._engine_step,
                            grad_partitions=self._zero_grad_partitions())

    def _zero_grad_partitions(self) -> Optional[Any]:
        """ZeRO-1: a getter of the reduced flat gradient partitions the stage's optimizer steps from (the
        optimizer's flat_grad_partitions, read at each step); None where the optimizer steps from each
        parameter's reduction slot."""
        return self.stepper.flat_grad_partitions() if self.stepper is not None else None

    def _engine_step(self, grad_norm: Optional[float] = None) -> None:
        DeepSpeedEngine.step(self, lr_kwargs=self._lr_kwargs)
        if grad_norm is not None:
            self._global_grad_norm = grad_norm  # the pipeline-wide norm, not the optimizer's local one

    # -- public API -------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _build_data_iter(self, dataset: Any) -> None:
        """`initialize(training_data=...)`: the first and last stages read the same micro-batches, so each
        data-parallel replica takes its share in order (no shuffling) from a loader that never runs out."""
        from deepspeed_c.runtime.dataloader import RepeatingLoader

        sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=self.grid.get_data_parallel_world_size(),
            rank=self.grid.get_data_parallel_rank(), shuffle=False)
        self.set_dataloader(RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler)))

    def set_dataloader(self, loader: Any) -> None:
        """The loader the first and last stages iterate (other stages ignore it)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Where the first and last stages read micro-batches from."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_batch_fn(self, fn: Any) -> None:
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        self.executor.reset_links()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """As the engine's; the pipeline then runs the new number of micro-batches per batch."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def get_additional_losses(self) -> Optional[OrderedDict]:
        """The module's get_additional_losses() of the last train_batch, each averaged over its micro-batches
        and the data-parallel ranks, on every stage (None when the module has none)."""
        return self.agg_additional_losses

    def _train_schedule(self) -> schedule.PipeSchedule:
        """The schedule train_batch runs: `schedule.TrainSchedule` as the module holds it now (a client may
        have replaced it), or the one the config's pipeline.schedule names."""
        if self._schedule_name in ("1f1b", "train"):
            return schedule.TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                          stage_id=self.stage_id)
        return schedule_for(self._schedule_name, self.micro_batches, self.num_stages, self.stage_id,
                            self.virtual_stages)

    def _inference_schedule(self, micro_batches: int) -> schedule.PipeSchedule:
        return schedule.InferenceSchedule(micro_batches=micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One batch (gradient_accumulation_steps micro-batches) forward, backward and step; returns
        the loss averaged over micro-batches and data-parallel ranks, on every stage."""
        if not torch._C.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = self.total_additional_losses = None
        started = time.perf_counter()
        done = self.executor.run(self._train_schedule(), training=True, data_iter=self.data_iterator,
                                 batch_fn=self.batch_fn, dispatch=self._exec_instruction)
        self.total_loss, self.total_additional_losses = done["total_loss"], done["total_additional_losses"]
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        self._log_train_batch(time.perf_counter() - started)
        return self.agg_train_loss

    def _log_train_batch(self, seconds: float) -> None:
        """DeepSpeed's pipeline progress line on global rank 0 every steps_per_print batches: the aggregated
        loss, the module's additional losses, and the mean train_batch time since the last line."""
        self._batch_secs = getattr(self, "_batch_secs", 0.0) + seconds
        every = self.steps_per_print()
        if not every or self.global_steps % every:
            return
        iter_time, self._batch_secs = self._batch_secs / every, 0.0
        if self.global_rank != 0:
            return
        line = f"steps: {self.global_steps} loss: {float(self.agg_train_loss):0.4f} "
        for name, value in (self.agg_additional_losses or {}).items():
            line += f"{name}: {float(value):0.4f} "
        print(line + f"iter time (s): {iter_time:0.3f} samples/sec: {self.train_batch_size() / iter_time:0.3f}")

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> Any:
        """Forward only over num_micro_batches (default gradient_accumulation_steps) micro-batches;
        returns the loss (averaged when reduce_output='avg'), and the last stage's logits if asked."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output must be 'avg' or None, got {reduce_output!r}")
        self.module.eval()
        self.set_dataiterator(data_iter)
        micro = num_micro_batches or self.micro_batches
        if self.virtual_stages > 1:  # model chunks: the forward part of the interleaved schedule
            if micro % self.num_stages:
                raise ValueError(f"eval_batch with the interleaved schedule needs num_micro_batches ({micro}) to be "
                                 f"a multiple of the {self.num_stages} pipeline stages")
            sched: Any = ForwardOnlySchedule(schedule_for("interleaved", micro, self.num_stages, self.stage_id,
                                                          self.virtual_stages))
        else:
            sched = self._inference_schedule(micro)
        outputs = self.executor.run(sched, training=False, compute_loss=compute_loss, data_iter=self.data_iterator,
                                    batch_fn=self.batch_fn, dispatch=self._exec_instruction)
        result = None
        if self.is_last_stage():
            losses = outputs["losses"]
            if reduce_output == "avg" and losses:
                result = torch.stack([torch.as_tensor(l, dtype=torch.float32) for l in losses]).mean()
                if self.is_data_parallel:
                    dist.all_reduce(result, group=self.grid.get_data_parallel_group())
                    result /= self.grid.get_data_parallel_world_size()
            else:
                result = losses
        if bcast_loss and reduce_output == "avg":
            result = self._bcast_from_last(result)
        self.module.train()
        if return_logits:
            return result, outputs.get("logits")
        return result

    # -- loss bookkeeping --------------------------------------------------------------------------
    def _bcast_from_last(self, value: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.is_pipe_parallel:
            return value
        buf = value.detach().clone().float().reshape(1) if value is not None else torch.zeros(1, device=self.device)
        dist.broadcast(buf, src=self.grid.stage_to_global(self.num_stages - 1), group=self.grid.get_pipe_parallel_group())
        return buf[0]

    def _aggregate_total_loss(self) -> torch.Tensor:
        """The batch loss (and additional losses) per micro-batch, averaged over data-parallel ranks, on every
        stage (runtime/pipe/loss_aggregation.py)."""
        names = None
        if not self.is_last_stage():  # the last stage sends the values; the others know the names
            extra = self.module.get_additional_losses()
            names = None if extra is None else list(extra.keys())
        self.dp_group_loss, agg, self.agg_additional_losses = aggregate(
            self.total_loss, self.total_additional_losses, self.gradient_accumulation_steps(), self.grid,
            self.is_last_stage(), names, self.device)
        return agg


def _schedule_choice(cfg: Any, model: PipelineModule) -> tuple[str, int]:
    """(schedule name, model chunks per rank) from the `pipeline` section, checked against the model
    and batch before anything is built."""
    pc = cfg.pipeline_config
    name, v = pc.schedule, int(pc.virtual_stages)
    stages = model.num_stages
    gas = int(cfg.gradient_accumulation_steps)
    if name != "interleaved":
        if v != 1:
            raise ValueError(f"pipeline.virtual_stages={v} needs pipeline.schedule='interleaved', got {name!r}")
        from deepspeed_c.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

        if name == "zb_h1" and model.activation_checkpoint_interval > 0 and \
                model.activation_checkpoint_func is not non_reentrant_checkpoint:
            raise NotImplementedError("pipeline.schedule='zb_h1' with activation_checkpoint_interval > 0 needs "
                                      "pipeline.use_reentrant=false: a reentrant checkpoint cannot split its "
                                      "backward into input and weight passes")
        return name, 1
    v = v if v > 1 else 2
    if stages < 2:
        raise ValueError("pipeline.schedule='interleaved' needs at least 2 pipeline stages, got 1")
    if gas % stages:
        raise ValueError(f"pipeline.schedule='interleaved' needs gradient_accumulation_steps ({gas}) to be a multiple "
                         f"of the {stages} pipeline stages")
    return name, v


def _apply_pipeline_section(pc: Any, model: PipelineModule) -> None:
    """What DeepSpeed's engine takes from the `pipeline` section: the checkpoint function
    (use_reentrant) and a non-zero activation_checkpoint_interval override the module's."""
    from deepspeed_c.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

    if pc.use_reentrant is False:
        model.set_activation_checkpoint_func(non_reentrant_checkpoint)
    if pc.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(pc.activation_checkpoint_interval)

"""DeepSpeedEngine: the training loop's state machine (micro-steps, accumulation boundaries,
steps) with everything else delegated to collaborators:

    precision   deepspeed_c.runtime.precision.Precision    dtype, loss scaling, fp32 masters
    reducer     deepspeed_c.runtime.reducer.GradientReducer  data-parallel gradient all-reduce
    report      deepspeed_c.runtime.engine.report.EngineReport  timers, progress line, monitors
    optimizer   built by deepspeed_c.runtime.optimizer_factory (or the client's), wrapped by precision
    zero / checkpointer  plugged in by the ZeRO and checkpoint issues (see _configure_zero).
Setup glue sits beside it: model_setup (the model across ranks), optimizer_setup (optimizer, scheduler,
reducers), zero_setup and profile_setup."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Optional

import torch
from torch.nn import Module

from deepspeed_c.accelerator import get_accelerator
from deepspeed_c.runtime.engine import report as rep
from deepspeed_c.runtime.backward_phase import EngineBackward
from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.config.precision import check_grad_accum_mix
from deepspeed_c.runtime.engine.accessors import EngineConfigAccessors
from deepspeed_c.runtime.engine.io import ROUTE_ENCODE, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_TRAIN, EngineIO
from deepspeed_c.runtime.engine.model_setup import broadcast_replicas, place_model
from deepspeed_c.runtime.engine.optimizer_setup import build_basic_optimizer, build_lr_scheduler, build_reducer
from deepspeed_c.runtime.grad_norm import clip_coefficient, global_norm, scale_
from deepspeed_c.runtime.optimizer_seam import engine_optimizer
from deepspeed_c.runtime.parallel_dims import ParallelDims
from deepspeed_c.runtime.output_hooks import is_loss_for_backward, register_output_hooks
from deepspeed_c.runtime.precision import Precision
from deepspeed_c.runtime.train_state import TrainState, TrainStateAttributes
from deepspeed_c.runtime.engine.data_schedules import EngineDataSchedules
from deepspeed_c.utils.logging import log_dist

__all__ = ["DeepSpeedEngine", "ROUTE_TRAIN", "ROUTE_EVAL", "ROUTE_PREDICT", "ROUTE_ENCODE"]


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


def _is_pipeline_module(module: Any) -> bool:
    """A PipelineModule (DeepSpeed's pipeline_parallelism); its module is only loaded when one exists."""
    pipe = sys.modules.get("deepspeed_c.runtime.pipe.module")
    return pipe is not None and isinstance(module, pipe.PipelineModule)


def _select_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = local_rank if 0 <= local_rank < torch.cuda.device_count() else torch.cuda.current_device()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


class DeepSpeedEngine(Module, EngineConfigAccessors, EngineIO, TrainStateAttributes, EngineDataSchedules):
    r"""DeepSpeed engine for training."""

    def __init__(self, args: Any, model: Module, optimizer: Any = None, model_parameters: Any = None,
                 training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None,
                 dist_init_required: Optional[bool] = None, collate_fn: Any = None, config: Any = None,
                 config_class: Optional[DeepSpeedConfig] = None, mesh_device: Any = None,
                 dont_change_device: bool = False) -> None:
        super().__init__()
        self.dont_change_device = dont_change_device
        self.client_optimizer = optimizer
        self.client_lr_scheduler = lr_scheduler
        self.training_data = training_data
        self.collate_fn = collate_fn
        self.mpu = mpu
        self.mesh_device = mesh_device
        self.train_state = TrainState()  # global_steps, global_samples, skipped_steps, micro_steps: properties
        self.gas_boundary_ctr = 0
        self.gradient_average = True
        self.warn_unscaled_loss = True
        self.enable_backward_allreduce = True
        self.inside_no_sync_ctxt = False
        self._is_compiled = False
        self.optimizer: Any = None
        self.stepper: Any = None  # the optimizer seam (runtime/optimizer_seam.py) the engine steps through
        self.basic_optimizer: Optional[torch.optim.Optimizer] = None
        self.lr_scheduler: Any = None
        self.training_dataloader: Any = None
        self.reducer: Any = None
        self._step_applied = False
        self._global_grad_norm: Optional[float] = None
        self._is_gradient_accumulation_boundary: Optional[bool] = None
        self._destroyed = False
        self._direct_scaler: Any = None

        self.config = config
        self._config = config_class if config_class is not None else DeepSpeedConfig(config, mpu, mesh_device)
        from deepspeed_c.runtime.config.no_effect import warn_keys_without_effect

        warn_keys_without_effect(self._config.user_dict)
        self.gradient_average = self._config.gradient_allreduce_op == "mean"
        self._configure_with_arguments(args)
        self._set_distributed_vars()
        _comm().configure(deepspeed_config=self._config)
        self.report = rep.EngineReport(self._config, self.global_rank)
        self.timers = self.report.timers
        self.tput_timer = self.report.tput_timer
        self.monitor = self.report.monitor
        from deepspeed_c.runtime.checkpointing.engine import EngineCheckpointer
        from deepspeed_c.runtime.checkpointing.options import CheckpointOptions

        self.checkpointer: Any = EngineCheckpointer(CheckpointOptions.from_config(self._config))
        self.precision = Precision(self._config)
        self._configure_data_schedules(self._config)  # legacy curriculum, progressive layer drop
        # who drives the running backward and whether its round is open (runtime/backward_phase.py)
        self.backward_state = EngineBackward(self.precision, self.report, lambda: self.reducer,
                                             self.gradient_accumulation_steps)
        self._configure_distributed_model(model)
        self.param_names = {param: name for name, param in model.named_parameters()}
        self._params = list(model.parameters())  # walked every step: keep the list, not the module tree
        from deepspeed_c.compression.engine_hooks import configure as configure_compression

        # compression_training / quantize_training (MoQ)
        self.compression_hooks = configure_compression(self.module, self._config.user_dict)
        self.compression_scheduler = self.compression_hooks.scheduler if self.compression_hooks else None
        self.quantizer = self.compression_hooks.quantizer if self.compression_hooks else None
        if self.torch_autocast_enabled():
            from deepspeed_c.runtime.torch_autocast import init_autocast_params

            init_autocast_params(self.module, self.torch_autocast_dtype(),
                                 self._config.torch_autocast_lower_precision_safe_modules)

        if training_data is not None:
            self.training_dataloader = self.deepspeed_io(training_data)
        if model_parameters is None:
            model_parameters = self.module.parameters()
        if not isinstance(model_parameters, list):
            model_parameters = list(model_parameters)
        if optimizer is not None or self._config.optimizer_name is not None:
            self._configure_optimizer(optimizer, model_parameters)
            self.lr_scheduler = build_lr_scheduler(self.client_lr_scheduler, self._config, self.optimizer,
                                                   self.basic_optimizer)
            self._report_progress(0)
        self._configure_zero()
        self._configure_reducer()
        from deepspeed_c.runtime.sparse_names import SparseTensorNames

        self.sparse_names = SparseTensorNames(self.module, self.sparse_gradients_enabled())
        # OptimizedLinear base weights: LoRAConfig.offload_ratio parks them on the CPU (DeepSpeed's attributes); a
        # model can hold one only once deepspeed_c.linear is imported, so other models do not import it
        self.optimized_linear_lora_enabled = self.optimized_linear_base_weight_sharding = False
        if "deepspeed_c.linear" in sys.modules:
            from deepspeed_c.linear.placement import place_base_weights

            self.optimized_linear_lora_enabled, self.optimized_linear_base_weight_sharding = \
                place_base_weights(self.module)
        from deepspeed_c.runtime.engine.profile_setup import build_flops_profile

        self.flops_profile = build_flops_profile(self, self._config)
        self.flops_profiler = self.flops_profile.profiler  # DeepSpeed's attribute (None when disabled)
        log_dist(f"DeepSpeed info: version={_version()}, deepspeed_c engine ready, world_size={self.world_size}, "
                 f"device={self.device}", ranks=[0])

    # -- setup -----------------------------------------------------------------------------------
    def _configure_with_arguments(self, args: Any) -> None:
        env_local = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"))
        self.local_rank = int(env_local) if env_local is not None else 0
        arg_local = getattr(args, "local_rank", None) if args is not None else None
        if isinstance(arg_local, int) and arg_local >= 0 and env_local is not None and arg_local != self.local_rank:
            raise AssertionError(f"Mismatch in local rank setting, args.local_rank={arg_local} but "
                                 f"env['LOCAL_RANK']={self.local_rank}.")
        if args is not None and hasattr(args, "local_rank"):
            args.local_rank = self.local_rank

    def _set_distributed_vars(self) -> None:
        import torch.distributed as tdist

        self.device = _select_device(self.local_rank)
        if tdist.is_available() and tdist.is_initialized():
            self.world_size = tdist.get_world_size()
            self.global_rank = tdist.get_rank()
        else:
            self.world_size, self.global_rank = 1, 0
        # the mpu is probed once, here; collaborators read the one topology object (runtime/parallel_dims.py)
        self.parallel_dims = ParallelDims.from_mpu(self.mpu, self.world_size, self._config.world_size,
                                                   self.global_rank)
        self.sequence_parallel_size = self.parallel_dims.sequence
        self.dp_world_size = self.parallel_dims.data
        self.data_parallel_group = self.parallel_dims.data_group

    def _configure_distributed_model(self, model: Module) -> None:
        if not isinstance(model, Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        placed = place_model(model, self.precision, self.device, move_to_device=not self.dont_change_device,
                             parallel_dims=self.parallel_dims, mpu=self.mpu, config=self._config)
        self.first_dataloader_check, self.moe = placed.first_dataloader_check, placed.moe
        self.has_moe_layers, self.num_experts = self.moe.has_moe_layers, self.moe.num_experts
        if self.dp_world_size > 1:
            broadcast_replicas(model, self.moe, self.data_parallel_group)

    def _configure_optimizer(self, client_optimizer: Any, model_parameters: list) -> None:
        check_grad_accum_mix(self._config, pipeline=_is_pipeline_module(self.module))
        cpu_optimizer = bool(self.zero_use_cpu_optimizer())  # cpu or nvme offload: the host steps
        self.basic_optimizer = build_basic_optimizer(
            client_optimizer, self._config, model_parameters, torch.device("cpu") if cpu_optimizer else self.device,
            cpu_optimizer=cpu_optimizer, deepspeed=self)  # the 1-bit optimizers switch its gradient all-reduce
        self.optimizer = self.precision.wrap_optimizer(
            self.basic_optimizer, self.device, sync_overflow=self._any_rank_overflowed
            if self.dp_world_size > 1 or self.parallel_dims.tensor_parallel else None,
            dp_world_size=self.dp_world_size, zero_owns_masters=self.zero_optimization_stage() > 0,
            norm_across_ranks=self._tensor_parallel_norm()  # TP: the whole model's
            or self.moe.norm_across_ranks(self.data_parallel_group, self.dp_world_size, self.device))
        log_dist(f"DeepSpeed Final Optimizer = {self.optimizer.__class__.__name__}", ranks=[0])

    def _configure_zero(self) -> None:
        # Stage 0 is plain data parallel; stages 1 and 2 replace the optimizer by the partitioned one
        # (which also brings its own gradient reducer). The config refuses unlisted stages.
        stage = self.zero_optimization_stage()
        if stage == 3 and self.optimizer is None:
            from deepspeed_c.runtime.engine.zero_setup import configure_zero3_params

            self.optimizer = configure_zero3_params(self, self._config)  # a partitioned model for evaluation only
            return
        if stage == 0 or self.optimizer is None:
            return
        from deepspeed_c.runtime.engine.zero_setup import configure_zero_optimizer

        self.optimizer = configure_zero_optimizer(self, self._config, self._should_reduce)
        log_dist(f"DeepSpeed ZeRO stage {stage} optimizer = {self.optimizer!r}", ranks=[0])

    def _configure_reducer(self) -> None:
        moe_norm = self.moe.norm_across_ranks(self.data_parallel_group, self.dp_world_size, self.device)
        if self.parallel_dims.tensor_parallel:  # shards' squares summed over the TP group, replicas once
            moe_norm = self._tensor_parallel_norm()
        self.stepper = engine_optimizer(self.optimizer, self._params, self.gradient_clipping(),
                                        self.precision.grad_scaler, moe_norm)
        owned = self.stepper.owned_reducer() if self.stepper is not None else None
        if owned is not None:
            self.reducer = owned
            return
        if self.dp_world_size > 1:
            self.reducer = build_reducer(
                self.module, self._config, self.moe, world_size=self.dp_world_size, group=self.data_parallel_group,
                gradient_average=self.gradient_average, sequence_parallel_size=self.sequence_parallel_size,
                bucket_cap=self.zero_reduce_bucket_size(), comm_dtype=self.communication_data_type,
                slots=self.stepper.reduction_slots() if self.stepper is not None else None,
                should_reduce=self._should_reduce)

    def _any_rank_overflowed(self, overflow: bool) -> bool:
        import torch.distributed as tdist

        flag = torch.tensor([1.0 if overflow else 0.0], device=self.device)
        # tensor parallel: every rank of the (data x tensor) world skips together
        group = None if self.parallel_dims.tensor_parallel else self.data_parallel_group
        _comm().all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def _tensor_parallel_norm(self) -> Any:
        """The whole model's gradient norm function under tensor parallelism (None without it)."""
        if not self.parallel_dims.tensor_parallel:
            return None
        from deepspeed_c.runtime.model_parallel.tp_norm import tensor_parallel_norm_fn

        return tensor_parallel_norm_fn(self.module, self.parallel_dims.tensor_group)

    def _should_reduce(self) -> bool:
        return (self.enable_backward_allreduce and not self.inside_no_sync_ctxt
                and self.is_gradient_accumulation_boundary())

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.backward_state.forward_started()  # a backward that raised never ran its epilogue
        if self.compression_hooks is not None:
            self.compression_hooks.before_forward(self.global_steps, self._params)
        if self.training_dataloader is None:
            self.tput_timer.start()
        self.report.start(rep.FORWARD_TIMERS)
        if self.fp16_auto_cast():
            inputs, kwargs = _cast_half(inputs), _cast_half(kwargs)
        kwargs = self._data_schedule_kwargs(kwargs, self.module.training)  # curriculum_seqlen, pld_theta
        with self.precision.autocast(self.device.type), self.flops_profile.forward(self.global_steps):
            outputs = self.module(*inputs, **kwargs)
        register_output_hooks(outputs, self._output_grad_hook)
        if self._direct_scaler is None and self.gradient_accumulation_steps() != 1 and torch.is_grad_enabled():
            from deepspeed_c.runtime.gas_scaling import DirectBackwardScaler

            self._direct_scaler = DirectBackwardScaler(
                self._params, self.gradient_accumulation_steps,
                active=lambda: not self.backward_state.engine_driven, reducer=self.reducer)
        self.report.stop(rep.FORWARD_TIMERS)
        return outputs

    # -- backward --------------------------------------------------------------------------------
    def _output_grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        """Backward reached the model's outputs: the outermost graph task of this backward (the
        recomputation of a reentrant checkpoint runs later, in nested tasks). Scaling is not done
        here; see engine.backward and runtime/gas_scaling.py. A user's `autograd.grad` or `backward(inputs=[x])`
        between steps also reaches the outputs: it accumulates into no parameter, so it is no training
        backward (runtime/autograd_paths.py)."""
        self.backward_state.outputs_reached(self._params)
        return grad

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss scaled for a manual `.backward()` (unchanged unless fp16 loss scaling is on)."""
        assert self.optimizer is not None, "must provide optimizer during init in order to use scale"
        assert is_loss_for_backward(loss), \
            "loss must be a scalar tensor with grad_fn. For non-scalar tensors, use tensor.backward(grad)"
        self.backward_state.user_scaled_loss()
        self.report.record_loss(loss.detach())
        return self.precision.scale_loss(loss)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        assert self.optimizer is not None, "must provide optimizer during init in order to use backward"
        assert is_loss_for_backward(loss), \
            "loss must be a scalar tensor. If you need to pass output gradients, backward() of output tensors"
        return self.backward_state.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_gradient_accumulation_boundary is None:
            return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0
        return self._is_gradient_accumulation_boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_gradient_accumulation_boundary = is_boundary
        if self.optimizer is not None:
            self.optimizer.is_gradient_accumulation_boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside skips gradient reduction; step() inside is illegal."""
        assert not self.zero_optimization_partition_gradients(), \
            f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage " \
            f"{self.zero_optimization_stage()}"
        assert not self.inside_no_sync_ctxt, "no_sync context manager reentry is unsupported"
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        stage = self.zero_optimization_stage()
        if stage not in (1, 2, 3):
            raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}")
        yield  # pragma: no cover - reached once a ZeRO stage is plugged in

    # -- step ------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Clears param.grad only, as DeepSpeed's: gradients ZeRO already reduced into its partitions
        during an accumulation window stay there until the step."""
        for p in self._params:
            p.grad = None

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        assert not self.inside_no_sync_ctxt, "It is illegal to call Engine.step() inside no_sync context manager"
        assert self.optimizer is not None, "must provide optimizer during init in order to use step"
        self.report.start(rep.STEP_TIMERS)
        self._step_applied = False
        profiled = self.flops_profile.active(self.global_steps)  # before the step advances global_steps
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.gas_boundary_ctr += 1
            self.data_schedules.at_boundary(self.global_steps)  # PLD theta, before the step counts
            if self.compression_hooks is not None:  # MoQ's eigenvalues, from gradients that still carry their graph
                self.compression_hooks.before_step(self.gas_boundary_ctr, self.precision.loss_scale()
                                                   if self.precision.needs_scaler else 1.0)
            self._take_model_step(lr_kwargs)
        self.report.stop(rep.STEP_TIMERS)
        self.flops_profile.after_step(profiled, boundary, self.global_steps)  # reads the timers before their reset
        lr = self.get_lr()
        self.report.after_step(boundary=boundary, global_steps=self.global_steps, global_samples=self.global_samples,
                               skipped_steps=self.skipped_steps, lr=lr, mom=self.get_mom(),
                               loss_scale=self.precision.loss_scale() if self.precision.needs_scaler else None,
                               train_batch_size=self.train_batch_size())
        self.train_state.micro_steps += 1

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        assert self.stepper is not None
        self.stepper.before_step(self._params)
        overflow = bool(self.stepper.step())
        self._global_grad_norm = self.stepper.global_grad_norm
        if self.compression_hooks is not None:  # MoQ requantizes; the compression schedule advances
            self.compression_hooks.after_step(overflow, self.global_steps, self._params)
        self.stepper.zero_grad()
        if hasattr(self.reducer, "grads_released"):  # the buckets its gradients viewed may be reused
            self.reducer.grads_released()
        self._step_applied = not overflow
        if overflow:
            self.train_state.skipped_steps += 1
        elif self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            except TypeError:
                self.lr_scheduler.step(self.train_batch_size())
        self.train_state.record_step(self.train_batch_size())

    def _clip_gradients(self) -> None:
        grads = [p.grad for p in self._params if p.grad is not None]
        norm = float(global_norm(grads))
        self._global_grad_norm = norm
        scale_(grads, clip_coefficient(norm, self.gradient_clipping()))

    def clip_fp32_gradients(self) -> None:
        self._clip_gradients()

    # -- state the user reads --------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> Optional[float]:
        norm = self._global_grad_norm  # a device scalar after a fused step: read only when asked for
        return float(norm) if isinstance(norm, torch.Tensor) else norm

    def _get_optimizer_param(self, name: str) -> list:
        if self.optimizer is None:
            return []
        return [group.get(name, 0.0) for group in self.optimizer.param_groups]

    def get_lr(self) -> list:
        return self._get_optimizer_param("lr")

    def get_type(self) -> list:
        return self._get_optimizer_param("type")

    def get_mom(self) -> list:
        if self.optimizer_name() in ("SGD", "RMSprop"):
            return self._get_optimizer_param("momentum")
        return self._get_optimizer_param("betas")

    def get_wall_clock_timers(self) -> dict:
        return self.report.timer_cache

    def _report_progress(self, step: int) -> None:
        log_dist(f"step={step}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}", ranks=[0])

    def set_train_batch_size(self, train_batch_size: int) -> None:
        per = self.train_micro_batch_size_per_gpu() * self._config.world_size  # data-parallel ranks
        if train_batch_size % per != 0:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism")
        self._config.set_batch_sizes(train_batch_size, gradient_accumulation_steps=train_batch_size // per)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        self._config.set_batch_sizes(micro_batch_size * self.gradient_accumulation_steps() * self._config.world_size,
                                     train_micro_batch_size_per_gpu=micro_batch_size)

    def get_data_parallel_rank(self) -> int:
        if self.mpu is not None:
            return self.mpu.get_data_parallel_rank()
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        return self.mpu.get_model_parallel_rank() if self.mpu is not None else 0

    get_tensor_parallel_rank = get_model_parallel_rank

    # -- module plumbing -------------------------------------------------------------------------
    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the wrapped module in place (DeepSpeed's signature). With compile.deepcompile at ZeRO-3
        the gathers, releases and gradient reduce-scatters become graph operations (runtime/compiler.py)."""
        if self._is_compiled:
            return
        from deepspeed_c.runtime.compiler import compile_engine_module

        self._compiled_module = compile_engine_module(
            self.module, self._config.compile_config, backend=backend, compile_kwargs=compile_kwargs,
            schedule=schedule, compiled_autograd_enabled=compiled_autograd_enabled,
            zero_stage=self.zero_optimization_stage(), optimizer=self.optimizer, group=self.data_parallel_group,
            default_backend=get_accelerator().get_compile_backend())
        self._is_compiled = True

    def is_deepcompile_active(self) -> bool:
        compiled = getattr(self, "_compiled_module", None)
        return bool(compiled is not None and compiled.deepcompile_active)

    def get_compile_time(self) -> dict:
        """Seconds spent in each DeepCompile pass (DeepSpeed's engine.get_compile_time)."""
        from deepspeed_c.compile.backend import opt_pass_times

        return opt_pass_times

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def empty_partition_cache(self) -> None:
        """Releases every gathered ZeRO-3 parameter (persistent ones too) and frees the allocator's cache."""
        import gc

        if self.stepper is not None:
            self.stepper.release_gathered_params()
        gc.collect()
        get_accelerator().empty_cache()

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.warn_unscaled_loss = True
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        if getattr(self, "checkpointer", None) is not None and hasattr(self.checkpointer, "commit_pending"):
            self.checkpointer.commit_pending()  # a background checkpoint write is finished and committed
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self._direct_scaler is not None:
            self._direct_scaler.remove()
            self._direct_scaler = None
        if self.stepper is not None:
            self.stepper.destroy()
        compiled = self.__dict__.get("_compiled_module")
        if compiled is not None:  # DeepCompile's graph context (the compiled graphs name it)
            compiled.remove()

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine does not define come from the wrapped model."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and name != "module":
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


def _cast_half(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_half(v) for v in value)
    if isinstance(value, dict):
        return {k: _cast_half(v) for k, v in value.items()}
    return value


def _version() -> str:
    from deepspeed_c.version import __version__

    return __version__


# the class's public home, as DeepSpeed's (`deepspeed.runtime.engine.DeepSpeedEngine`): what clients see in
# type(engine).__module__ and reprs, and where pickle finds it
DeepSpeedEngine.__module__ = "deepspeed_c.runtime.engine"

"""The engine's optimizer stack at setup (DeepSpeedEngine._configure_optimizer / _configure_reducer call these):
the basic optimizer (DeepSpeed's three forms: a client Optimizer, a client callable, or the config's `optimizer`
section), the LR scheduler (the client's, or the config's `scheduler` section) and the data-parallel gradient
reducers the engine holds when its optimizer does not bring its own. They take what they use, never the engine
(the 1-bit optimizers alone get it, as DeepSpeed's `deepspeed` argument)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.nn import Module

from deepspeed_c.runtime.optimizer_factory import build_optimizer
from deepspeed_c.utils.logging import log_dist


def build_basic_optimizer(client_optimizer: Any, config: Any, model_parameters: list, device: torch.device,
                          cpu_optimizer: bool, deepspeed: Any) -> torch.optim.Optimizer:
    """config: the engine's DeepSpeedConfig; device: where a configured optimizer keeps its state (the host
    under ZeRO-Offload, cpu_optimizer); deepspeed: the engine, which the 1-bit optimizers hold."""
    if client_optimizer is None:
        basic = build_optimizer(config.optimizer_name, config.optimizer_params, model_parameters, device,
                                cpu_optimizer=cpu_optimizer, deepspeed=deepspeed)
        log_dist(f"Using DeepSpeed Optimizer param name {config.optimizer_name} as basic optimizer", ranks=[0])
    elif isinstance(client_optimizer, torch.optim.Optimizer):
        basic = client_optimizer
        log_dist("Using client Optimizer as basic optimizer", ranks=[0])
    elif callable(client_optimizer):
        basic = client_optimizer(model_parameters)
        log_dist("Using client callable to create basic optimizer", ranks=[0])
    else:
        raise ClientOptimizerTypeError(f"Client Optimizer is of unexpected type {type(client_optimizer)}")
    basic.param_groups[:] = [g for g in basic.param_groups if len(g["params"]) != 0]
    seen: dict[int, int] = {}
    for index, group in enumerate(basic.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise DuplicateParameterError(
                    f"The optimizer has a parameter in more than one param group: a tensor of shape "
                    f"{tuple(p.shape)} is in param_groups[{seen[id(p)]}] and param_groups[{index}]")
            seen[id(p)] = index
    return basic


class ClientOptimizerTypeError(TypeError, AssertionError):
    """An `optimizer=` that is neither a torch optimizer nor a callable (DeepSpeed's check is an assert)."""


class DuplicateParameterError(ValueError, AssertionError):
    """A parameter listed in two param groups. DeepSpeed raises AssertionError here; ValueError is what the
    argument error is."""


def build_lr_scheduler(client_lr_scheduler: Any, config: Any, optimizer: Any,
                       basic_optimizer: Optional[torch.optim.Optimizer]) -> Any:
    """The client's scheduler (or what its callable makes of the basic optimizer), else the config's `scheduler`
    section's, else None. deepspeed_c.runtime.lr_schedules' schedulers drive the (wrapped) optimizer, torch's the
    basic one."""
    if client_lr_scheduler is not None:
        if callable(client_lr_scheduler) and not hasattr(client_lr_scheduler, "step"):
            return client_lr_scheduler(basic_optimizer)
        return client_lr_scheduler
    name = config.scheduler_name
    if name is None:
        return None
    from deepspeed_c.runtime import lr_schedules

    cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name)
    target = optimizer if hasattr(lr_schedules, name) else basic_optimizer
    try:
        scheduler = cls(target, **(config.scheduler_params or {}))
    except TypeError as e:
        from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

        raise DeepSpeedConfigError(f"Invalid 'scheduler.params' for {name}: {e}") from None
    log_dist(f"DeepSpeed using configured LR scheduler = {name}", ranks=[0])
    return scheduler


def build_reducer(module: Module, config: Any, moe: Any, *, world_size: int, group: Any, gradient_average: bool,
                  sequence_parallel_size: int, bucket_cap: int, comm_dtype: torch.dtype, slots: Any,
                  should_reduce: Callable[[], bool]) -> Any:
    """The data-parallel reducer of the module's trainable gradients: one GradientReducer per expert set (dense
    parameters over the data-parallel group, each expert set over its expert-data-parallel group) plus the
    sparse embedding reducer, as one ReducerSet when there is more than one. config: the engine's
    DeepSpeedConfig; moe: its ExpertParallelism; slots: where the stepper wants gradients (None: param.grad)."""
    from deepspeed_c.runtime.moe_reduction import ReducerSet
    from deepspeed_c.runtime.reducer import GradientReducer
    from deepspeed_c.runtime.sparse_grads import sparse_reducer

    trainable = [p for p in module.parameters() if p.requires_grad]
    sparse = sparse_reducer(module, config, world_size, group, gradient_average, sequence_parallel_size,
                            should_reduce)
    if sparse is not None:  # their rows go through the sparse reducer, not the dense buckets
        trainable = [p for p in trainable if all(p is not q for q in sparse.params)]

    def reducer_for(s: Any) -> GradientReducer:  # expert sets reduce over their expert-data-parallel group
        return GradientReducer(
            s.params, world_size=world_size, group=s.group, bucket_cap=bucket_cap,
            comm_dtype=comm_dtype if any(p.dtype != comm_dtype for p in s.params) else None,
            prescale_gradients=config.prescale_gradients, gradient_predivide_factor=config.gradient_predivide_factor,
            gradient_average=gradient_average, should_reduce=should_reduce, slots=slots,
            sequence_parallel_size=sequence_parallel_size)

    sets = moe.reduction_sets(trainable, group) if trainable else []
    reducers = [reducer_for(s) for s in sets] + ([sparse] if sparse is not None else [])
    return reducers[0] if len(reducers) == 1 else ReducerSet(reducers)

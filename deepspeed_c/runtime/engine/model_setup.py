"""The engine placing its model across ranks (DeepSpeedEngine._configure_distributed_model calls these): the
precision cast and the device, a client mpu's tensor-parallel marks, AutoTP's first-batch check, the mpu that
deepspeed_c.utils.groups answers from, AutoEP's expert-parallel blocks and the MoE expert groups, then the
broadcast that starts every data-parallel replica from the same values. They take what they use (the module,
the precision collaborator, the ParallelDims, the config), never the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

if TYPE_CHECKING:
    from deepspeed_c.runtime.moe_reduction import ExpertParallelism


@dataclass(frozen=True)
class PlacedModel:
    """What placing the model leaves the engine: DeepSpeed's `first_dataloader_check` (AutoTP's first-batch
    hook handle, or None) and the model's expert parallelism (its MoE layers and groups)."""
    first_dataloader_check: Any
    moe: ExpertParallelism


def place_model(model: Module, precision: Any, device: torch.device, *, move_to_device: bool, parallel_dims: Any,
                mpu: Any, config: Any) -> PlacedModel:
    """precision: the engine's Precision; parallel_dims: its ParallelDims; config: its DeepSpeedConfig."""
    precision.cast_module(model)
    if move_to_device:
        model.to(device)
    client_tp = parallel_dims.tensor_parallel and not parallel_dims.autotp
    if client_tp:
        from deepspeed_c.runtime.model_parallel.tp_norm import mark_tensor_parallel_params

        mark_tensor_parallel_params(model)  # the client's split parameters, as DeepSpeed's norm counts them
    from deepspeed_c.runtime.tensor_parallel.input_check import first_forward_check

    first_check = first_forward_check(model, parallel_dims, mpu)  # AutoTP: one batch
    from deepspeed_c.utils import groups

    # DeepSpeed's groups.mpu: deepspeed.utils.groups answers from a client's model-parallel mpu (this engine's
    # or none: a later engine in the process must not see an earlier one's)
    groups._set_client_mpu(mpu if client_tp else None)
    from deepspeed_c.moe.autoep import apply_autoep

    # AutoEP: matched Hugging Face MoE blocks get expert-parallel experts (before the groups below)
    apply_autoep(model, config.expert_parallel_config, parallel_dims.tensor_parallel,
                 config.use_data_before_expert_parallel_)
    import torch.distributed as tdist
    from deepspeed_c.runtime.moe_reduction import ExpertParallelism

    # MoE layers get their expert groups; expert parameters are replicated only over those
    moe = ExpertParallelism(model, config.use_data_before_expert_parallel_,
                            distributed=tdist.is_available() and tdist.is_initialized())
    if moe.has_moe_layers and parallel_dims.tensor_parallel:
        raise NotImplementedError("MoE layers with tensor parallelism (a model-parallel mpu or AutoTP) are not "
                                  "built: the expert groups would span the tensor-parallel ranks")
    return PlacedModel(first_check, moe)


def broadcast_replicas(model: Module, moe: ExpertParallelism, data_parallel_group: Any) -> None:
    """Every data-parallel replica starts from its group's first rank's values (expert parameters: over their
    expert-data-parallel group)."""
    import deepspeed_c.comm as dist
    from deepspeed_c.runtime.zero.partition_parameters import is_zero_param

    with torch.no_grad():
        for p in model.parameters():
            # zero.Init made every rank's shards from rank 0's values; an OptimizedLinear base weight
            # (ds_optim_param) is a different shard on each rank
            if not is_zero_param(p) and not hasattr(p, "ds_optim_param"):
                group = moe.broadcast_group(p, data_parallel_group)
                src = dist.get_global_rank(group, 0) if group is not None else 0
                dist.broadcast(p.data, src, group=group)

"""AutoTP training set-up, run by deepspeed.initialize before the engine is built.

Sources of the tensor-parallel size, merged as DeepSpeed does: the config's
`tensor_parallel.autotp_size` is canonical; `tp_model_init(model, tp_size, dtype)` (recorded, not
applied) fills it in when the config has none and must agree when it has one. The model is sharded
here (LinearLayer / LinearAllreduce), and the engine receives an mpu whose data-parallel group is the
ranks holding the same shard, so ZeRO 1/2, gradient reduction, broadcasts and batch sizes all run
over data parallel only: world = data x tensor, tensor-parallel ranks consecutive.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed_c.utils.logging import log_dist

_RECORDED: dict[str, Any] = {}


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """Records the tensor-parallel size (and dtype, optional `tp_group`) for deepspeed.initialize, which
    shards the model; returns the model unchanged, as DeepSpeed >= 0.18 does."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be an int >= 1, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword argument(s) {sorted(unknown)}; accepted: tp_group")
    if kwargs.get("tp_group") is not None:
        raise NotImplementedError("tp_model_init(tp_group=...): a caller-built tensor-parallel group is not "
                                  "supported; deepspeed_c builds the (data, tensor) groups itself from tp_size")
    _RECORDED.clear()
    _RECORDED.update(tp_size=tp_size, dtype=dtype)
    from deepspeed_c.runtime.tensor_parallel.mode import set_autotp_mode

    set_autotp_mode(training=True)  # as DeepSpeed's tp_model_init
    return model


class TensorParallelMPU:
    """The model-parallel unit the engine reads: data-parallel group = ranks holding the same shard."""

    autotp = True

    def __init__(self, tp_size: int) -> None:
        from deepspeed_c.utils import groups

        self._groups = groups
        groups._init_tp_mesh_device(tp_size)

    def get_data_parallel_group(self) -> Any:
        return self._groups.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self._groups.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self._groups.get_data_parallel_rank()

    def get_model_parallel_group(self) -> Any:
        return self._groups.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return self._groups.get_model_parallel_world_size()

    def get_model_parallel_rank(self) -> int:
        return self._groups.get_model_parallel_rank()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._groups.get_tensor_model_parallel_src_rank()

    def grad_norm_fn(self, module: torch.nn.Module) -> Callable[[Any], Any]:
        """The global L2 gradient norm of the whole (unsharded) model, for clipping: a sharded parameter's
        squares are summed over the TP group, a replicated one (equal on every TP rank) counted once.
        Replaces the rank-local norm it is handed; the gradients are already data-parallel reduced."""
        from deepspeed_c.runtime.model_parallel.tp_norm import tensor_parallel_norm_fn

        return tensor_parallel_norm_fn(module, self.get_model_parallel_group())


def _requested_size(config: dict) -> tuple[int, Optional[dict]]:
    section = config.get("tensor_parallel") or {}
    if not isinstance(section, dict):
        raise ValueError(f"config key 'tensor_parallel' must be an object, got {type(section).__name__}")
    size = section.get("autotp_size", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"tensor_parallel.autotp_size must be an int >= 0, got {size!r}")
    recorded = _RECORDED.get("tp_size")
    if recorded is not None and size and recorded != size:
        raise ValueError(f"tensor_parallel.autotp_size={size} in the config conflicts with tp_model_init(tp_size="
                         f"{recorded}); give one size")
    from deepspeed_c.runtime.tensor_parallel.presets import resolve

    return (size or recorded or 0), resolve(section.get("preset_model"), section.get("partition_config"))


def _refuse_unsupported(config: dict, size: int) -> None:
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    # ZeRO-3 partitions each rank's TP shards over the data-parallel group (the mpu's), nothing else to refuse
    fp16 = config.get("fp16") or {}
    if isinstance(fp16, dict) and fp16.get("enabled") is True and stage == 0:
        # ZeRO 1/2 decide overflow from the norm summed over every rank (set_tensor_parallel_norm): all agree
        raise NotImplementedError(f"tensor_parallel.autotp_size={size} with fp16.enabled at zero_optimization.stage=0: "
                                  "the loss-scale overflow check would run over the data-parallel group only; use "
                                  "ZeRO stage 1 or 2, bf16 or fp32 with AutoTP")
    clip = config.get("gradient_clipping", 1.0)  # DeepSpeed >= 0.19.3 defaults to 1.0
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    low_precision = isinstance(bf16, dict) and bf16.get("enabled") is True
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if isinstance(clip, (int, float)) and clip > 0 and stage == 0 and low_precision and accum in ("fp32", "float32"):
        # the whole-model norm reads the parameters' bf16 gradients; fp32 accumulation keeps them elsewhere
        raise NotImplementedError(f"tensor_parallel.autotp_size={size} with gradient_clipping={clip}, bf16, "
                                  "data_types.grad_accum_dtype=fp32 and zero_optimization.stage=0 is not built; use "
                                  "bf16 accumulation (the default), ZeRO 1/2/3, or \"gradient_clipping\": 0")


def prepare_autotp(model: torch.nn.Module, config: dict, mpu: Any, pipeline: bool = False, optimizer: Any = None,
                   model_parameters: Any = None) -> tuple[Any, Any, Any]:
    """(model, mpu, model_parameters) for the engine: unchanged without tensor parallelism; else the model sharded
    over the tensor-parallel group, the (data, tensor) mpu, and the caller's optimizer (in place) and
    model_parameters made to hold the shards instead of the replaced weights. Every rank must call it."""
    size, partition_config = _requested_size(config)
    _RECORDED.clear()  # consumed: a second initialize in this process starts from its own config
    if size <= 1:
        return model, mpu, model_parameters
    if pipeline:
        raise NotImplementedError(f"tensor_parallel.autotp_size={size} with a PipelineModule is not supported yet")
    if mpu is not None:
        raise NotImplementedError(f"tensor_parallel.autotp_size={size} with initialize(mpu=...): AutoTP builds its "
                                  "own (data, tensor) groups; pass no mpu")
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size != 0:
        raise ValueError(f"tensor_parallel.autotp_size={size} does not divide the world size ({world})")
    _refuse_unsupported(config, size)
    tp_mpu = TensorParallelMPU(size)
    from deepspeed_c.module_inject.auto_tp import apply_autotp

    from deepspeed_c.module_inject.auto_tp import plan
    from deepspeed_c.runtime.tensor_parallel import param_remap

    # a model built under zero.Init holds ZeRO-3 partitions: AutoTP reads the whole weights (its shards are copies;
    # the weights it keeps, such as a row-parallel bias, stay ZeRO-managed and are partitioned again after)
    with _whole_zero3_weights(model):
        layers = plan(model, partition_config)
        # refused before the model is touched: state held for a weight about to be replaced cannot follow it
        param_remap.refuse_held_state(optimizer, {id(p) for name, _, _ in layers
                                                  for p in model.get_submodule(name).parameters()})
        _broadcast_within_tp(model, tp_mpu)
        before = param_remap.named(model)
        apply_autotp(model, tp_mpu.get_model_parallel_group(), partition_config, layers=layers)
    replaced = param_remap.replacements(before, model)
    param_remap.remap_optimizer(optimizer, replaced)
    model_parameters = param_remap.remap_parameters(model_parameters, replaced)
    log_dist(f"AutoTP: tensor parallel size {size}, data parallel size {world // size}", ranks=[0])
    return model, tp_mpu, model_parameters


def _whole_zero3_weights(model: torch.nn.Module) -> Any:
    """GatheredParameters over the model's ZeRO-3-managed parameters (none: a no-op context)."""
    import contextlib

    managed = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not managed:
        return contextlib.nullcontext()
    from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(managed, modifier_rank=None)


@torch.no_grad()
def _broadcast_within_tp(model: torch.nn.Module, mpu: TensorParallelMPU) -> None:
    """Every rank of a TP group shards the same full weights: the group's first rank's."""
    import deepspeed_c.comm as dist

    src = mpu.get_tensor_model_parallel_src_rank()
    group = mpu.get_model_parallel_group()
    device = None
    if dist.get_backend(group) == "nccl":  # NCCL carries device tensors only; the model may still be on the host
        from deepspeed_c.accelerator import get_accelerator

        device = torch.device(get_accelerator().current_device_name())
    for t in list(model.parameters()) + list(model.buffers()):
        buf = t.data if device is None or t.device == device else t.data.to(device)
        dist.broadcast(buf, src, group=group)
        if buf is not t.data:
            t.data.copy_(buf)

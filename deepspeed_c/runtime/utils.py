"""deepspeed.runtime.utils helpers that training scripts import directly: `see_memory_usage`,
`move_to_device`, `clip_grad_norm_` (with a model-parallel `mpu`) and `get_global_norm`."""
from __future__ import annotations

import gc
import math
from typing import Any, Iterable, Union

import torch

from deepspeed_c.runtime.grad_norm import clip_coefficient, global_norm, scale_
from deepspeed_c.utils.logging import logger

_GIB = float(1 << 30)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Logs `message` and the accelerator's allocated / peak / reserved memory and the host's used
    memory, on rank 0 only and only with force=True (DeepSpeed's behaviour); then resets the peaks."""
    if not force:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    import psutil

    from deepspeed_c.accelerator import get_accelerator

    acc = get_accelerator()
    gc.collect()
    logger.info(message)
    logger.info(f"MA {acc.memory_allocated() / _GIB:.2f} GB         Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB "
                f"        CA {acc.memory_reserved() / _GIB:.2f} GB         Max_CA {acc.max_memory_reserved() / _GIB:.0f} GB ")
    vm = psutil.virtual_memory()
    logger.info(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / _GIB:.2f} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


def move_to_device(item: Any, device: Union[str, torch.device]) -> Any:
    """`item` with every tensor inside it (lists, tuples, dicts, nested) moved to `device`."""
    if torch.is_tensor(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: move_to_device(v, device) for k, v in item.items()})
    return item


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The L2 norm of several L2 norms (e.g. one per parameter group)."""
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2, mpu: Any = None) -> float:
    """Clips the gradients of `parameters` in place so their global norm is at most max_norm, and
    returns the norm before clipping (a 0-dim float32 tensor), averaged over the data-parallel ranks. With an `mpu`, the norm covers every model-parallel rank's
    shard (one all-reduce over the model-parallel group), by DeepSpeed's rule: a parameter split over
    the model-parallel ranks (is_model_parallel_parameter) counts on every rank, any other (replicated)
    only on model-parallel rank 0."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad.detach() for p in parameters]
    counted = grads
    if mpu is not None and float(norm_type) != math.inf and mpu.get_model_parallel_rank() != 0:
        counted = [p.grad.detach() for p in parameters if is_model_parallel_parameter(p)]
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, got {norm_type}")
    dev = grads[0].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=dev)
    else:
        local = global_norm(counted).float().to(dev) ** 2 if counted else torch.zeros((), device=dev)
    local = local.reshape(1)
    if mpu is not None:
        import torch.distributed as dist

        from deepspeed_c.comm import collective_device

        group = mpu.get_model_parallel_group()
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        local = local.to(collective_device(group))
        dist.all_reduce(local, op=op, group=group)
    total = float(local.item()) if norm_type == math.inf else math.sqrt(float(local.item()))
    total = _mean_over_data_parallel(total)
    coef = clip_coefficient(total, float(max_norm)) if math.isfinite(total) else 1.0
    if coef < 1.0 and grads:
        scale_(grads, coef)
    return torch.tensor(total, dtype=torch.float32, device=dev)  # DeepSpeed returns the norm as a tensor


def _mean_over_data_parallel(norm: float) -> float:
    """DeepSpeed averages the norm over the data-parallel group (MoE parameters differ across ranks), so every
    rank clips by the same coefficient."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return norm
    from deepspeed_c.comm import collective_device
    from deepspeed_c.utils import groups

    group = groups.get_data_parallel_group()
    world = dist.get_world_size(group=group)
    if world <= 1:
        return norm
    t = torch.tensor([norm / world], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, group=group)
    return float(t.item())


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch's generators from one integer."""
    import random

    import numpy

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"set_random_seed: seed must be an int, got {type(seed).__name__}")
    random.seed(seed)
    # each generator takes a narrower integer than Python's (test runners hand out huge seeds): wrap, don't fail
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def noop_decorator(func: Any) -> Any:
    return func


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


from deepspeed_c.runtime.partitioned_tensor import PartitionedTensor  # noqa: E402  (DeepSpeed's home for it)

__all__ = ["PartitionedTensor", "see_memory_usage", "move_to_device", "get_global_norm", "clip_grad_norm_",
           "noop_decorator", "is_model_parallel_parameter", "set_random_seed", "prefix_sum_inc", "partition_uniform",
           "partition_balanced"]


def prefix_sum_inc(weights: Iterable[float]) -> list:
    """Inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    out: list = []
    for w in weights:
        out.append(w if not out else out[-1] + w)
    return out


def __getattr__(name: str) -> Any:
    # DeepSpeed's layer-partition helpers live with the pipeline's partitioner (runtime/pipe/partition.py);
    # resolved on first use so this module does not load the pipeline package
    if name in ("partition_uniform", "partition_balanced"):
        from deepspeed_c.runtime.pipe import partition

        value = getattr(partition, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

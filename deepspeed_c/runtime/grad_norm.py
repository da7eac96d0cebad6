"""Global gradient norm and clipping over a list of tensors.

The norm runs on the C multi-tensor cores when they are built (deepspeed_c.ops.cpu_multi_tensor
on CPU, deepspeed_c.ops.cuda_multi_tensor on GPU: one call per device group, not one per tensor)
and on torch's foreach kernels otherwise. Clipping follows torch.nn.utils.clip_grad_norm_:
coefficient max_norm / (norm + 1e-6), applied only when below 1."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

CLIP_EPS = 1e-6


@functools.lru_cache(maxsize=None)
def _c_norm_fn(device_type: str) -> Optional[Callable[[list[torch.Tensor]], Any]]:
    """The C L2-norm entry point for a device type, or None when that op is not available."""
    module_name = {"cpu": "deepspeed_c.ops.cpu_multi_tensor", "cuda": "deepspeed_c.ops.cuda_multi_tensor"}.get(
        device_type)
    if module_name is None:
        return None
    try:
        import importlib

        module = importlib.import_module(module_name)
    except ImportError:
        return None
    for name in ("multi_tensor_global_norm", "global_norm", "l2_norm"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _torch_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


def _group_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    fn = _c_norm_fn(tensors[0].device.type)
    if fn is not None and all(t.is_contiguous() for t in tensors):
        try:
            out = fn(tensors)
            return out if isinstance(out, torch.Tensor) else torch.tensor(float(out), device=tensors[0].device)
        except (TypeError, ValueError, RuntimeError):
            pass  # an input the C op does not take (dtype, layout): torch handles it
    return _torch_norm(tensors)


def global_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all tensors together, as a float32 0-dim tensor on the first tensor's device."""
    # a sparse gradient (sparse_gradients' embedding rows) counts as its dense form: its coalesced values
    tensors = [t.detach().coalesce().values() if t.is_sparse else t for t in tensors if t is not None]
    if not tensors:
        return torch.tensor(0.0)
    device = tensors[0].device
    if norm_type == float("inf"):
        return torch.stack([t.detach().abs().max().float().to(device) for t in tensors]).max()
    if norm_type != 2.0:
        norms = [torch.linalg.vector_norm(t.detach().float(), norm_type).to(device) for t in tensors]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    parts = [_group_norm(group).float().to(device) for group in groups.values()]
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """max_norm / (norm + 1e-6) when that is below 1, else 1 (no clipping)."""
    coef = max_norm / (total_norm + CLIP_EPS)
    return coef if coef < 1.0 else 1.0


def scale_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    if factor != 1.0 and tensors:
        dense = [t for t in tensors if not t.is_sparse]
        if dense:
            torch._foreach_mul_(dense, factor)
        for t in tensors:
            if t.is_sparse:  # torch's foreach kernels take strided tensors only
                t.mul_(factor)

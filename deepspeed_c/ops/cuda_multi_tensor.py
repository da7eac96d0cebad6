"""Python front end of the engine's CUDA multi-tensor kernels (op `multi_tensor_ops`): the
gradient bookkeeping of a mixed-precision step as one launch per dtype group over whole
tensor lists, on torch's current stream, never synchronising the host.

- `multi_tensor_l2norm`: global (and per-tensor) L2 norm plus an inf/nan flag, one read;
- `multi_tensor_scale_`, `non_finite_check_and_unscale_`: dst = src * scale, with the flag;
- `multi_tensor_copy_`: casting copy between lists (fp32 <-> fp16/bf16);
- `flatten`, `unflatten`, `unflatten_copy_`: lists <-> one contiguous buffer;
- `fused_adam_epilogue_`: unscale, clip, skip on inf/nan, AdamW and the fp16/bf16 write-back in
  one pass, with the skip decision and the step count on the device.

Outputs and workspaces are allocated here with torch (its caching allocator), never in C."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_op = None


def _ops() -> Any:
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import MultiTensorOpsBuilder

        _op = MultiTensorOpsBuilder().load()
    return _op


def _device_of(tensors: Sequence[torch.Tensor], device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if len(tensors) == 0:
        raise ValueError("an empty tensor list needs an explicit device=")
    return tensors[0].device


def multi_tensor_l2norm(tensors: Sequence[torch.Tensor], per_tensor: bool = False,
                        device: torch.device | str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(norm, per_tensor_norms, found_inf): float32 device tensors of shape [1], [n] (or None)
    and [1]; found_inf is 1.0 when any element is inf or nan (the norm is then inf or nan too)."""
    tensors = list(tensors)
    n = len(tensors)
    dev = _device_of(tensors, device)
    out = torch.empty(n + 2 if per_tensor else 2, dtype=torch.float32, device=dev)
    scratch = torch.empty(n + 2, dtype=torch.float64, device=dev)
    per = out[2:] if per_tensor else None
    _ops().l2norm(tensors, scratch, out[0:1], per, out[1:2])
    return out[0:1], per, out[1:2]


def multi_tensor_global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of every element of every tensor, a float32 device tensor of shape []."""
    return multi_tensor_l2norm(tensors)[0][0]


def multi_tensor_scale_(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], scale: float,
                        found_inf: torch.Tensor | None = None) -> None:
    """dst[i] = src[i] * scale (dtype conversion allowed; dst may be src). found_inf (float32
    device [1]) is set to 1.0 when src holds an inf/nan, and never cleared."""
    _ops().scale(list(src), list(dst), float(scale), None, found_inf)


def non_finite_check_and_unscale_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor,
                                  inv_scale: torch.Tensor) -> None:
    """torch._amp_foreach_non_finite_check_and_unscale_ for a list: tensors *= inv_scale (a
    device float32 [1]), found_inf set to 1.0 on any inf/nan."""
    tensors = list(tensors)
    _ops().scale(tensors, tensors, 1.0, inv_scale, found_inf)


def multi_tensor_copy_(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for the whole list in one launch per dtype pair."""
    _ops().copy(list(src), list(dst))


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
    """The tensors back to back in one new contiguous 1-D tensor (cast to dtype if given)."""
    tensors = list(tensors)
    dev = _device_of(tensors, device)
    dtype = dtype or (tensors[0].dtype if tensors else torch.float32)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=dev)
    _ops().flatten(tensors, flat)
    return flat


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of flat shaped like the tensors (torch._utils._unflatten_dense_tensors): no copy."""
    out, offset = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat.narrow(0, offset, n).view_as(t))
        offset += n
    return out


def unflatten_copy_(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copies consecutive slices of flat into the tensors (with dtype conversion)."""
    _ops().unflatten(flat, list(tensors))


def fused_adam_epilogue_(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                         exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                         step: torch.Tensor, grad_norm: torch.Tensor, found_inf: torch.Tensor | None = None,
                         model_params: Sequence[torch.Tensor] | None = None, lr: float,
                         betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                         weight_decay: float = 0.0, adam_w_mode: bool = True, bias_correction: bool = True,
                         loss_scale: float = 1.0, max_grad_norm: float = 0.0) -> None:
    """The optimizer step of a mixed-precision engine in one pass over the parameters:
    grads / loss_scale, clipped to max_grad_norm (DeepSpeed's rule, from grad_norm, the norm of
    the scaled grads, e.g. multi_tensor_l2norm's), AdamW on the float32 params (masters) and
    moments, and the write-back into model_params (fp16/bf16 copies) if given. When grad_norm
    is inf/nan or found_inf is non-zero nothing is written and the step is skipped. step is a
    float32 device [1] holding the steps taken; it is incremented on the device when one is."""
    _ops().adam_epilogue(list(grads), list(params), list(exp_avgs), list(exp_avg_sqs),
                         None if model_params is None else list(model_params), grad_norm, found_inf, step,
                         float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay),
                         bool(adam_w_mode), bool(bias_correction), float(loss_scale), float(max_grad_norm))


def tensors_per_launch(depth: int) -> int:
    """How many tensors one launch takes with `depth` parallel lists (more split into launches)."""
    return int(_ops().tensors_per_launch(depth))


def chunk_elems() -> int:
    """Elements one thread block processes."""
    return int(_ops().chunk_elems())

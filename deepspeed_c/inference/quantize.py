"""dtype=torch.int8: weight-only int8 for init_inference.

The Linear weights of the transformer blocks (nn.Linear, GPT-2's Conv1D, AutoTP's LinearLayer /
LinearAllreduce) are stored as int8 with one fp32 scale per output channel (symmetric: scale = absmax / 127,
q = round(w / scale) clamped to [-127, 127]); everything else (embeddings, norms, the LM head, biases) and
the activations run in fp16, as DeepSpeed's int8 inference does. The weight is dequantized to the
activation dtype when the layer reads it (a torch parametrization, so each layer's own forward is
unchanged), so memory holds 1 byte a weight plus the scales.
A row-parallel layer holds a slice of each output channel: its absmax is reduced (MAX) over the
tensor-parallel group, so every rank uses the scale of the whole row and the sharded model computes with
the same quantized weights as the unsharded one."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from deepspeed_c import comm as dist
from deepspeed_c.module_inject.auto_tp import _is_conv1d
from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer

COMPUTE_DTYPE = torch.float16


class _Dequantize(nn.Module):
    """weight = int8 values x per-channel scale, in the activation dtype."""

    def __init__(self, scale: Tensor, channel_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.channel_dim = channel_dim
        self.dtype = dtype

    def _shape(self, ndim: int) -> list[int]:
        shape = [1] * ndim
        shape[self.channel_dim] = -1
        return shape

    def forward(self, q: Tensor) -> Tensor:
        return (q.to(torch.float32) * self.scale.view(self._shape(q.dim()))).to(self.dtype)


def channel_absmax(weight: Tensor, channel_dim: int) -> Tensor:
    dims = [d for d in range(weight.dim()) if d != channel_dim]
    return weight.detach().abs().amax(dim=dims).to(torch.float32)


def quantize(weight: Tensor, scale: Tensor, channel_dim: int) -> Tensor:
    shape = [1] * weight.dim()
    shape[channel_dim] = -1
    return torch.round(weight.detach().to(torch.float32) / scale.view(shape)).clamp_(-127, 127).to(torch.int8)


def _targets(model: nn.Module, keep: set[int]) -> list[tuple[nn.Module, int, Optional[Any]]]:
    """(module, output-channel dim of its stored weight, group whose ranks share its rows or None)."""
    out = []
    for module in model.modules():
        if id(module) in keep:
            continue
        if isinstance(module, LinearAllreduce):
            out.append((module, 0, module.mp_group if module.tp_world_size > 1 else None))
        elif isinstance(module, (LinearLayer, nn.Linear)):
            out.append((module, 0, None))
        elif _is_conv1d(module):
            out.append((module, 1, None))  # Conv1D stores [in, out]
    return out


@torch.no_grad()
def quantize_weights_int8(model: nn.Module) -> int:
    """Converts `model` to fp16 with int8 block weights (in place); returns the number of layers quantized."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    keep = {id(head)} if head is not None else set()
    done = []
    for module, channel_dim, group in _targets(model, keep):  # from the weights as loaded (fp32 or wider)
        weight = module.weight
        absmax = channel_absmax(weight, channel_dim)
        if group is not None:
            dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=group)
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        markers = dict(weight.__dict__)
        del module.weight
        module.weight = nn.Parameter(quantize(weight, scale, channel_dim), requires_grad=False)
        module.weight.__dict__.update(markers)
        done.append((module, scale, channel_dim))
    model.to(COMPUTE_DTYPE)  # the rest of the model; int8 weights keep their dtype
    for module, scale, channel_dim in done:  # scales stay fp32
        # unsafe: the parametrized weight's dtype (fp16) differs from the stored one (int8) by design
        parametrize.register_parametrization(module, "weight", _Dequantize(scale, channel_dim, COMPUTE_DTYPE),
                                             unsafe=True)
    return len(done)

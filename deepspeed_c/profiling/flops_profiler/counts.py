"""FLOP and MAC formulas, one per profiled operation, each taking the operation's own arguments
and returning `(flops, macs)` for one call.

The conventions are DeepSpeed's so that the two profilers agree number for number: a
multiply-accumulate is two flops; a matmul counts its MACs (bias adds of F.linear are not
counted, those of a convolution are); activations, pooling and softmax cost one flop per input
element; normalisations are estimated at 4 flops per element (5 with an affine transform, or
1 / 2 for batch norm in eval mode); embedding and dropout are free; elementwise add/mul count one
flop per element of the broadcast result; einsum counts what numpy's optimal contraction path
reports."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

Counts = tuple[int, int]


def _prod(dims: Sequence[int]) -> int:
    return int(math.prod(int(d) for d in dims))


def _per_dim(value: Any, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> Counts:
    macs = input.numel() * weight.shape[0]
    return 2 * macs, macs


def per_element(input: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    """Activations, pooling, softmax: one flop per input element, no MACs."""
    return input.numel(), 0


def free(*args: Any, **kwargs: Any) -> Counts:
    """Embedding lookups and dropout: no arithmetic counted."""
    return 0, 0


def conv(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
         dilation: Any = 1, groups: int = 1) -> Counts:
    spatial_in = list(input.shape[2:])
    kernel = list(weight.shape[2:])
    n = len(spatial_in)
    strides, dilations = _per_dim(stride, n), _per_dim(dilation, n)
    if padding == "valid":
        pads: tuple = (0,) * n
    elif padding == "same":
        pads = tuple(d * (k - 1) // 2 for d, k in zip(dilations, kernel))
    else:
        pads = _per_dim(padding, n)
    out_spatial = [(size + 2 * p - (d * (k - 1) + 1)) // s + 1
                   for size, p, d, k, s in zip(spatial_in, pads, dilations, kernel, strides)]
    out_channels = weight.shape[0]
    positions = input.shape[0] * _prod(out_spatial)
    # each output position of each output channel reads k-volume x (in_channels / groups) inputs
    macs = _prod(kernel) * input.shape[1] * (out_channels // groups) * positions
    bias_flops = out_channels * positions if bias is not None else 0
    return 2 * macs + bias_flops, macs


def conv_transpose(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
                   output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Counts:
    spatial_in = list(input.shape[2:])
    kernel = list(weight.shape[2:])
    n = len(spatial_in)
    strides, pads = _per_dim(stride, n), _per_dim(padding, n)
    dilations, out_pads = _per_dim(dilation, n), _per_dim(output_padding, n)
    out_spatial = [(size - 1) * s - 2 * p + d * (k - 1) + op + 1
                   for size, s, p, d, k, op in zip(spatial_in, strides, pads, dilations, kernel, out_pads)]
    per_group_out = weight.shape[1]  # transposed weights are [in, out / groups, *kernel]
    # every input position scatters into a kernel-volume window of each per-group output channel
    macs = _prod(kernel) * input.shape[1] * per_group_out * input.shape[0] * _prod(spatial_in)
    bias_flops = per_group_out * groups * input.shape[0] * _prod(out_spatial) if bias is not None else 0
    return 2 * macs + bias_flops, macs


def batch_norm(input: torch.Tensor, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
               training: bool = False, *args: Any, **kwargs: Any) -> Counts:
    affine = weight is not None
    if training:
        return input.numel() * (5 if affine else 4), 0
    return input.numel() * (2 if affine else 1), 0


def _norm_estimate(input: torch.Tensor, weight: Any) -> Counts:
    return input.numel() * (5 if weight is not None else 4), 0


def layer_norm(input: torch.Tensor, normalized_shape: Any, weight: Any = None, *args: Any, **kwargs: Any) -> Counts:
    return _norm_estimate(input, weight)


def group_norm(input: torch.Tensor, num_groups: int, weight: Any = None, *args: Any, **kwargs: Any) -> Counts:
    return _norm_estimate(input, weight)


def instance_norm(input: torch.Tensor, running_mean: Any = None, running_var: Any = None, weight: Any = None,
                  *args: Any, **kwargs: Any) -> Counts:
    return _norm_estimate(input, weight)


def upsample(input: torch.Tensor, size: Any = None, scale_factor: Any = None, *args: Any, **kwargs: Any) -> Counts:
    # one flop per output element; with an explicit `size` DeepSpeed counts the size product alone
    if size is not None:
        return (_prod(size) if isinstance(size, (tuple, list)) else int(size)), 0
    if scale_factor is None:
        raise ValueError("flops profiler: interpolate/upsample needs either size or scale_factor")
    spatial = input.ndim - 2
    if isinstance(scale_factor, (tuple, list)):
        if len(scale_factor) != spatial:
            raise ValueError(f"flops profiler: scale_factor {tuple(scale_factor)} does not match the "
                             f"{spatial} spatial dims of an input of shape {tuple(input.shape)}")
        factor = math.prod(scale_factor)
    else:
        factor = scale_factor ** spatial
    return int(input.numel() * factor), 0


def matmul(input: torch.Tensor, other: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    macs = _prod(input.shape) * other.shape[-1]
    return 2 * macs, macs


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    macs = _prod(mat1.shape) * mat2.shape[-1]
    return 2 * macs + _prod(input.shape), macs


def elementwise(input: Any, other: Any, *args: Any, **kwargs: Any) -> Counts:
    a, b = torch.is_tensor(input), torch.is_tensor(other)
    if a and b:
        return _prod(torch.broadcast_shapes(input.shape, other.shape)), 0
    if a or b:
        return _prod((input if a else other).shape), 0
    return 1, 0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    """scaled_dot_product_attention: Q K^T then the probabilities times V."""
    keys = k.shape[-2]
    macs = _prod(q.shape) * keys + _prod(q.shape[:-1]) * keys * v.shape[-1]
    return 2 * macs, macs


def _einsum_path_flops(equation: str, shapes: list) -> int:
    import numpy as np

    # rename the subscripts to a, b, c... in order of appearance so equivalent equations cost the same
    letters = list(dict.fromkeys(ch for ch in equation if ch.isalpha()))
    equation = equation.translate({ord(ch): ord("a") + i for i, ch in enumerate(letters)})
    report = np.einsum_path(equation, *[np.zeros(s) for s in shapes], optimize="optimal")[1]
    for line in report.splitlines():
        if "optimized flop" in line.lower():
            return int(float(line.split(":")[-1]))
    raise NotImplementedError(f"flops profiler: cannot count einsum {equation!r}")


def einsum(equation: str, *operands: Any) -> Counts:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return _einsum_path_flops(equation.replace(" ", ""), [tuple(o.shape) for o in operands]), 0


def einops_einsum(*args: Any) -> Counts:
    *operands, equation = args
    return _einsum_path_flops(equation, [tuple(o.shape) for o in operands]), 0

"""DeepSpeed's compression autograd functions (same names and call signatures): the top-k mask binarizer
and the fake quantizers, whose backward is the straight-through estimator (the gradient passes
unchanged). The arithmetic is in quant_kernels (C / CUDA kernels, torch reference in quant_reference).

Their backwards are plain torch ops, so a create_graph backward records them as it runs. Under a torch.func
transform (vmap, grad, ...) `apply` steps aside to the same estimator written in torch ops: the value from
quant_reference (torch ops, bit-equal to the kernels) plus `x - x.detach()` (zero, carrying the identity
gradient); per-sample vmap thus quantizes each sample with its own statistics, as a loop over samples would."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from deepspeed_c.compression import quant_kernels as K
from deepspeed_c.compression import quant_reference as R
from deepspeed_c.runtime.autograd_paths import transforms_active


class TopKBinarizer(torch.autograd.Function):
    """Mask of the ceil(threshold * numel) largest entries of `inputs` (1 kept, 0 pruned); `sigmoid`
    passes `threshold` through a sigmoid first (a learnt threshold then gets the masked gradient sum)."""

    @staticmethod
    def mask(inputs: torch.Tensor, threshold: Any, sigmoid: bool) -> torch.Tensor:
        if sigmoid:
            threshold = torch.sigmoid(threshold).item()
        keep = math.ceil(threshold * inputs.numel())
        # the same descending sort as DeepSpeed's, so ties fall the same way
        order = inputs.flatten().sort(descending=True)[1]
        mask = torch.zeros_like(inputs)
        flat = mask.view(-1)
        flat[order[:keep]] = 1.0
        return mask

    @classmethod
    def apply(cls, inputs: torch.Tensor, threshold: Any, sigmoid: bool) -> torch.Tensor:  # type: ignore[override]
        if not transforms_active():
            return super().apply(inputs, threshold, sigmoid)
        # torch.func: the mask, the identity gradient to `inputs`, and sum(grad * mask) to a sigmoid threshold
        mask = cls.mask(inputs.detach(), threshold.detach() if sigmoid else threshold, sigmoid)
        out = mask + (inputs - inputs.detach())
        return out + mask * (threshold - threshold.detach()) if sigmoid else out

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, threshold: Any, sigmoid: bool) -> torch.Tensor:
        mask = TopKBinarizer.mask(inputs, threshold, sigmoid)
        ctx.sigmoid = sigmoid
        ctx.save_for_backward(mask)
        return mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        mask, = ctx.saved_tensors
        if ctx.sigmoid:
            return grad.clone(), (grad * mask).sum().view(-1), None
        return grad.clone(), None, None


class _StraightThrough(torch.autograd.Function):

    @staticmethod
    def reference(input: torch.Tensor, num_bits: int, min_value: Optional[torch.Tensor] = None,
                  max_value: Optional[torch.Tensor] = None, num_groups: int = 1) -> torch.Tensor:
        """The forward's value in torch ops (quant_reference)."""
        raise NotImplementedError

    @classmethod
    def apply(cls, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        if not transforms_active():
            return super().apply(input, *args, **kwargs)
        return cls.reference(input.detach(), *args, **kwargs).detach() + (input - input.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.clone(), None, None, None, None


def _check_range(min_value: Optional[torch.Tensor], max_value: Optional[torch.Tensor], num_groups: int) -> None:
    if (min_value is None) != (max_value is None) or (min_value is not None and num_groups != 1):
        raise ValueError("a fixed quantization range needs both min_value and max_value, and num_groups == 1")


class SymQuantizer(_StraightThrough):
    """Symmetric fake quantization to `num_bits` per group (or over a fixed [min_value, max_value])."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, num_bits: int, min_value: Optional[torch.Tensor] = None,
                max_value: Optional[torch.Tensor] = None, num_groups: int = 1) -> torch.Tensor:
        _check_range(min_value, max_value, num_groups)
        if min_value is None:
            return K.fake_quant(input, num_bits, num_groups, asym=False)
        amax = torch.max(min_value.abs(), max_value).view(-1, 1)
        return K.fake_quant(input, num_bits, 1, asym=False, lo=amax, hi=amax)

    @staticmethod
    def reference(input: torch.Tensor, num_bits: int, min_value: Optional[torch.Tensor] = None,
                  max_value: Optional[torch.Tensor] = None, num_groups: int = 1) -> torch.Tensor:
        _check_range(min_value, max_value, num_groups)
        if min_value is None:
            return R.fake_quant(input, num_bits, num_groups, asym=False)
        amax = torch.max(min_value.abs(), max_value).view(-1, 1)
        return R.fake_quant(input, num_bits, 1, False, None, amax, amax)


class AsymQuantizer(_StraightThrough):
    """Asymmetric fake quantization to `num_bits` per group (or over a fixed [min_value, max_value])."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, num_bits: int, min_value: Optional[torch.Tensor] = None,
                max_value: Optional[torch.Tensor] = None, num_groups: int = 1) -> torch.Tensor:
        _check_range(min_value, max_value, num_groups)
        if min_value is None:
            return K.fake_quant(input, num_bits, num_groups, asym=True)
        return K.fake_quant(input, num_bits, 1, asym=True, lo=min_value.view(-1, 1), hi=max_value.view(-1, 1))

    @staticmethod
    def reference(input: torch.Tensor, num_bits: int, min_value: Optional[torch.Tensor] = None,
                  max_value: Optional[torch.Tensor] = None, num_groups: int = 1) -> torch.Tensor:
        _check_range(min_value, max_value, num_groups)
        if min_value is None:
            return R.fake_quant(input, num_bits, num_groups, asym=True)
        return R.fake_quant(input, num_bits, 1, True, None, min_value.view(-1, 1), max_value.view(-1, 1))


class TernaryQuantizer(_StraightThrough):
    """Ternary weights {-alpha, 0, alpha} per group (XTC); num_bits is ignored."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                num_groups: int = 1) -> torch.Tensor:
        if min_value is not None or max_value is not None:
            raise ValueError("TernaryQuantizer takes no fixed range")
        return K.ternary(input, num_groups)

    @staticmethod
    def reference(input: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                  num_groups: int = 1) -> torch.Tensor:
        if min_value is not None or max_value is not None:
            raise ValueError("TernaryQuantizer takes no fixed range")
        return R.ternary(input, num_groups)


class BinaryQuantizer(_StraightThrough):
    """Binary weights {-m, m} per group, m the mean magnitude (XTC); num_bits is ignored."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                num_groups: int = 1) -> torch.Tensor:
        if min_value is not None or max_value is not None:
            raise ValueError("BinaryQuantizer takes no fixed range")
        return K.binary(input, num_groups)

    @staticmethod
    def reference(input: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                  num_groups: int = 1) -> torch.Tensor:
        if min_value is not None or max_value is not None:
            raise ValueError("BinaryQuantizer takes no fixed range")
        return R.binary(input, num_groups)

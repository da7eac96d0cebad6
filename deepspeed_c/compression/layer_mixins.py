"""What the compressed layers share: the static activation-range observer (QuantAct), weight
quantization in the forward pass, activation quantization, sparse pruning, and swapping in a smaller
weight while keeping the MoQ bit-schedule attributes (start_bits, target_bits, q_period) that
runtime/quantize.py reads from the parameter.

Under torch.func.functional_call the module's parameters are plain tensors substituted for the Parameters, without
those attributes: the forward reads the bits from the Parameter when it carries them (DeepSpeed's behaviour) and
from the module's copy of the schedule otherwise."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import init

from deepspeed_c.compression.utils import AsymQuantizer, BinaryQuantizer, SymQuantizer, TernaryQuantizer, TopKBinarizer
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.utils.logging import logger


class QuantAct(nn.Module):
    """Static activation quantization: a momentum-averaged [min, max] range (buffer `x_min_max`) learnt in
    training and fixed in eval."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = "symmetric") -> None:
        super().__init__()
        self.act_range_momentum = act_range_momentum
        self.quant_mode = quant_mode
        self.act_function = SymQuantizer.apply if quant_mode == "symmetric" else AsymQuantizer.apply
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x: torch.Tensor, num_bits: int, *unused: Any) -> torch.Tensor:
        if self.training:
            self._calibrate(x.detach())
        return self.act_function(x, num_bits, self.x_min_max[0], self.x_min_max[1])

    def _calibrate(self, x: torch.Tensor) -> None:
        """Move the range towards this batch's; the first batch (range still empty: min == max) seeds it. Written
        without a data-dependent branch (torch.where), so torch.func.grad can run it when the buffer is an input
        of functional_call, and no host sync waits on the comparison."""
        r, m = self.x_min_max, self.act_range_momentum
        lo, hi = x.min(), x.max()
        fresh = r[0] == r[1]
        seeded = torch.stack((torch.where(fresh, lo, r[0]), torch.where(fresh, hi, r[1])))
        new = seeded * m + torch.stack((lo, hi)) * (1 - m)
        try:
            r.copy_(new)
        except RuntimeError as e:  # vmap: a batched range into the shared buffer; grad: a captured buffer
            if not transforms_active():
                raise
            raise RuntimeError(
                "QuantAct (static activation quantization): its training-mode range calibration writes the batch's "
                "[min, max] into the buffer x_min_max, which this torch.func transform cannot do (under vmap each "
                "sample would have its own range; under torch.func.grad the buffer must be passed to "
                "functional_call with the parameters). Calibrate outside torch.func, or call .eval() to quantize "
                f"with the calibrated range. ({e})") from e


def _scores(shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    """Learnt pruning scores, drawn as DeepSpeed draws them (default dtype, kaiming-uniform a=sqrt(5))."""
    scores = nn.Parameter(torch.empty(shape, device=device))
    init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


def weight_quantizer_for(bits: int, quantization_type: str, layer: str) -> Callable[..., torch.Tensor]:
    if bits >= 3:
        return SymQuantizer.apply if quantization_type == "symmetric" else AsymQuantizer.apply
    if quantization_type != "symmetric":
        raise ValueError(f"{layer}: {bits}-bit (binary/ternary) weight quantization is symmetric only; "
                         f"got quantization_type={quantization_type!r}")
    return TernaryQuantizer.apply if bits == 2 else BinaryQuantizer.apply


class CompressMixin:
    """Mixed into nn.Linear / nn.Conv2d / nn.Embedding subclasses."""

    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    _warned_in_forward = False

    def _init_compress_state(self) -> None:
        self.weight.start_bits = None
        self.weight.target_bits = None
        self.weight.q_period = None
        self._weight_target_bits: Optional[int] = None  # the schedule's target, kept on the module too
        self.weight_quantization_enabled_in_forward = False
        self.weight_quantization_enabled = False
        self.sparse_pruning_enabled = False
        self.activation_quantization_enabled = False
        self.sparse_pruning_method: Optional[str] = None
        self.activation_quantization_method: Optional[str] = None

    # -- weight swap keeping the MoQ attributes ----------------------------------------------------
    def _replace_weight(self, data: torch.Tensor) -> None:
        kept = (self.weight.start_bits, self.weight.target_bits, self.weight.q_period)
        self.weight = nn.Parameter(data)
        self.weight.start_bits, self.weight.target_bits, self.weight.q_period = kept

    def _replace_bias(self, data: torch.Tensor) -> None:
        self.bias = nn.Parameter(data)

    # -- weight quantization -----------------------------------------------------------------------
    def _set_weight_schedule(self, start_bits: int, target_bits: int, period: int, in_forward: bool) -> None:
        self.weight.start_bits = start_bits
        self.weight.target_bits = target_bits
        self.weight.q_period = period
        self._weight_target_bits = target_bits
        self.weight_quantization_enabled_in_forward = in_forward
        if in_forward and not CompressMixin._warned_in_forward:
            CompressMixin._warned_in_forward = True  # once per process, not once per layer
            logger.warning("quantize_weight_in_forward: the weights are fake-quantized at target_bits in every "
                           "forward; MoQ's bit schedule (start_bits -> target_bits) applies only without it")

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int) -> None:
        self._set_weight_schedule(start_bits, target_bits, quantization_period, weight_quantization_enabled_in_forward)
        if weight_quantization_enabled_in_forward:
            self.weight_quantizer = weight_quantizer_for(target_bits, quantization_type, type(self).__name__)
            self.weight_quantize_num_groups = num_groups

    def _weight_bits(self) -> Optional[int]:
        """The bits weights are fake-quantized to: the Parameter's target_bits (DeepSpeed reads them there, and a
        user may set them), or the module's copy when the weight is a tensor without them (functional_call)."""
        bits = getattr(self.weight, "target_bits", None)
        return self._weight_target_bits if bits is None else bits

    def fix_weight_quantization(self) -> None:
        self.weight.data = self.weight_quantizer(self.weight, self._weight_bits(), None, None,
                                                 self.weight_quantize_num_groups).data
        self.weight_quantization_enabled_in_forward = False
        return None

    def _forward_weight(self) -> torch.Tensor:
        if self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled:
            return self.weight_quantizer(self.weight, self._weight_bits(), None, None,
                                         self.weight_quantize_num_groups)
        return self.weight

    # -- activation quantization -------------------------------------------------------------------
    def enable_activation_quantization(self, bits: int, quantization_type: str, range_calibration: str) -> None:
        if bits not in (4, 8):
            raise ValueError(f"{type(self).__name__}: activation quantization bits must be 4 or 8, got {bits!r}")
        self.activation_quantization_bits = bits
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"
        if range_calibration == "static":
            self.activation_quantizer = QuantAct(quant_mode=quantization_type)
        else:
            self.activation_quantizer = SymQuantizer.apply if quantization_type == "symmetric" else AsymQuantizer.apply

    def _quantize_input(self, x: torch.Tensor, groups_dynamic: int) -> torch.Tensor:
        if not self.activation_quantization_enabled:
            return x
        groups = groups_dynamic if "dynamic" in self.activation_quantization_method else 1
        return self.activation_quantizer(x, self.activation_quantization_bits, None, None, groups)

    # -- sparse pruning ----------------------------------------------------------------------------
    def enable_sparse_pruning(self, ratio: float, method: str) -> None:
        self.sparse_pruning_ratio = ratio
        self.sparse_pruning_method = method
        mask = None
        if method == "l1":
            mask = TopKBinarizer.apply(torch.abs(self.weight.data), ratio, False).view(self.weight.size())
        elif method == "topk":
            self.sparse_mask_scores = _scores(tuple(self.weight.size()), self.weight.device)
        else:
            raise ValueError(f"{type(self).__name__}: sparse pruning method must be 'l1' or 'topk', got {method!r}")
        self.register_buffer("sparse_pruning_mask", mask)

    def _sparse_mask(self) -> torch.Tensor:
        if self.sparse_pruning_method == "l1":
            return self.sparse_pruning_mask.to(self.weight.device)
        return TopKBinarizer.apply(self.sparse_mask_scores, self.sparse_pruning_ratio, False)

    def fix_sparse_pruning_helper(self) -> None:
        self.weight.data = self.weight.data * self._sparse_mask()
        del self.sparse_pruning_mask
        if self.sparse_pruning_method == "topk":
            del self.sparse_mask_scores
        self.sparse_pruning_method = None
        self.sparse_pruning_enabled = False
        return None

    def _sparse(self, weight: torch.Tensor) -> torch.Tensor:
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            return weight * self._sparse_mask().view(self.weight.size())
        return weight

"""DeepSpeed's `deepspeed.ops.fp_quantizer` quantizer classes over the plain-torch minifloat codec
(minifloat.py documents the byte layout). A quantizer remembers the shape and dtype of the last tensor it
quantized, as DeepSpeed's does: one quantizer per quantized tensor."""
from __future__ import annotations

import abc
import math
from typing import Any, Optional

import torch

from . import minifloat


class Quantizer(abc.ABC):
    """What a parameter quantizer provides: quantize and dequantize over groups of `group_size` values."""

    def __init__(self, group_size: int = 512) -> None:
        self.group_size = group_size

    @abc.abstractmethod
    def quantize(self, input: torch.Tensor, q_bits: int = 8, q_mantisa_bits: int = 3, stochastic_mode: bool = False,
                 return_meta_tensor: bool = False) -> Any:
        ...

    @abc.abstractmethod
    def dequantize(self, input_q: torch.Tensor, fp_out: Optional[torch.Tensor] = None, q_bits: int = 8,
                   q_mantisa_bits: int = 3, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        ...


class FP_Quantize(Quantizer):
    """Group-scaled FP8 (E4M3 or E5M2 by mantissa bits), FP6 (E3M2), FP12 (E7M4) and FP4 (E2M1) codes.
    Input must be bfloat16, as DeepSpeed's kernel requires."""

    def __init__(self, quantization_config: Any) -> None:
        super().__init__(group_size=quantization_config.group_size)
        self.q_config = quantization_config
        self.orig_dtype: Optional[torch.dtype] = None
        self.orig_shape: Optional[torch.Size] = None
        self.num_groups: Optional[int] = None
        self.scale: Optional[torch.Tensor] = None

    def _check(self, q_bits: int, q_mantisa_bits: int) -> None:
        minifloat.code_format(q_bits, q_mantisa_bits)
        minifloat.check_group_size(self.group_size, q_bits)

    def quantize(self, input: torch.Tensor, q_bits: int = 8, q_mantisa_bits: int = 3, stochastic_mode: bool = False,
                 return_meta_tensor: bool = False) -> Any:
        if input.dtype != torch.bfloat16:
            raise UnsupportedQuantInput(f"FP_Quantize.quantize: input must be torch.bfloat16, got {input.dtype}")
        if return_meta_tensor and q_bits != 8:
            raise ValueError(f"return_meta_tensor=True needs q_bits=8 (one byte per value), got q_bits={q_bits}")
        self._check(q_bits, q_mantisa_bits)
        self.orig_dtype, self.orig_shape = input.dtype, input.shape
        q = minifloat.encode(input, q_bits, q_mantisa_bits, self.group_size, stochastic=stochastic_mode)
        self.num_groups = q.shape[0]
        if not return_meta_tensor:
            return q
        # one code byte per value, shaped like the input, and the groups' scale bytes beside it
        data = q[:, :-minifloat.SCALE_BYTES].reshape(-1)[:input.numel()].reshape(input.shape)
        self.scale = q[:, -minifloat.SCALE_BYTES:].contiguous()
        return data, self.scale

    def get_scales(self) -> torch.Tensor:
        """The float32 scale of each group of the last meta-tensor quantization."""
        if self.scale is None:
            raise RuntimeError("get_scales: quantize(..., return_meta_tensor=True) has not been called")
        return self.scale.view(torch.float32).reshape(-1)

    def _rows(self, input_q: torch.Tensor, scale: Optional[torch.Tensor], q_bits: int) -> torch.Tensor:
        if scale is None:
            return input_q
        numel = math.prod(self.orig_shape)
        if input_q.numel() != numel:
            raise ValueError(f"dequantize with scale: input_q must hold one code per value ({numel}), "
                             f"got {input_q.numel()}")
        codes = torch.zeros(scale.shape[0] * self.group_size, dtype=torch.uint8, device=input_q.device)
        codes[:numel] = input_q.reshape(-1)
        return torch.cat([codes.view(-1, self.group_size), scale.reshape(-1, minifloat.SCALE_BYTES)], dim=1)

    def dequantize(self, input_q: torch.Tensor, fp_out: Optional[torch.Tensor] = None, q_bits: int = 8,
                   q_mantisa_bits: int = 3, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.orig_dtype is None:
            raise RuntimeError("FP_Quantize.dequantize: call quantize first (the quantizer keeps the shape and "
                               "dtype of the tensor it quantized)")
        self._check(q_bits, q_mantisa_bits)
        out = minifloat.decode(self._rows(input_q, scale, q_bits), q_bits, q_mantisa_bits, self.group_size,
                               self.orig_shape, self.orig_dtype)
        if fp_out is None:
            return out
        fp_out.copy_(out.reshape(fp_out.shape))
        return fp_out

    def selective_dequantize(self, input_q: torch.Tensor, indexes: torch.Tensor,
                             fp_out: Optional[torch.Tensor] = None, q_bits: int = 8, q_mantisa_bits: int = 3,
                             scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dequantize only the rows `indexes` of the first dimension of a quantized 3-d tensor."""
        if self.orig_shape is None or len(self.orig_shape) != 3:
            raise ValueError(f"selective_dequantize works on a quantized 3-d tensor, the last one quantized had "
                             f"shape {None if self.orig_shape is None else tuple(self.orig_shape)}")
        out = self.dequantize(input_q, q_bits=q_bits, q_mantisa_bits=q_mantisa_bits, scale=scale)
        picked = out.index_select(0, indexes.to(device=out.device, dtype=torch.int64))
        if fp_out is None:
            return picked
        fp_out.copy_(picked)
        return fp_out

    def to(self, *args: Any, **kwargs: Any) -> "FP_Quantize":
        # the codec builds its tables on the data's device; only a kept scale tensor moves
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if self.scale is not None and device is not None:
            self.scale = self.scale.to(device)
        return self


class UnsupportedQuantInput(TypeError, AssertionError):
    """A tensor the quantizer cannot take (DeepSpeed asserts here, hence AssertionError as well)."""

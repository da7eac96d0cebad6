"""QuantizedParameter (a frozen weight held as quantized bytes once it is on the accelerator) and
QuantizedLinear (an nn.Linear whose weight is one), as in DeepSpeed's deepspeed.linear.quantization."""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from deepspeed_c.accelerator import get_accelerator
from deepspeed_c.ops.fp_quantizer import FP_Quantize, Quantizer
from .config import QuantizationConfig


class QuantizedParameter(nn.Parameter):
    """A frozen parameter quantized in place whenever it is (or moves) on the accelerator device; on the
    CPU accelerator that is at once. `dequantized()` gives the weight back in its original dtype.

    quantizer: any deepspeed_c.ops.fp_quantizer.Quantizer (FP_Quantize by default); it travels with the
    parameter because it remembers the original shape. Further keyword arguments become attributes, so
    the Hugging Face clone `QuantizedParameter(p.data, **p.__dict__)` keeps them.
    """

    def __new__(cls, data: Optional[torch.Tensor] = None, requires_grad: bool = False,
                quantization_config: Optional[QuantizationConfig] = None, quantizer: Optional[Quantizer] = None,
                **attributes: Any) -> "QuantizedParameter":
        if requires_grad:
            raise ValueError("QuantizedParameter: requires_grad=True is not supported, quantized weights are frozen")
        if data is None:
            data = torch.empty(0)
        self = torch.Tensor._make_subclass(cls, data, False)
        self.quantization_config = QuantizationConfig() if quantization_config is None else quantization_config
        self.quantization_config.validate()
        self.quantizer = FP_Quantize(quantization_config=self.quantization_config) if quantizer is None else quantizer
        for name, value in attributes.items():
            setattr(self, name, value)
        self._ensure_quantized(self)
        return self

    def _is_quantized(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.quantization_config.q_dtype

    def _ensure_quantized(self, tensor: torch.Tensor) -> None:
        if get_accelerator().on_accelerator(tensor) and not self._is_quantized(tensor):
            cfg = self.quantization_config
            tensor.data = self.quantizer.quantize(tensor.data, q_bits=cfg.q_bits, q_mantisa_bits=cfg.mantissa_bits)

    def dequantized(self, device: Any = None) -> torch.Tensor:
        """The weight in its original dtype and shape (the data itself when it is not quantized); `device`
        moves the quantized bytes there first (an offloaded weight), not the larger dequantized values."""
        data = self.data if device is None else self.data.to(device)
        if not self._is_quantized(data):
            return data
        cfg = self.quantization_config
        return self.quantizer.dequantize(data, q_bits=cfg.q_bits, q_mantisa_bits=cfg.mantissa_bits)

    def offload(self, revert: bool = False) -> None:
        """Move the bytes to the CPU (or back, revert=True) when the engine marked this weight ds_offload."""
        if getattr(self, "ds_offload", False):
            self.data = self.data.to(get_accelerator().current_device_name() if revert else "cpu")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(data=self.data, requires_grad=self.requires_grad)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self.data = state.pop("data")
        self.requires_grad = state.pop("requires_grad")
        self.__dict__.update(state)

    def __reduce_ex__(self, protocol: int) -> Any:
        return (_rebuild, (self.__getstate__(),))

    def __deepcopy__(self, memo: dict) -> "QuantizedParameter":
        if id(self) in memo:
            return memo[id(self)]
        state = {k: copy.deepcopy(v, memo) for k, v in self.__getstate__().items() if k != "data"}
        new = _rebuild(dict(state, data=self.data.clone()))
        memo[id(self)] = new
        return new

    def __copy__(self) -> "QuantizedParameter":
        return _rebuild(self.__getstate__())

    def cuda(self, device: Any = None, non_blocking: bool = False) -> torch.Tensor:
        return self.to("cuda" if device is None else device, non_blocking=non_blocking)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Move (or convert) the data; landing on the accelerator quantizes it."""
        tensor = super().to(*args, **kwargs)
        self.quantizer.to(*args, **kwargs)
        self._ensure_quantized(tensor)
        return tensor


def _rebuild(state: dict) -> QuantizedParameter:
    # bypasses __new__ so an already quantized (or deliberately unquantized) payload is kept as it is
    state = dict(state)
    new = torch.Tensor._make_subclass(QuantizedParameter, state.pop("data"), False)
    new.__setstate__(dict(state, data=new.data))
    return new


class QuantizedLinear(nn.Linear):
    """nn.Linear whose weight is a QuantizedParameter, dequantized for each forward (bfloat16 only)."""

    def __init__(self, input_dim: int, output_dim: int, bias: bool = False,
                 quantization_config: Optional[QuantizationConfig] = None, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype != torch.bfloat16:
            raise ValueError(f"QuantizedLinear: dtype must be torch.bfloat16, got {dtype}")
        super().__init__(input_dim, output_dim, bias=bias, dtype=dtype)
        self.weight = QuantizedParameter(self.weight.data, quantization_config=quantization_config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight.dequantized(), self.bias)

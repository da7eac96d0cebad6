"""OptimizedLinear (a factory picking the layer its configs ask for) and LoRAOptimizedLinear: a frozen base
weight, optionally quantized and optionally sharded over the ranks, plus trainable low-rank adapters.

Sharding layout (as DeepSpeed's, so state dicts match): the (output_dim, input_dim) base weight is
flattened and rank r holds the contiguous slice [r * n, (r + 1) * n) with n = output_dim * input_dim /
base_weight_sharding; its `weight` is that flat slice, and the forward all-gathers the whole weight.
"""
from __future__ import annotations

import math
from dataclasses import is_dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed_c.comm as dist
from deepspeed_c.accelerator import get_accelerator
from .config import LoRAConfig, QuantizationConfig
from .quantization import QuantizedLinear, QuantizedParameter


def _check_dims(input_dim: Any, output_dim: Any) -> None:
    for name, v in (("input_dim", input_dim), ("output_dim", output_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"OptimizedLinear: {name} must be a positive int, got {v!r}")


class OptimizedLinear(nn.Module):
    """nn.Linear with LoRA (base-weight sharding, offload) and FP quantization of the frozen base weight.

    Constructing one returns the layer the configs call for: `linear_cls(input_dim, output_dim)` when neither
    config is given, QuantizedLinear with only quantization_config, LoRAOptimizedLinear when lora_config is
    given (quantized base weight if quantization_config is given too).
    """

    def __new__(cls, input_dim: int, output_dim: int, bias: bool = False, lora_config: Optional[LoRAConfig] = None,
                quantization_config: Optional[QuantizationConfig] = None, device: Any = None,
                dtype: torch.dtype = torch.bfloat16, linear_cls: type = nn.Linear) -> nn.Module:
        if quantization_config is not None and not is_dataclass(quantization_config):
            raise ValueError(f"quantization_config: expecting a QuantizationConfig, got {type(quantization_config)}")
        if lora_config is not None and not is_dataclass(lora_config):
            raise ValueError(f"lora_config: expecting a LoRAConfig, got {type(lora_config)}")
        if lora_config is not None:
            return LoRAOptimizedLinear(input_dim=input_dim, output_dim=output_dim, bias=bias, lora_config=lora_config,
                                       quantization_config=quantization_config, device=device, dtype=dtype,
                                       linear_cls=linear_cls)
        if quantization_config is not None:
            _check_dims(input_dim, output_dim)
            return QuantizedLinear(input_dim=input_dim, output_dim=output_dim, bias=bias,
                                   quantization_config=quantization_config, dtype=dtype)
        return linear_cls(input_dim, output_dim, bias=bias, dtype=dtype, device=device)


class LoRAOptimizedLinear(nn.Module):
    """Frozen base weight W (maybe quantized, maybe sharded) plus trainable adapters:
    y = x W^T + (lora_alpha / lora_r) * lora_weight_2(lora_weight_1(x)), lora_weight_2 starting at zero."""

    def __init__(self, input_dim: int, output_dim: int, bias: bool = False, lora_config: Optional[LoRAConfig] = None,
                 quantization_config: Optional[QuantizationConfig] = None, device: Any = None,
                 dtype: torch.dtype = torch.bfloat16, linear_cls: type = nn.Linear) -> None:
        super().__init__()
        _check_dims(input_dim, output_dim)
        if lora_config is None:
            raise ValueError("LoRAOptimizedLinear: lora_config is required (a LoRAConfig)")
        lora_config.validate()
        if bias:
            raise ValueError("LoRAOptimizedLinear: bias=True is not supported (the base layer has no bias)")
        if quantization_config is not None:
            quantization_config.validate()
            if dtype != torch.bfloat16:
                raise ValueError(f"LoRAOptimizedLinear: with quantization_config, dtype must be torch.bfloat16, "
                                 f"got {dtype}")
        self.input_dim, self.output_dim = input_dim, output_dim
        self.bias = bias
        self.lora_config, self.quantization_config = lora_config, quantization_config
        self.device = get_accelerator().current_device_name() if device is None else device
        self.linear_cls, self.dtype = linear_cls, dtype
        self.zero_shards = lora_config.base_weight_sharding
        if self.zero_shards > 1:
            self._check_sharding()
        self.sharded_weight_size = input_dim // self.zero_shards
        shape = (output_dim * self.sharded_weight_size,) if self.zero_shards > 1 else (output_dim, input_dim)
        w = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        # Xavier-uniform bound of the whole (output_dim, input_dim) weight, also for a rank's shard
        bound = math.sqrt(6.0 / (input_dim + output_dim))
        with torch.no_grad():
            w.uniform_(-bound, bound)
        self.weight = QuantizedParameter(w.data, quantization_config=quantization_config) \
            if quantization_config is not None else w
        self.disabled = False
        self._initialized = False
        if not lora_config.delay_lora_init:
            self.init_lora()

    def _check_sharding(self) -> None:
        shards = self.zero_shards
        if not dist.is_initialized():
            raise RuntimeError(f"LoRAConfig.base_weight_sharding={shards} needs torch.distributed initialised "
                               f"first (deepspeed.init_distributed())")
        if shards != dist.get_world_size():
            raise ValueError(f"LoRAConfig.base_weight_sharding must be 1 or the world size "
                             f"({dist.get_world_size()}), got {shards}")
        if self.input_dim % shards:
            raise ValueError(f"input_dim ({self.input_dim}) must divide evenly by "
                             f"LoRAConfig.base_weight_sharding ({shards})")

    def disable(self) -> None:
        """Turn into a plain frozen linear with a whole, unquantized weight (for modules not in target_mods)."""
        self.disabled = True
        self.weight = nn.Parameter(torch.empty((self.output_dim, self.input_dim), dtype=self.dtype),
                                   requires_grad=False)

    def init_lora(self) -> None:
        """Freeze the base weight and build the adapters: lora_weight_1 Kaiming-uniform, lora_weight_2 zero."""
        if self.disabled:
            return
        if self.quantization_config is not None and not isinstance(self.weight, QuantizedParameter):
            # a model loader may have swapped in a plain Parameter
            self.weight = QuantizedParameter(self.weight.data, quantization_config=self.quantization_config)
        self.weight.requires_grad = False
        self.weight.ds_optim_param = True  # the engine neither broadcasts it (shards differ) nor optimises it
        self.lora_scaling_factor = self.lora_config.lora_alpha / self.lora_config.lora_r
        r = self.lora_config.lora_r
        self.lora_weight_1 = self.linear_cls(self.input_dim, r, bias=self.bias, device=self.device, dtype=self.dtype)
        self.lora_weight_2 = self.linear_cls(r, self.output_dim, bias=self.bias, device=self.device, dtype=self.dtype)
        nn.init.kaiming_uniform_(self.lora_weight_1.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_weight_2.weight)
        self.lora_weight_1.weight.requires_grad = True
        self.lora_weight_2.weight.requires_grad = True
        self._initialized = True

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        if not any(target in prefix for target in self.lora_config.target_mods):
            self.disable()
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        key = f"{prefix}weight"
        incoming = state_dict.get(key)
        if incoming is not None and incoming.is_floating_point():
            if self.zero_shards > 1:
                if not dist.is_initialized():
                    raise RuntimeError("loading a base_weight_sharding LoRAOptimizedLinear needs torch.distributed "
                                       "initialised first")
                n = self.output_dim * self.sharded_weight_size
                if incoming.numel() == n * self.zero_shards:  # a whole weight: keep this rank's slice
                    incoming = incoming.reshape(-1).narrow(0, dist.get_rank() * n, n)
            w = self.weight
            if isinstance(w, QuantizedParameter) and w._is_quantized(w.data) and \
                    tuple(incoming.shape) == tuple(w.quantizer.orig_shape):
                cfg = w.quantization_config
                incoming = w.quantizer.quantize(incoming.to(device=w.device, dtype=self.dtype), q_bits=cfg.q_bits,
                                                q_mantisa_bits=cfg.mantissa_bits)
            state_dict[key] = incoming
        return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                             unexpected_keys, error_msgs)

    def _local_weight(self, device: Any = None) -> torch.Tensor:
        """This rank's base weight (shard), dequantized. One the engine parked on the CPU (ds_offload) is
        copied to `device` (default: the accelerator) and stays parked; any other is used where it is."""
        w = self.weight
        target = None
        if getattr(w, "ds_offload", False):
            target = get_accelerator().current_device_name() if device is None else device
        if isinstance(w, QuantizedParameter):
            return w.dequantized(target)
        return w if target is None else w.detach().to(target)

    def full_weight(self, device: Any = None) -> torch.Tensor:
        """The whole (output_dim, input_dim) base weight, all-gathered from the ranks' shards (an offloaded
        shard is gathered on `device`, by default the accelerator)."""
        local = self._local_weight(device)
        out = torch.empty(self.output_dim * self.input_dim, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local.reshape(-1).contiguous())
        return out.view(self.output_dim, self.input_dim)

    def linear_without_F_linear(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """input @ weight for a weight laid out (in, out)."""
        out = torch.mm(input.reshape(-1, input.shape[-1]), weight)
        return out.view(*input.shape[:-1], weight.shape[1])

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(input_tensor, self.weight)
        if not self._initialized:
            raise RuntimeError("LoRAOptimizedLinear: init_lora was never called (delay_lora_init=True); call "
                               "deepspeed.linear.init_lora(model) before the forward")
        if self.zero_shards > 1:
            with torch.no_grad():
                base = self.full_weight(input_tensor.device)
        else:
            base = self._local_weight(input_tensor.device)
        lora = self.lora_weight_2(self.lora_weight_1(input_tensor))
        return F.linear(input_tensor, base) + self.lora_scaling_factor * lora

"""MoQ (mixed-precision quantization-aware training): after each applied optimizer step the weights that
carry a bit schedule (parameters with `start_bits`, `target_bits`, `q_period`, set by init_compression's
weight quantization or by `mark_moq_parameters` for the `quantize_training` section) are replaced by their
quantized values at the current precision. DeepSpeed 0.19.6's `Quantizer`, same constructor and schedule:

  * every quantize() call counts a step (qsteps); a parameter whose start_bits is above target_bits and
    whose q_period qsteps has reached drops one bit, and its period doubles (times the eigenvalue factor
    1 + floor(4 * eigenvalue) when the block's Hessian eigenvalue is known: sharper blocks wait longer);
  * >= 3 bits: symmetric / asymmetric per-group fake quantization (nearest or stochastic rounding),
    2 bits ternary, 1 bit binary (nearest only);
  * fp16_mixed_quantize blends `ratio * w + (1 - ratio) * q(w)`, the ratio falling by
    quantize_change_ratio per step from 1 (reset to 1 at each precision switch).
The arithmetic runs in deepspeed_c.compression.quant_kernels (C / CUDA kernels)."""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from deepspeed_c.compression import quant_kernels as K
from deepspeed_c.compression.moq import drop_one_bit
from deepspeed_c.utils.logging import logger

TWO_D_PARAMS = 6


class Quantizer:

    def __init__(self, q_groups: int = 1, q_mixed_fp16: bool = False, q_change_ratio: float = 0.01,
                 q_type: Any = 0, q_rounding: Any = 0, q_verbose: bool = False, q_eigenvalue: bool = False,
                 use_quantizer_kernel: bool = False, layer_num: int = 0) -> None:
        self.q_groups = q_groups
        self.q_mixed_fp16 = q_mixed_fp16
        self.q_change_ratio = q_change_ratio
        self.q_type = q_type
        self.qsteps = 0
        self.quantize_real_ratio = 1.000
        self.q_verbose = q_verbose
        self.q_eigenvalue = q_eigenvalue
        self.use_quantizer_kernel = use_quantizer_kernel  # our kernels run either way
        self.q_rounding = q_rounding
        self.layer_num = layer_num
        self._tracked: list[torch.nn.Parameter] = []

    def any_precision_switch(self) -> bool:
        """Whether some tracked weight may drop a bit within the next TWO_D_PARAMS * layer_num steps (the
        engine computes eigenvalues only then)."""
        if self.layer_num == 0:
            return True
        horizon = self.qsteps + TWO_D_PARAMS * self.layer_num
        return any(p.start_bits != p.target_bits and horizon >= p.q_period for p in self._tracked)

    def quantize(self, parameter_group: Iterable[Iterable[torch.Tensor]], overflow: bool, eigenvalue_enabled: bool,
                 block_eigenvalue: Optional[dict] = None) -> None:
        if overflow and not eigenvalue_enabled:
            return
        self.step()
        self.update_fp16_ratio()
        tracked = []
        for group in parameter_group:
            for p in group:
                if p.dim() <= 1 or not getattr(p, "start_bits", None):
                    continue
                tracked.append(p)
                eigenvalue, layer_id = (block_eigenvalue or {}).get(id(p), (None, 0))
                factor = 1 + math.floor(eigenvalue * 4) if eigenvalue is not None else 1
                p.data = self.compute_quantization(p, layer_id, factor)
        self._tracked = tracked

    def step(self) -> None:
        self.qsteps += 1

    def _rounding_noise(self, x: torch.Tensor) -> bool:
        return self.q_rounding not in ("nearest", 0)

    def quantize_highbit(self, inputs: torch.Tensor, num_bits: int) -> torch.Tensor:
        return K.fake_quant(inputs, num_bits, self.q_groups, asym=self.q_type == "asymmetric",
                            stochastic=self._rounding_noise(inputs))

    def quantize_tenary(self, inputs: torch.Tensor) -> torch.Tensor:  # DeepSpeed's spelling
        return K.ternary(inputs, self.q_groups)

    def quantize_binary(self, inputs: torch.Tensor) -> torch.Tensor:
        return K.binary(inputs, self.q_groups)

    def compute_quantization(self, input: torch.nn.Parameter, index: int = 0, factor: int = 1) -> torch.Tensor:
        if input.start_bits != input.target_bits and self.qsteps >= input.q_period:
            self.quantize_real_ratio = 1.0
            drop_one_bit(input, factor)
            if self.q_verbose:
                logger.info(f"Quantization settings: current bit-precision = {input.start_bits}, step = {self.qsteps}, "
                            f"quantization period = {input.q_period}, index = {index}")
        if input.start_bits < input.target_bits:
            raise ValueError(f"MoQ: a weight is at {input.start_bits} bits, below its target_bits "
                             f"{input.target_bits}")
        bits = input.start_bits
        if bits >= 3:
            out = self.quantize_highbit(input.data, bits)
        else:
            if self.q_type != "symmetric" or self._rounding_noise(input.data):
                raise ValueError(f"MoQ: {bits}-bit (ternary/binary) weights need quantization_type 'symmetric' and "
                                 f"rounding 'nearest', got {self.q_type!r} / {self.q_rounding!r}")
            out = self.quantize_tenary(input.data) if bits == 2 else self.quantize_binary(input.data)
        if self.q_mixed_fp16 and input.start_bits >= input.target_bits - 1:
            out = self.quantize_real_ratio * input.data + (1 - self.quantize_real_ratio) * out
        return out

    def update_fp16_ratio(self) -> None:
        if self.q_mixed_fp16:
            if self.quantize_real_ratio > 0:
                self.quantize_real_ratio -= self.q_change_ratio
            else:
                self.quantize_real_ratio = 0.000

"""What the engine does for compression and MoQ (DeepSpeed 0.19.6's engine behaviour):

  * `compression_scheduler` over the model from the `compression_training` section; stepped with
    step_zero_check before each forward while global_steps == 0, and once after each applied optimizer step;
  * `quantizer` (runtime/quantize.Quantizer) when weight quantization is on without quantize_weight_in_forward
    (MoQ on the weights the compression groups name), or from the `quantize_training` section (MoQ on every
    2+-dimensional weight, from schedule_offset on): it requantizes those weights after every optimizer step
    (skipped on overflow) and, like DeepSpeed, on every forward at step 0 once weight quantization is on."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.compression import constants as C
from deepspeed_c.compression.config import get_compression_config
from deepspeed_c.compression.moq import mark_moq_parameters, parse_quantize_training
from deepspeed_c.compression.scheduler import compression_scheduler
from deepspeed_c.runtime.quantize import Quantizer


class CompressionHooks:

    def __init__(self, module: torch.nn.Module, param_dict: dict) -> None:
        self.compression_config = get_compression_config(param_dict)
        self.scheduler = compression_scheduler(module, self.compression_config)
        self.quantizer: Optional[Quantizer] = None
        self._moq_offset: Optional[int] = None
        wq = self.compression_config[C.WEIGHT_QUANTIZATION][C.SHARED_PARAMETERS]
        moq = parse_quantize_training(param_dict)
        if wq[C.TECHNIQUE_ENABLED] and not wq[C.WEIGHT_QUANTIZE_IN_FORWARD_ENABLED]:
            self.quantizer = Quantizer(wq[C.WEIGHT_QUANTIZE_GROUPS], wq[C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE],
                                       wq[C.WEIGHT_QUANTIZE_CHANGE_RATIO], wq[C.WEIGHT_QUANTIZE_TYPE],
                                       wq[C.WEIGHT_QUANTIZE_ROUNDING], wq[C.WEIGHT_QUANTIZE_VERBOSE], False,
                                       wq[C.WEIGHT_QUANTIZE_KERNEL], 0)
        elif moq.enabled:
            if moq.eigenvalue and moq.eigenvalue.get("enabled", False):
                raise NotImplementedError("deepspeed_c: config key 'quantize_training.eigenvalue.enabled' asks the "
                                          "engine for eigenvalue-timed MoQ, which it does not drive yet (DeepSpeed "
                                          "0.19.6 disables it too); pass Eigenvalue.compute_eigenvalue's result to "
                                          "Quantizer.quantize yourself")
            mark_moq_parameters(module, moq.start_bits, moq.target_bits, moq.period)
            self.quantizer = Quantizer(moq.groups, moq.mixed_fp16, moq.change_ratio, moq.q_type, moq.rounding,
                                       moq.verbose, False, moq.kernel, 0)
            self._moq_offset = moq.schedule_offset

    @staticmethod
    def wanted(param_dict: dict) -> bool:
        return bool(param_dict.get(C.COMPRESSION_TRAINING)) or \
            bool((param_dict.get("quantize_training") or {}).get("enabled", False))

    def _quantizing(self, global_steps: int) -> bool:
        if self._moq_offset is not None:
            return global_steps >= self._moq_offset
        return self.scheduler.weight_quantization_enabled

    def before_forward(self, global_steps: int, params: list[torch.Tensor]) -> None:
        if global_steps != 0:
            return
        self.scheduler.step(step_zero_check=True)
        if self.quantizer is not None and self._quantizing(global_steps):
            self.quantizer.quantize([params], False, False, None)

    def after_step(self, overflow: bool, global_steps: int, params: list[torch.Tensor],
                   block_eigenvalue: Optional[dict] = None) -> None:
        if self.quantizer is not None and self._quantizing(global_steps):
            self.quantizer.quantize([params], overflow, False, block_eigenvalue)
        if not overflow:
            self.scheduler.step()


def configure(engine: Any) -> Optional[CompressionHooks]:
    """The hooks for `engine` (None when its config asks for neither compression nor MoQ)."""
    param_dict = engine._config.user_dict
    return CompressionHooks(engine.module, param_dict) if CompressionHooks.wanted(param_dict) else None

"""What the engine does for compression and MoQ (DeepSpeed 0.19.6's engine behaviour):

  * `compression_scheduler` over the model from the `compression_training` section; stepped with
    step_zero_check before each forward while global_steps == 0, and once after each applied optimizer step;
  * `quantizer` (runtime/quantize.Quantizer) when weight quantization is on without quantize_weight_in_forward
    (MoQ on the weights the compression groups name), or from the `quantize_training` section (MoQ on every
    2+-dimensional weight, from schedule_offset on): it requantizes those weights after every optimizer step
    (skipped on overflow) and, like DeepSpeed, on every forward at step 0 once weight quantization is on;
  * with `quantize_training.eigenvalue.enabled`, the blocks' Hessian eigenvalues (runtime/eigenvalue.py) before
    the optimizer step stretch each block's period at its next bit drop by 1 + floor(4 * eigenvalue)
    (DeepSpeed 0.19.6 refuses this setting; its 0.5-era engine did the same)."""
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
        self.module = module
        self.eigenvalue: Any = None
        self.block_eigenvalue: dict = {}
        self._use_eigenvalue = False
        wq = self.compression_config[C.WEIGHT_QUANTIZATION][C.SHARED_PARAMETERS]
        moq = parse_quantize_training(param_dict)
        if wq[C.TECHNIQUE_ENABLED] and not wq[C.WEIGHT_QUANTIZE_IN_FORWARD_ENABLED]:
            self.quantizer = Quantizer(wq[C.WEIGHT_QUANTIZE_GROUPS], wq[C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE],
                                       wq[C.WEIGHT_QUANTIZE_CHANGE_RATIO], wq[C.WEIGHT_QUANTIZE_TYPE],
                                       wq[C.WEIGHT_QUANTIZE_ROUNDING], wq[C.WEIGHT_QUANTIZE_VERBOSE], False,
                                       wq[C.WEIGHT_QUANTIZE_KERNEL], 0)
        elif moq.enabled:
            self.eigenvalue = _eigenvalue(moq.eigenvalue)
            mark_moq_parameters(module, moq.start_bits, moq.target_bits, moq.period)
            self.quantizer = Quantizer(moq.groups, moq.mixed_fp16, moq.change_ratio, moq.q_type, moq.rounding,
                                       moq.verbose, self.eigenvalue is not None, moq.kernel,
                                       self.eigenvalue.layer_num if self.eigenvalue else 0)
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

    def before_step(self, gas_boundary_ctr: int, loss_scale: float) -> None:
        """At a gradient-accumulation boundary, before the optimizer: the blocks' Hessian eigenvalues, when MoQ
        is eigenvalue-timed, every gas_boundary_resolution boundaries while a precision switch is near (the
        gradients must carry their graph: `engine.scale(loss).backward(create_graph=True)`)."""
        self._use_eigenvalue = False
        if self.eigenvalue is None or self.quantizer is None:
            return
        if gas_boundary_ctr % self.eigenvalue.gas_boundary_resolution == 0 and self.quantizer.any_precision_switch():
            self.block_eigenvalue = self.eigenvalue.compute_eigenvalue(self.module, None, loss_scale)
            self._use_eigenvalue = True

    def after_step(self, overflow: bool, global_steps: int, params: list[torch.Tensor]) -> None:
        if self.quantizer is not None and self._quantizing(global_steps):
            self.quantizer.quantize([params], overflow, self.eigenvalue is not None,
                                    self.block_eigenvalue if self._use_eigenvalue else {})
        if not overflow:
            self.scheduler.step()


def _eigenvalue(raw: Optional[dict]) -> Any:
    """runtime/eigenvalue.py's Eigenvalue from `quantize_training.eigenvalue` (None when off)."""
    if not raw or not raw.get("enabled", False):
        return None
    from deepspeed_c.compression.config import check_keys
    from deepspeed_c.runtime.eigenvalue import Eigenvalue

    keys = ("verbose", "max_iter", "tol", "stability", "gas_boundary_resolution", "layer_name", "layer_num")
    check_keys(raw, ("enabled", *keys), "quantize_training.eigenvalue")
    defaults = {"verbose": False, "max_iter": 100, "tol": 1e-2, "stability": 1e-6, "gas_boundary_resolution": 1,
                "layer_name": "bert.encoder.layer", "layer_num": 0}
    return Eigenvalue(**{k: raw.get(k, v) for k, v in defaults.items()})


def configure(module: torch.nn.Module, param_dict: dict) -> Optional[CompressionHooks]:
    """The hooks for an engine over `module` with config `param_dict` (None when it asks for neither
    compression nor MoQ)."""
    return CompressionHooks(module, param_dict) if CompressionHooks.wanted(param_dict) else None

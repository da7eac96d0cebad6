"""Mixed precision policy, as a collaborator of the engine.

`Precision` decides from the config how parameters are stored (fp32, fp16, bf16), how the loss is
scaled (which loss scaler, whether overflow is checked), in which dtype stage-0 gradients
accumulate, and whether forward runs under torch.autocast. For fp16 and bf16 at stage 0 it wraps the
optimizer in `MixedPrecisionOptimizer` (runtime/mixed_precision_optimizer.py: fp32 masters, skipped
overflowing steps); under ZeRO the ZeRO optimizer owns the masters and takes the loss scaler from
`zero_loss_scaling()`."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from deepspeed_c.runtime.config.precision import DELAYED_SHIFT
from deepspeed_c.runtime.config.utils import parse_dtype
from deepspeed_c.runtime.fp16.loss_scaler import CreateLossScaler, LossScalerBase
# the optimizer's import path before it had a module of its own (DeepSpeed-style imports of it stay valid)
from deepspeed_c.runtime.fp32_grad_accumulators import Fp32AccumulatorSlots  # noqa: F401
from deepspeed_c.runtime.mixed_precision_optimizer import MixedPrecisionOptimizer
from deepspeed_c.utils.logging import logger

__all__ = ["Precision", "MixedPrecisionOptimizer", "Fp32AccumulatorSlots"]


class Precision:
    """How the engine stores parameters, scales the loss and runs forward."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.fp16 = config.float16_config
        self.bf16 = config.bfloat16_config
        self.model_dtype = config.model_dtype()
        self.autocast_enabled = bool(config.torch_autocast_enabled)
        self.autocast_dtype: Optional[torch.dtype] = config.torch_autocast_dtype
        # the config keeps DeepSpeed's raw string ("bf16", "fp32", ...); torch wants a dtype
        self.buffer_dtype: Optional[torch.dtype] = parse_dtype(config.buffer_dtype, "data_types.buffer_dtype")
        # the stage-0 accumulation dtype (ZeRO builds its own optimizer and ignores this one's hooks)
        stage0 = int(getattr(config, "zero_optimization_stage", 0) or 0) == 0
        accum = parse_dtype(config.grad_accum_dtype, "data_types.grad_accum_dtype")
        self.grad_accum_dtype: Optional[torch.dtype] = accum if stage0 else None
        self.grad_scaler: Optional[Any] = None  # torch.amp.GradScaler for fp16 torch_autocast
        self.mixed: Optional[MixedPrecisionOptimizer] = None
        self._sparse_modules: list[str] = []  # embeddings with sparse=True (cast_module records them)

    @property
    def low_precision(self) -> bool:
        return self.model_dtype in (torch.float16, torch.bfloat16)

    def cast_module(self, module: torch.nn.Module) -> None:
        """Floating parameters to the model dtype; buffers only when data_types.buffer_dtype says so."""
        from deepspeed_c.runtime.sparse_grads import sparse_module_names

        self._sparse_modules = sparse_module_names(module)  # refused by wrap_optimizer when masters are built
        if self.model_dtype != torch.float32:
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != self.model_dtype:
                    p.data = p.data.to(self.model_dtype)
        if self.buffer_dtype is not None:
            for b in module.buffers():
                if b.is_floating_point() and b.dtype != self.buffer_dtype:
                    b.data = b.data.to(self.buffer_dtype)

    def wrap_optimizer(self, optimizer: Optional[torch.optim.Optimizer], device: torch.device,
                       sync_overflow: Optional[Callable[[bool], bool]] = None, dp_world_size: int = 1,
                       zero_owns_masters: bool = False,
                       norm_across_ranks: Optional[Callable[[Any], Any]] = None) -> Any:
        """The optimizer the engine steps: the 16-bit model wrapped by MixedPrecisionOptimizer (fp32
        masters of the whole model), or, when ZeRO owns the masters (zero_owns_masters), the optimizer
        unwrapped: ZeRO builds its own partitioned masters and takes the loss scaler from
        zero_loss_scaling(), so no full-model fp32 copy is ever allocated."""
        if self.autocast_enabled and self.autocast_dtype == torch.float16:
            self.grad_scaler = torch.amp.GradScaler(device=device.type)
        harvest = bool(self.config.graph_harvesting) and optimizer is not None
        if harvest and (self.model_dtype != torch.bfloat16 or zero_owns_masters):
            from deepspeed_c.runtime.graph_harvesting import no_effect

            no_effect("it records the bf16 optimizer's step at ZeRO stage 0 (as DeepSpeed's BF16_Optimizer does); "
                      "this engine runs " + ("a ZeRO stage" if zero_owns_masters else f"{self.model_dtype}"))
            harvest = False
        if optimizer is None or not self.low_precision:
            return optimizer
        if zero_owns_masters:
            return optimizer
        from deepspeed_c.runtime.sparse_grads import check_sparse_supported

        # the fp32 masters flatten the gradients: sparse embeddings refused by name, before any step
        check_sparse_supported(self._sparse_modules, f"{'bf16' if self.model_dtype == torch.bfloat16 else 'fp16'} "
                                                     "training (its fp32 master weights)")
        scaler, check = self.zero_loss_scaling(stage0=True)
        accum = self.grad_accum_dtype
        self.mixed = MixedPrecisionOptimizer(optimizer, self.model_dtype, scaler,
                                             clip_grad=self.config.gradient_clipping, check_overflow=check,
                                             sync_overflow=sync_overflow, grad_accum_dtype=accum,
                                             norm_across_ranks=norm_across_ranks, graph_harvesting=harvest)
        return self.mixed

    def zero_loss_scaling(self, stage0: bool = False) -> tuple[Optional[LossScalerBase], bool]:
        """(loss scaler, check overflow) for the configured 16-bit dtype; (None, False) in fp32. stage0: the
        scaler of DeepSpeed's stage-0 fp16 optimizers (FP16_Optimizer / FP16_UnfusedOptimizer), which halves at
        every overflow (they take no `hysteresis`) and keeps skipping at the minimum scale; otherwise the ZeRO
        optimizers' scaler (hysteresis, and an error on an overflow at the minimum scale)."""
        if not self.low_precision:
            return None, False
        if self.model_dtype == torch.float16:
            dynamic = self.fp16.loss_scale == 0
            args = self.fp16.dynamic_loss_scale_args()
            if stage0:
                args.update({DELAYED_SHIFT: 1, "raise_error_at_min_scale": False})
            scaler = CreateLossScaler(torch.float16, self.fp16.loss_scale, dynamic, args if dynamic else None)
            kind = "dynamic loss scale" if dynamic else f"static loss scale: {scaler.cur_scale}"
            logger.info(f"Creating fp16 optimizer with {kind}")
            check = True
        else:
            scaler = CreateLossScaler(torch.bfloat16, 1.0, False, None)
            logger.info("Creating BF16 optimizer")
            check = bool(self.bf16.check_grad_overflow)
        return scaler, check

    def set_scaling_owner(self, owner: Any) -> None:
        """The optimizer whose cur_scale / note_backward_scale the loss scaling uses (ZeRO's, when it
        owns the masters)."""
        if self.low_precision:
            self.mixed = owner

    @property
    def needs_scaler(self) -> bool:
        """Whether gradients must come from a scaled loss (fp16, or fp16 torch autocast)."""
        return self.model_dtype == torch.float16 or self.grad_scaler is not None

    def loss_scale(self) -> float:
        if self.mixed is not None:
            return self.mixed.cur_scale
        if self.grad_scaler is not None:
            return float(self.grad_scaler.get_scale())
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.mixed is not None and self.model_dtype == torch.float16:
            scale = self.mixed.cur_scale
            self.mixed.note_backward_scale(scale)
            return loss * scale
        if self.grad_scaler is not None:
            return self.grad_scaler.scale(loss)
        return loss

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """Forward under the configured torch_autocast, overriding (or disabling) an outer one."""
        if self.autocast_enabled:
            with torch.autocast(device_type=device_type, dtype=self.autocast_dtype, enabled=True):
                yield
        elif torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type=device_type, enabled=False):
                yield
        else:
            yield

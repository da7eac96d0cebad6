"""Mixed precision, as a collaborator of the engine.

`Precision` decides from the config how parameters are stored (fp32, fp16, bf16), how the loss is
scaled, and whether forward runs under torch.autocast. For fp16 and bf16 it wraps the optimizer
in `MixedPrecisionOptimizer`: the optimizer steps fp32 master copies of the 16-bit parameters,
gradients are unscaled and clipped on the masters, overflowing steps are skipped (fp16: the
dynamic loss scaler lowers the scale, DeepSpeed's message is logged), and updated masters are
copied back into the 16-bit parameters."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from deepspeed_c.runtime.config.utils import parse_dtype
from deepspeed_c.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler, LossScalerBase
from deepspeed_c.runtime.grad_norm import global_norm, scale_
from deepspeed_c.runtime.fused_epilogue import AdamEpilogue, device_global_norm
from deepspeed_c.runtime.optimizer_seam import EngineOptimizer, SavedCheckpoint, load_rank_file_of, rank_file_of
from deepspeed_c.runtime.step_sequence import StepOutcome, overflow_checked_step
from deepspeed_c.utils.logging import logger


class Fp32AccumulatorSlots:
    """The stage-0 reducer's gradient source and sink for fp32 accumulation (DeepSpeed's
    BF16_Optimizer): it reduces the fp32 accumulators, not the 16-bit param.grad (which the fold
    hooks free), and writes the averaged sums back into them, as DeepSpeed's engine all-reduces the
    grads its BF16_Optimizer hands it for reduction (cast to communication_data_type on the wire)."""

    def __init__(self, owner: "MixedPrecisionOptimizer") -> None:
        self.owner = owner
        self.index = {id(p): k for k, p in enumerate(owner._lp_flat)}

    def read(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        k = self.index[id(param)]
        self.owner._fold(k, param)  # no-op when the fold hook already ran
        return self.owner._grad_buffers[k]

    @torch.no_grad()
    def write(self, param: torch.nn.Parameter, reduced: torch.Tensor) -> None:
        k = self.index[id(param)]
        buf = self.owner._grad_buffers[k]
        if buf is None:
            self.owner._grad_buffers[k] = reduced.detach().to(torch.float32).view(param.shape).clone()
        else:
            buf.copy_(reduced.view_as(buf))


class MixedPrecisionOptimizer(EngineOptimizer):
    """Steps fp32 master weights for 16-bit model parameters (DeepSpeed's FP16 optimizer role).

    The wrapped optimizer's param groups are rewired to the masters, so schedulers and
    `param_groups[i]["lr"]` keep working through this object."""

    def __init__(self, optimizer: torch.optim.Optimizer, low_precision_dtype: torch.dtype,
                 loss_scaler: LossScalerBase, clip_grad: float = 0.0, check_overflow: bool = True,
                 sync_overflow: Optional[Callable[[bool], bool]] = None,
                 grad_accum_dtype: Optional[torch.dtype] = None,
                 norm_across_ranks: Optional[Callable[[Any], Any]] = None) -> None:
        self.optimizer = optimizer
        # MoE: ranks hold different experts, so their norms differ; DeepSpeed averages them over the ranks
        self.norm_across_ranks = norm_across_ranks
        # agrees on overflow across data-parallel ranks, so every rank skips the same steps
        self.sync_overflow = sync_overflow
        self.low_precision_dtype = low_precision_dtype
        self.loss_scaler = loss_scaler
        self.clip_grad = clip_grad
        self.check_overflow = check_overflow
        self.overflow = False
        self.cur_iter = 0  # steps taken or skipped (DeepSpeed's FP16 optimizers checkpoint it)
        self._global_grad_norm: Optional[float] = None
        self.lp_groups: list[list[torch.nn.Parameter]] = []
        self.fp32_groups: list[list[torch.nn.Parameter]] = []
        for group in optimizer.param_groups:
            lp = list(group["params"])
            masters = [torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad) for p in lp]
            self.lp_groups.append(lp)
            self.fp32_groups.append(masters)
            group["params"] = masters
        self._lp_flat = [p for g in self.lp_groups for p in g]
        self._master_flat = [p for g in self.fp32_groups for p in g]
        # DeepSpeed's two stage-0 paths: gradients accumulate in the model dtype on the parameters
        # (FP16_Optimizer; the fp32 copies exist only inside step()), or in fp32 buffers that every
        # micro-step's gradient is folded into as soon as autograd has accumulated it (BF16_Optimizer,
        # data_types.grad_accum_dtype "fp32")
        self.grad_accum_dtype = grad_accum_dtype or low_precision_dtype
        self.accumulate_fp32 = self.grad_accum_dtype == torch.float32 and low_precision_dtype != torch.float32
        self._grad_buffers: list[Optional[torch.Tensor]] = [None] * len(self._master_flat)
        self._hooks: list[Any] = []
        device = self._master_flat[0].device if self._master_flat else torch.device("cpu")
        self.epilogue = AdamEpilogue.for_optimizer(optimizer, device)
        if self.accumulate_fp32:
            for k, p in enumerate(self._lp_flat):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._fold_hook(k)))

    def _fold_hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def fold(p: torch.Tensor) -> None:
            self._fold(k, p)
        return fold

    @torch.no_grad()
    def _fold(self, k: int, p: torch.Tensor) -> None:
        """Adds the parameter's fresh 16-bit gradient into its fp32 accumulator and frees it."""
        if p.grad is None:
            return
        buf = self._grad_buffers[k]
        if buf is None:
            buf = self._grad_buffers[k] = torch.zeros_like(self._master_flat[k])
        buf.add_(p.grad.detach().view_as(buf))
        p.grad = None

    def reduction_slots(self) -> Optional["Fp32AccumulatorSlots"]:
        """Where the data-parallel reducer reads and writes gradients: the fp32 accumulators when
        gradients accumulate in fp32 (None: param.grad)."""
        return Fp32AccumulatorSlots(self) if self.accumulate_fp32 else None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the optimizer face ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return isinstance(self.loss_scaler, DynamicLossScaler)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._lp_flat:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
        for m in self._master_flat:
            m.grad = None
        if self.accumulate_fp32:
            for buf in self._grad_buffers:
                if buf is not None:
                    buf.zero_()

    def _gather_master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients on the masters for this step. In model-dtype accumulation they are fresh
        up-casts, dropped after the step (no fp32 gradient bytes live between micro-steps)."""
        if self.accumulate_fp32:
            out = []
            for k, (lp, master) in enumerate(zip(self._lp_flat, self._master_flat)):
                if lp.grad is not None:  # a gradient set outside backward (e.g. zeros for an unused parameter)
                    self._fold(k, lp)
                master.grad = self._grad_buffers[k]
                if master.grad is not None:
                    out.append(master.grad)
            return out
        dst, src = [], []
        for lp, master in zip(self._lp_flat, self._master_flat):
            if lp.grad is None:
                master.grad = None
                continue
            master.grad = torch.empty_like(master)
            dst.append(master.grad)
            src.append(lp.grad.detach().view_as(master.grad))
        if dst:
            torch._foreach_copy_(dst, src)
        return dst

    def step(self, closure: Any = None) -> bool:
        """Returns True when the step was skipped for overflow (DeepSpeed's convention)."""
        fused = self._fused_inputs() if self.epilogue is not None else None
        if fused is not None:
            grads, masters, outs = fused
            flat = [g for gs in grads for g in gs]
            norm: Any = device_global_norm(flat) if flat else 0.0

            def apply_fused(norm_t: torch.Tensor, loss_scale: float) -> None:
                assert self.epilogue is not None
                self.epilogue.step(grads, outs, norm_t, loss_scale, self.clip_grad, params=masters)

            if self.norm_across_ranks is not None:
                norm = self.norm_across_ranks(norm)
            outcome = self._decide(norm, apply_fused=apply_fused, apply_coef=lambda coef: None)
        else:
            master_grads = self._gather_master_grads()

            def apply_coef(coef: float) -> None:
                scale_(master_grads, coef)
                self.optimizer.step()
                self._copy_masters_to_model()

            norm = float(global_norm(master_grads)) if master_grads else 0.0
            if self.norm_across_ranks is not None:
                norm = self.norm_across_ranks(norm)
            outcome = self._decide(norm, apply_coef=apply_coef)
        self.overflow = outcome.skipped
        self._global_grad_norm = outcome.grad_norm
        self.cur_iter += 1
        if outcome.skipped:
            self.zero_grad(set_to_none=True)
            return True
        for m in self._master_flat:
            m.grad = None
        if self.accumulate_fp32:
            for buf in self._grad_buffers:
                if buf is not None:
                    buf.zero_()
        return False

    def _decide(self, norm: Any, **apply: Any) -> StepOutcome:
        return overflow_checked_step(norm, check_overflow=self.check_overflow, sync_overflow=self.sync_overflow,
                                     loss_scaler=self.loss_scaler, grad_scale=lambda: self._scale_used,
                                     clip_grad=self.clip_grad, **apply)

    def _fused_inputs(self) -> Optional[tuple[list[list[torch.Tensor]], ...]]:
        """Per group: the gradients (16-bit param.grad, or the fp32 accumulators), their masters and
        model parameters; None when a tensor is not contiguous (the separate passes handle it)."""
        grads, masters, outs = [], [], []
        k = 0
        for lps, ms in zip(self.lp_groups, self.fp32_groups):
            gs, mm, oo = [], [], []
            for lp, m in zip(lps, ms):
                if self.accumulate_fp32:
                    self._fold(k, lp)
                    g = self._grad_buffers[k]
                else:
                    g = lp.grad
                k += 1
                if g is None:
                    continue
                if not (g.is_contiguous() and lp.is_contiguous()):
                    return None
                gs.append(g)
                mm.append(m)
                oo.append(lp.data)
            grads.append(gs)
            masters.append(mm)
            outs.append(oo)
        return grads, masters, outs

    @property
    def _scale_used(self) -> float:
        return getattr(self, "_backward_scale", self.loss_scaler.cur_scale)

    def note_backward_scale(self, scale: float) -> None:
        """The scale the current gradients were produced with (set by Precision.scale_loss)."""
        self._backward_scale = scale

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        torch._foreach_copy_([p.data for p in self._lp_flat], [m.data for m in self._master_flat])

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's FP16_UnfusedOptimizer fields (dynamic_loss_scale, cur_scale, cur_iter, and with
        dynamic scaling last_overflow_iter/scale_factor/scale_window; optimizer_state_dict; fp32_groups),
        which DeepSpeed's stage-0 fp16/bf16 loader reads, plus deepspeed_c's loss_scaler/overflow/clip_grad."""
        out = {
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "cur_scale": self.loss_scaler.cur_scale,
            "cur_iter": self.cur_iter,
        }
        if self.dynamic_loss_scale:
            out.update(last_overflow_iter=self.loss_scaler.last_overflow_iter,
                       scale_factor=self.loss_scaler.scale_factor, scale_window=self.loss_scaler.scale_window)
        out.update({
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_groups": [[m.detach().clone() for m in g] for g in self.fp32_groups],
            "loss_scaler": self.loss_scaler.state_dict(),
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
        })
        return out

    # -- checkpoint seam (runtime/optimizer_seam.EngineOptimizer) --------------------------------
    def model_param_groups(self) -> list[list[torch.nn.Parameter]]:
        return [list(g) for g in self.lp_groups]

    def master_params(self) -> dict[int, torch.nn.Parameter]:
        return {id(lp): m for lp, m in zip(self._lp_flat, self._master_flat)}

    def load_checkpoint_state(self, saved: SavedCheckpoint, load_optimizer_states: bool) -> None:
        from deepspeed_c.checkpoint.deepspeed_format import normalize_mixed_state

        state = saved.model_state.get("optimizer")
        if state is not None and load_optimizer_states:
            self.load_state_dict(normalize_mixed_state(state), load_optimizer_states=True)
        else:
            self.refresh_masters()

    def rank_checkpoint_file(self) -> Optional[tuple[str, dict]]:
        return rank_file_of(self.optimizer)

    def load_rank_checkpoint_file(self, saved: SavedCheckpoint) -> None:
        load_rank_file_of(self.optimizer, saved)
        self._copy_masters_to_model()  # a rank file may hold this rank's own masters (0/1 Adam's local steps)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        for lps, masters in zip(self.lp_groups, self.fp32_groups):
            for lp, m in zip(lps, masters):
                m.copy_(lp.detach().to(m.dtype))

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.cur_iter = int(state_dict.get("cur_iter", self.cur_iter))
        self.overflow = state_dict.get("overflow", False)
        self.clip_grad = state_dict.get("clip_grad", self.clip_grad)
        with torch.no_grad():
            for group, saved in zip(self.fp32_groups, state_dict["fp32_groups"]):
                for master, value in zip(group, saved):
                    master.copy_(value)
        self._copy_masters_to_model()

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.low_precision_dtype}, {self.optimizer!r})"


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

    @property
    def low_precision(self) -> bool:
        return self.model_dtype in (torch.float16, torch.bfloat16)

    def cast_module(self, module: torch.nn.Module) -> None:
        """Floating parameters to the model dtype; buffers only when data_types.buffer_dtype says so."""
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
        if optimizer is None or not self.low_precision:
            return optimizer
        if zero_owns_masters:
            return optimizer
        scaler, check = self.zero_loss_scaling()
        accum = self.grad_accum_dtype
        self.mixed = MixedPrecisionOptimizer(optimizer, self.model_dtype, scaler,
                                             clip_grad=self.config.gradient_clipping, check_overflow=check,
                                             sync_overflow=sync_overflow, grad_accum_dtype=accum,
                                             norm_across_ranks=norm_across_ranks)
        return self.mixed

    def zero_loss_scaling(self) -> tuple[Optional[LossScalerBase], bool]:
        """(loss scaler, check overflow) for the configured 16-bit dtype; (None, False) in fp32."""
        if not self.low_precision:
            return None, False
        if self.model_dtype == torch.float16:
            dynamic = self.fp16.loss_scale == 0
            scaler = CreateLossScaler(torch.float16, self.fp16.loss_scale, dynamic,
                                      self.fp16.dynamic_loss_scale_args() if dynamic else None)
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

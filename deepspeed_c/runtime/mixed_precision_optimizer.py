"""The mixed-precision optimizer of stage 0 (DeepSpeed's FP16_Optimizer / BF16_Optimizer role): the
wrapped optimizer steps fp32 master copies of the 16-bit parameters; gradients are unscaled and
clipped on the masters, overflowing steps are skipped (fp16: the dynamic loss scaler lowers the
scale, DeepSpeed's message is logged), and updated masters are copied back into the 16-bit
parameters. runtime/precision.Precision decides from the config when to build one."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from deepspeed_c.runtime.fp16.loss_scaler import DynamicLossScaler, LossScalerBase
from deepspeed_c.runtime.fp32_grad_accumulators import Fp32AccumulatorSlots
from deepspeed_c.runtime.fused_epilogue import AdamEpilogue, device_global_norm
from deepspeed_c.runtime.grad_norm import global_norm, scale_
from deepspeed_c.runtime.optimizer_seam import EngineOptimizer, SavedCheckpoint, load_rank_file_of, rank_file_of
from deepspeed_c.runtime.step_sequence import StepOutcome, overflow_checked_step

__all__ = ["MixedPrecisionOptimizer"]


class MixedPrecisionOptimizer(EngineOptimizer):
    """Steps fp32 master weights for 16-bit model parameters (DeepSpeed's FP16 optimizer role).

    The wrapped optimizer's param groups are rewired to the masters, so schedulers and
    `param_groups[i]["lr"]` keep working through this object."""

    def __init__(self, optimizer: torch.optim.Optimizer, low_precision_dtype: torch.dtype,
                 loss_scaler: LossScalerBase, clip_grad: float = 0.0, check_overflow: bool = True,
                 sync_overflow: Optional[Callable[[bool], bool]] = None,
                 grad_accum_dtype: Optional[torch.dtype] = None,
                 norm_across_ranks: Optional[Callable[[Any], Any]] = None, graph_harvesting: bool = False) -> None:
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
        # the fp32 accumulators (unused, all None, in model-dtype accumulation)
        self.accumulators = Fp32AccumulatorSlots(self._lp_flat, self._master_flat, hook=self.accumulate_fp32)
        device = self._master_flat[0].device if self._master_flat else torch.device("cpu")
        self.epilogue = AdamEpilogue.for_optimizer(optimizer, device)
        self._launched: list = []  # the epilogue counters of the harvested step's launch
        self.harvest = self._harvest(graph_harvesting)
        from deepspeed_c.runtime.optimizer_roles import deepspeed_role

        # the class DeepSpeed's engine would have built here, which its names answer isinstance from
        self.deepspeed_role = deepspeed_role(optimizer, low_precision_dtype, self.grad_accum_dtype)

    def _harvest(self, on: bool) -> Optional[Any]:
        """graph_harvesting's recorded step (runtime/graph_harvesting.py), where this step can be one."""
        if not on:
            return None
        from deepspeed_c.runtime import graph_harvesting

        if self.epilogue is None:
            graph_harvesting.no_effect("the recorded step is the fused epilogue's, which needs a CUDA device and "
                                       "Adam/AdamW/FusedAdam")
        elif self.norm_across_ranks is not None:
            graph_harvesting.no_effect("the host reduces the gradient norm across ranks between the norm and the "
                                       "update (MoE's experts differ per rank)")
        else:
            return graph_harvesting.HarvestedStep()
        return None

    @property
    def _grad_buffers(self) -> list[Optional[torch.Tensor]]:
        """The accumulators by their former name (tests read them)."""
        return self.accumulators.buffers

    def reduction_slots(self) -> Optional[Fp32AccumulatorSlots]:
        """Where the data-parallel reducer reads and writes gradients: the fp32 accumulators when
        gradients accumulate in fp32 (None: param.grad)."""
        return self.accumulators if self.accumulate_fp32 else None

    def remove_hooks(self) -> None:
        self.accumulators.remove_hooks()

    # -- the optimizer face ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        # the wrapped optimizer's own list, refilled: its attribute is its to bind
        self.optimizer.param_groups[:] = list(value)

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

    @property
    def loss_scale_config(self) -> Any:
        """DeepSpeed 0.19.8's LossScaleConfig fields, read live."""
        from deepspeed_c.runtime.fp16.loss_scale_view import LossScaleView

        return LossScaleView(self)

    # -- DeepSpeed's BF16_Optimizer names a client's own backward pass calls (Megatron-DeepSpeed's zero-bubble
    # passes, when the PipelineEngine's using_bf16_optimizer says so: fp32 accumulation) --------------------------
    def clear_lp_grads(self) -> None:
        """Drops the 16-bit gradients on the parameters (every one autograd produced is folded already)."""
        for p in self._lp_flat:
            p.grad = None

    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        """Folds the 16-bit gradients on the parameters (one a client wrote straight into param.grad) into the
        fp32 accumulators. They are freed whatever `clear_lp_grads` says: a kept one would be folded again."""
        if not self.accumulate_fp32:
            raise RuntimeError("update_hp_grads needs fp32 gradient accumulation (bf16 at ZeRO stage 0)")
        for k in range(len(self._lp_flat)):
            self.accumulators.fold(k)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.harvest is not None:  # the recorded step reads the gradients where they are: zeroed in place
            set_to_none = False      # (DeepSpeed's harvesting asserts the same)
        for p in self._lp_flat:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
        for m in self._master_flat:
            m.grad = None
        if self.accumulate_fp32:
            self.accumulators.zero_()

    def _gather_master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients on the masters for this step. In model-dtype accumulation they are fresh
        up-casts, dropped after the step (no fp32 gradient bytes live between micro-steps)."""
        if self.accumulate_fp32:
            out = []
            for k, master in enumerate(self._master_flat):
                master.grad = self.accumulators.folded(k)
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
        if fused is not None and self.harvest is not None:
            return self._harvested_step(*fused)
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
            self.accumulators.zero_()
        return False

    def _harvested_step(self, grads: list[list[torch.Tensor]], masters: list[list[torch.Tensor]],
                        outs: list[list[torch.Tensor]]) -> bool:
        """graph_harvesting: the norm and the epilogue as one device launch, replayed from its CUDA graph while its
        key holds. The overflow check (bf16's check_grad_overflow) needs no host decision between the two: the
        epilogue skips a non-finite step on the device, and the host reads the norm once after the launch to
        keep its own books (skipped step, loss scaler)."""
        assert self.epilogue is not None and self.harvest is not None
        epilogue = self.epilogue
        flat = [g for gs in grads for g in gs]
        if self.loss_scaler is not None and not self.check_overflow:
            self.loss_scaler.update_scale(False)
        scale = self._scale_used
        key = (tuple(t.data_ptr() for t in flat), tuple(t.data_ptr() for ts in outs for t in ts),
               tuple(t.data_ptr() for ts in masters for t in ts), scale, self.clip_grad,
               epilogue.replay_key(masters, scale, self.clip_grad))

        def launch() -> torch.Tensor:
            norm = device_global_norm(flat) if flat else torch.zeros(1, device=self._master_flat[0].device)
            self._launched = epilogue.launch(grads, outs, norm, scale, self.clip_grad, params=masters)
            return norm

        norm = self.harvest.run(key, launch)
        if self.check_overflow and self._harvested_overflow(norm):
            self.overflow = True
            self._global_grad_norm = None
            self.cur_iter += 1
            self.zero_grad()  # in place: the recorded step reads the gradients where they are
            return True
        for counters in self._launched:
            counters.advance()
        self.overflow = False
        self._global_grad_norm = norm.reshape(-1)[0] / scale
        self.cur_iter += 1
        for m in self._master_flat:
            m.grad = None
        if self.accumulate_fp32:
            self.accumulators.zero_()
        return False

    def _harvested_overflow(self, norm: torch.Tensor) -> bool:
        """Whether the launched step overflowed (its kernels then skipped it on the device and left the device step
        counters alone); updates the loss scaler as the eager check does."""
        overflow = not math.isfinite(float(norm.reshape(-1)[0]))
        if self.sync_overflow is not None:
            agreed = self.sync_overflow(overflow)
            if agreed != overflow:  # stage 0 reduces the gradients first, so every rank sees the same norm
                raise RuntimeError("graph_harvesting: ranks disagree on the gradient overflow of this step (this "
                                   f"rank's norm is {'not ' if not overflow else ''}finite); the device already "
                                   "applied its own decision")
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
        return overflow

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
                    g = self.accumulators.folded(k)
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

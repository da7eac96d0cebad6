"""DeepSpeedCPUAdam: Adam/AdamW for host parameters on the C core (AVX-512/AVX2 + OpenMP)."""
from __future__ import annotations

import functools
from typing import Any, Iterable, Optional, Sequence

import torch

from deepspeed_c.ops.cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPUAdam(CPUOptimizerBase):
    """Adam (adamw_mode=False: weight decay added to the gradient, as torch.optim.Adam) or AdamW
    (adamw_mode=True, the default: decoupled weight decay, as torch.optim.AdamW) for parameters in
    host memory, stepped by a C kernel (AVX-512/AVX2/scalar, OpenMP) in one pass over memory.

    Parameters may be float32, bfloat16 or float16; states are float32 unless
    fp32_optimizer_states=False (then the parameter's dtype). The state dict is torch's
    (`step`, `exp_avg`, `exp_avg_sq`), so torch.optim.Adam/AdamW states load here and back.
    `step(closure=None, fp16_param_groups=None)`: fp16_param_groups (a list per param group,
    matching its params) receive the updated parameters in their own dtype in the same pass, the
    ZeRO-Offload hot path; see also `cpu_adam_step` for flat tensors. amsgrad is not supported."""

    MOMENTS = ("exp_avg", "exp_avg_sq")
    OP_BUILDER = "CPUAdamBuilder"
    FOLDS_GRAD_SCALE = True  # the C kernel multiplies the gradient by step_tensors' grad_scale itself
    optimizer_id = 0

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self.adam_w_mode = adamw_mode

    def _kernel(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]], step: int,
                grad_scale: float = 1.0) -> None:
        beta1, beta2 = group["betas"]
        self.ds_opt_op.adam_step(params, grads, moments[0], moments[1], copies, float(group["lr"]), float(beta1),
                                 float(beta2), float(group["eps"]), float(group["weight_decay"]), step,
                                 int(bool(group.get("bias_correction", True))), int(bool(self.adam_w_mode)),
                                 float(grad_scale))


    def step_tensors_into(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                          moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]],
                          out_params: list[torch.Tensor], out_moments: list[list[torch.Tensor]], step: int,
                          grad_scale: float = 1.0) -> None:
        """step_tensors writing the updated params and moments into `out_params` / `out_moments` (same dtypes and
        sizes) and leaving the inputs as they were: SuperOffload's speculative step, whose rollback is then free.
        grad_scale: as step_tensors'."""
        beta1, beta2 = group["betas"]
        self.ds_opt_op.adam_step_into(params, grads, moments[0], moments[1], copies, out_params, out_moments[0],
                                      out_moments[1], float(group["lr"]), float(beta1), float(beta2),
                                      float(group["eps"]), float(group["weight_decay"]), step,
                                      int(bool(group.get("bias_correction", True))), int(bool(self.adam_w_mode)),
                                      float(grad_scale))

    # -- SuperOffload's per-sub-group API (DeepSpeed's names; its tests call them) --------------------------
    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Optional[Any] = None) -> Any:
        """One step of every parameter with a gradient, its state kept under the key `subgroup_id` (DeepSpeed's
        SuperOffload holds one flat fp32 sub-group per optimizer, so the state is the sub-group's); the step
        count is a plain int there, as DeepSpeed's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self._check(p, f"params[{gi}][{pi}]")
                state = self.state[subgroup_id]
                if len(state) == 0:
                    state["step"] = 0
                    for key in self.MOMENTS:
                        state[key] = torch.zeros_like(p, dtype=self._state_dtype(p),
                                                      memory_format=torch.contiguous_format)
                state["step"] += 1
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                self._kernel(group, [p.detach()], [grad], [[state["exp_avg"]], [state["exp_avg_sq"]]], None,
                             int(state["step"]))
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Optional[Any] = None) -> Any:
        """Undoes the last step_subgroup of `sub_group_id` from its gradient (still in .grad): the parameter and
        moments recomputed by inverting the update in float64 (exact up to rounding; SuperOffload's own
        speculative step restores a snapshot instead, bit for bit)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if sub_group_id not in self.state or len(self.state[sub_group_id]) == 0:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} "
                               f"as it has not been initialized.")
        state = self.state[sub_group_id]
        if state.get("step", 0) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                adam_inverse(p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"], group, int(state["step"]),
                              self.adam_w_mode)
                state["step"] -= 1
        return loss


def adam_inverse(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict[str, Any],
                  step: int, adamw_mode: bool) -> None:
    """p, m, v as they were before the Adam step number `step` that took `grad` (in place)."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    bc1 = bc2 = 1.0
    if group.get("bias_correction", True):
        bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    p64, g, m1, v1 = p.double(), grad.double(), m.double(), v.double()
    denom = v1.sqrt() / (bc2 ** 0.5) + eps
    p0 = p64 + (lr / bc1) * m1 / denom
    if adamw_mode:
        p0 = p0 / (1.0 - lr * wd)
    elif wd != 0.0:
        g = g + wd * p0
    m.copy_((m1 - (1.0 - beta1) * g) / beta1)
    v.copy_(((v1 - (1.0 - beta2) * g * g) / beta2).clamp_(min=0.0))
    p.copy_(p0)


def cpu_adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                  exp_avg_sqs: Sequence[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float, step: int, bias_correction: bool = True, adamw_mode: bool = True,
                  copies: Optional[Sequence[torch.Tensor]] = None, simd: Optional[str] = None,
                  grad_scale: float = 1.0) -> None:
    """One Adam step over tensor lists in one pass over memory: the ZeRO-Offload hot path.

    params: the fp32 master (typically one flat partition per group), updated in place.
    grads: fp32, bf16 or fp16, read directly (no up-cast buffer).
    exp_avgs, exp_avg_sqs: fp32 (DeepSpeed's default), or bf16 beside fp32 params (about 20
        bytes per parameter per step instead of 28), updated in place.
    copies: optional contiguous host tensors (bf16/fp16, or fp32) that receive the updated
        params in their own dtype in the same pass: the model's low-precision weights.
    step: the 1-based step count after this update (bias correction).
    simd: force a narrower SIMD path ("avx2", "scalar"); default the widest this CPU runs.
    grad_scale: every gradient is multiplied by it (in fp32, as grad.float() * grad_scale) inside the
        kernel, so a loss-scale / clip coefficient costs no scaled copy of the gradient; the grads are
        left as they were.
    Every list must have the same length and matching element counts; wrong dtypes, devices,
    non-contiguous or overlapping tensors raise naming the argument and index."""
    _adam_op(simd).adam_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                             None if copies is None else list(copies), float(lr), float(betas[0]),
                             float(betas[1]), float(eps), float(weight_decay), int(step),
                             int(bool(bias_correction)), int(bool(adamw_mode)), float(grad_scale))


@functools.lru_cache(maxsize=None)
def _adam_op(simd: Optional[str]):
    # load() hashes the sources to find the cached build; once per process is enough
    from deepspeed_c.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder(simd=simd).load()

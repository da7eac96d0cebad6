"""The one-pass optimizer epilogue on the training path (CUDA; Adam, AdamW, FusedAdam).

A mixed-precision step done in separate passes reads and writes every parameter's state several
times: the 16-bit gradients up-cast into fp32 copies, scaled for unscaling and clipping, the Adam
kernel, then the fp32 masters cast back into the 16-bit weights (about 50 bytes per parameter).
The fused epilogue kernel (csrc/cuda/epilogue.cu) does it in one pass from the 16-bit (or fp32)
gradients: unscale, DeepSpeed's clip rule from the global norm, skip on inf/nan, AdamW on the fp32
masters and moments, and the write-back of the 16-bit weights (28 bytes per parameter). The global
norm comes from the C multi-tensor l2norm and stays on the device: a bf16 step never waits for the
host. Both the plain mixed-precision optimizer and ZeRO 1/2 call it when their optimizer is one of
these; everything else keeps the separate passes.

Optimizer state stays in torch's format (exp_avg / exp_avg_sq fp32, a 0-dim float32 CPU `step` per
parameter), so checkpoints and torch.optim.AdamW interchange as before. The kernel counts steps in
a device tensor per param group; the host counters follow it (they are views of one flat tensor per
group, advanced by one add), and the device counter is rebuilt from them whenever a state dict was
loaded or the counters were changed from outside. DSC_FUSED_EPILOGUE=0 turns the path off (for
before/after measurements)."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_w_mode_of(optimizer: torch.optim.Optimizer) -> Optional[bool]:
    """True (AdamW) / False (Adam with L2 decay) for the optimizers the epilogue implements, else None."""
    from deepspeed_c.ops.adam.fused_adam import FusedAdam

    if isinstance(optimizer, FusedAdam):
        return bool(optimizer.adam_w_mode)
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
            return None
        if isinstance(group.get("lr"), torch.Tensor) or isinstance(group.get("betas", (0,))[0], torch.Tensor):
            return None
    if type(optimizer) is torch.optim.AdamW:
        return True
    return bool(optimizer.param_groups[0].get("decoupled_weight_decay", False)) if optimizer.param_groups else False


class _GroupCounters:
    """One param group's step counters: host views of one flat CPU tensor, and the device copy."""

    def __init__(self, states: Sequence[dict[str, Any]], device: torch.device) -> None:
        values = [float(s["step"]) if "step" in s else 0.0 for s in states]
        if values and min(values) != max(values):
            raise RuntimeError("fused epilogue: the parameters of one group have different step counts "
                               f"({min(values)} .. {max(values)})")
        start = values[0] if values else 0.0
        self.host = torch.full((len(states),), start, dtype=torch.float32)
        for i, s in enumerate(states):
            s["step"] = self.host[i]
        self.ids = [id(s["step"]) for s in states]
        self.value = start
        self.device = torch.full((1,), start, dtype=torch.float32, device=device)

    def still_holds(self, states: Sequence[dict[str, Any]]) -> bool:
        if [id(s.get("step")) for s in states] != self.ids:
            return False
        return float(self.host[0]) == self.value if len(self.ids) else True

    def advance(self) -> None:
        """The kernel advanced the device counter: the host counters follow (they assume the step was taken:
        a skipped step, non-finite gradients without an overflow check, which DeepSpeed would have applied,
        is the one case they run ahead)."""
        self.host.add_(1.0)
        self.value += 1.0


class AdamEpilogue:
    """Steps an Adam/AdamW optimizer's groups with the fused epilogue kernel."""

    def __init__(self, optimizer: torch.optim.Optimizer, adam_w_mode: bool) -> None:
        self.optimizer = optimizer
        self.adam_w_mode = adam_w_mode
        self._counters: dict[int, _GroupCounters] = {}

    def reset(self) -> None:
        """Forget the device step counters (rebuilt from the host ones at the next step)."""
        self._counters = {}

    @staticmethod
    def for_optimizer(optimizer: Any, device: torch.device) -> Optional["AdamEpilogue"]:
        if device.type != "cuda" or os.environ.get("DSC_FUSED_EPILOGUE", "1") == "0":
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
        mode = adam_w_mode_of(optimizer)
        return None if mode is None else AdamEpilogue(optimizer, mode)

    def _states(self, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        out = []
        for p in params:
            state = self.optimizer.state[p]
            for key in _MOMENTS:
                if key not in state:
                    state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            out.append(state)
        return out

    def _counter(self, g: int, states: Sequence[dict[str, Any]], device: torch.device) -> _GroupCounters:
        counters = self._counters.get(g)
        if counters is None or not counters.still_holds(states):
            counters = self._counters[g] = _GroupCounters(states, device)
        return counters

    def _hyper(self, group: dict[str, Any], loss_scale: float, max_grad_norm: float) -> dict[str, Any]:
        """The kernel's hyperparameters from a param group (read every step: schedulers change them)."""
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adam_w_mode=self.adam_w_mode,
                    bias_correction=bool(group.get("bias_correction", True)), loss_scale=float(loss_scale),
                    max_grad_norm=float(max_grad_norm))

    @torch.no_grad()
    def step(self, grads: Sequence[Sequence[torch.Tensor]], out_params: Optional[Sequence[Sequence[torch.Tensor]]],
             grad_norm: torch.Tensor, loss_scale: float, max_grad_norm: float,
             found_inf: Optional[torch.Tensor] = None,
             params: Optional[Sequence[Sequence[torch.Tensor]]] = None) -> None:
        """grads[g][i] pairs with params[g][i] (default: param_groups[g]["params"]; same numel; 16-bit
        or fp32 gradients); out_params[g][i] receives its 16-bit copy. grad_norm: float32 device [1],
        the global norm of the scaled gradients; a non-finite norm (or found_inf != 0) skips the step
        on the device."""
        for counters in self.launch(grads, out_params, grad_norm, loss_scale, max_grad_norm, found_inf, params):
            counters.advance()

    @torch.no_grad()
    def launch(self, grads: Sequence[Sequence[torch.Tensor]], out_params: Optional[Sequence[Sequence[torch.Tensor]]],
               grad_norm: torch.Tensor, loss_scale: float, max_grad_norm: float,
               found_inf: Optional[torch.Tensor] = None,
               params: Optional[Sequence[Sequence[torch.Tensor]]] = None) -> list[_GroupCounters]:
        """step's kernels only (device work: a CUDA graph may record it); returns the counters of the groups
        stepped, whose host side the caller advances once per step taken (step does)."""
        from deepspeed_c.ops.cuda_multi_tensor import fused_adam_epilogue_

        launched = []
        for g, group in enumerate(self.optimizer.param_groups):
            params_g = group["params"] if params is None else params[g]
            if not params_g:
                continue
            states = self._states(params_g)
            counters = self._counter(g, states, params_g[0].device)
            fused_adam_epilogue_(
                [t.view(-1) for t in grads[g]], [p.view(-1) for p in params_g],
                [s["exp_avg"].view(-1) for s in states], [s["exp_avg_sq"].view(-1) for s in states],
                step=counters.device, grad_norm=grad_norm, found_inf=found_inf,
                model_params=None if out_params is None else [t.view(-1) for t in out_params[g]],
                **self._hyper(group, loss_scale, max_grad_norm))
            launched.append(counters)
        return launched

    def replay_key(self, params: Sequence[Sequence[torch.Tensor]], loss_scale: float, max_grad_norm: float) -> tuple:
        """What a recorded launch() depends on besides its tensors' addresses: every group's hyperparameters,
        its moments' and device step counter's addresses (new after a state dict was loaded)."""
        key: list[Any] = []
        for g, group in enumerate(self.optimizer.param_groups):
            params_g = params[g]
            if not params_g:
                continue
            states = self._states(params_g)
            counters = self._counter(g, states, params_g[0].device)
            hyper = self._hyper(group, loss_scale, max_grad_norm)
            key.append((tuple(sorted(hyper.items())), counters.device.data_ptr(),
                        tuple(s[k].data_ptr() for s in states for k in _MOMENTS)))
        return tuple(key)

    @torch.no_grad()
    def step_ranges(self, g: int, grad: torch.Tensor, ranges: Sequence[tuple[int, int]],
                    out_chunks: Sequence[Optional[torch.Tensor]], grad_norm: torch.Tensor, loss_scale: float,
                    max_grad_norm: float, after: Callable[[int], None]) -> None:
        """Group g holds one flat parameter (a ZeRO partition) and `grad` its gradient: steps it range by
        range ([start, end) tiling it), the 16-bit copy of range k going to out_chunks[k], and calls
        after(k) once range k is queued, so work on it (its all-gather) overlaps the next ranges."""
        from deepspeed_c.ops.cuda_multi_tensor import fused_adam_epilogue_

        group = self.optimizer.param_groups[g]
        (param,) = group["params"]
        (state,) = self._states([param])
        counters = self._counter(g, [state], param.device)
        hyper = self._hyper(group, loss_scale, max_grad_norm)
        flat = [param.detach().view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)]
        grad = grad.view(-1)
        # every range must read the count before this step; the kernel advances the counter it is given,
        # so all but the last range get a scratch copy of it
        scratch = torch.empty_like(counters.device) if len(ranges) > 1 else None
        for k, (start, end) in enumerate(ranges):
            step = counters.device
            if k < len(ranges) - 1:
                assert scratch is not None
                step = scratch.copy_(counters.device)
            p, m, v = (t[start:end] for t in flat)
            out = out_chunks[k]
            fused_adam_epilogue_([grad[start:end]], [p], [m], [v], step=step, grad_norm=grad_norm,
                                 model_params=None if out is None else [out.view(-1)], **hyper)
            after(k)
        counters.advance()


def device_global_norm(tensors: Sequence[torch.Tensor], group: Any = None, world_size: int = 1) -> torch.Tensor:
    """The L2 norm of every element of `tensors` on every rank of `group`: the C multi-tensor l2norm
    of the local tensors, one scalar all-reduce of its square. A float32 device tensor [1]."""
    from deepspeed_c.ops.cuda_multi_tensor import multi_tensor_l2norm

    norm, _, _ = multi_tensor_l2norm(list(tensors))
    if world_size <= 1:
        return norm
    sq = norm * norm
    import deepspeed_c.comm as dist

    dist.all_reduce(sq, group=group)
    return sq.sqrt_()

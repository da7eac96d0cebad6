"""What DeepSpeedCPUAdam, DeepSpeedCPUAdagrad and DeepSpeedCPULion share: a torch.optim.Optimizer
whose step hands each parameter group's tensors to one C call (per distinct step count), state in
torch's format (a float32 0-dim `step` tensor and moment tensors per parameter), and DeepSpeed's
`fp16_param_groups` argument, whose tensors receive the updated parameters in their own dtype in
the same pass over memory."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUOptimizerBase(torch.optim.Optimizer):
    MOMENTS: tuple[str, ...] = ()
    OP_BUILDER: str = ""  # class name in deepspeed_c.ops.op_builder

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool) -> None:
        if defaults.get("amsgrad"):
            raise ValueError(f"{type(self).__name__} does not support amsgrad=True; use torch.optim with "
                             f"amsgrad or set amsgrad=False")
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group.get("amsgrad"):
                raise ValueError(f"{type(self).__name__} does not support amsgrad=True (param group with amsgrad)")
        self.fp32_optimizer_states = fp32_optimizer_states
        from deepspeed_c.ops import op_builder

        self.ds_opt_op = getattr(op_builder, self.OP_BUILDER)().load()

    # subclasses: run the C kernel over one bucket of tensors that share a step count
    def _kernel(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]], step: int) -> None:
        raise NotImplementedError

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    def _prepare_state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(float(group.get("step", 0)), dtype=torch.float32)
            for key in self.MOMENTS:
                state[key] = torch.zeros_like(p, dtype=self._state_dtype(p), memory_format=torch.contiguous_format)
            return state
        step = state["step"]  # accept DeepSpeed's int step and torch's device/float64 variants
        if not torch.is_tensor(step) or step.device.type != "cpu" or step.dtype != torch.float32:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        for key in self.MOMENTS:
            m = state[key]
            want = m.dtype if m.dtype in (torch.float32, p.dtype) else self._state_dtype(p)
            if m.dtype != want or m.device != p.device or not m.is_contiguous():
                state[key] = m.to(device=p.device, dtype=want).contiguous()
        return state

    @staticmethod
    def _check(p: torch.Tensor, name: str) -> None:
        if p.device.type != "cpu":
            raise ValueError(f"{name} is on {p.device}; the CPU optimizers step host tensors (use FusedAdam/"
                             f"FusedLion for GPU parameters)")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} is {p.dtype}; supported: float32, bfloat16, float16")
        if not p.is_contiguous():
            raise ValueError(f"{name} is not contiguous; the CPU optimizers update parameters in place")
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"{name} has a sparse gradient, which the CPU optimizers do not support")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None,
             fp16_param_groups: Optional[Sequence[Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            copy_group = _copy_group(fp16_param_groups, gi, len(group["params"]))
            by_step: dict[int, list[int]] = {}
            entries = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self._check(p, f"params[{gi}][{pi}]")
                state = self._prepare_state(group, p)
                # a new tensor, not +=: a loaded state dict may share its step tensors with others
                state["step"] = state["step"] + 1
                by_step.setdefault(int(state["step"].item()), []).append(len(entries))
                entries.append((p, state, None if copy_group is None else copy_group[pi]))
            for step, idx in by_step.items():
                ps = [entries[i][0] for i in idx]
                grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps]
                moments = [[entries[i][1][k] for i in idx] for k in self.MOMENTS]
                copies = None if copy_group is None else [entries[i][2] for i in idx]
                self._kernel(group, ps, grads, moments, copies, step)
        return loss


def _copy_group(fp16_param_groups: Optional[Sequence[Any]], gi: int, n: int) -> Optional[list[torch.Tensor]]:
    """DeepSpeed passes fp16_param_groups as a list per param group (or one flat list for a single
    group); each entry matches the group's params one to one."""
    if fp16_param_groups is None:
        return None
    groups = fp16_param_groups
    if torch.is_tensor(groups[0]):
        groups = [groups]
    if gi >= len(groups):
        raise ValueError(f"fp16_param_groups has {len(groups)} groups; param group {gi} has none")
    copies = list(groups[gi]) if not torch.is_tensor(groups[gi]) else [groups[gi]]
    if len(copies) != n:
        raise ValueError(f"fp16_param_groups[{gi}] has {len(copies)} tensors; param group {gi} has {n} params")
    return copies

"""What DeepSpeedCPUAdam, DeepSpeedCPUAdagrad and DeepSpeedCPULion share: a torch.optim.Optimizer
whose step hands each parameter group's tensors to one C call (per distinct step count), state in
torch's format (a float32 0-dim `step` tensor and moment tensors per parameter), and DeepSpeed's
`fp16_param_groups` argument, whose tensors receive the updated parameters in their own dtype in
the same pass over memory (tensors on another device, such as the GPU copy of the model, are
written through a host staging buffer and copied over).

State dtypes: float32 (the default, fp32_optimizer_states=True), the parameter's dtype
(fp32_optimizer_states=False), or bfloat16 beside float32 parameters when the caller puts
bfloat16 moments into the state before the first step (the 20-bytes-per-parameter variant)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUOptimizerBase(torch.optim.Optimizer):
    MOMENTS: tuple[str, ...] = ()
    OP_BUILDER: str = ""  # class name in deepspeed_c.ops.op_builder
    FOLDS_GRAD_SCALE: bool = False  # whether _kernel takes grad_scale itself (else step_tensors scales a copy)

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool) -> None:
        if defaults.get("amsgrad"):
            raise ValueError(f"{type(self).__name__} does not support amsgrad=True; use torch.optim with "
                             f"amsgrad or set amsgrad=False")
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group.get("amsgrad"):
                raise ValueError(f"{type(self).__name__} does not support amsgrad=True (param group with amsgrad)")
        self.fp32_optimizer_states = fp32_optimizer_states
        self._ready: set[int] = set()  # id() of params whose state has been checked and converted
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
            want = m.dtype if m.dtype in _kernel_state_dtypes(p.dtype) else self._state_dtype(p)
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

    def _ready_state(self, group: dict[str, Any], p: torch.Tensor, name: str) -> dict[str, Any]:
        """p's state, checked and converted on first use (after construction, add_param_group,
        load_state_dict); later steps trust it, and the C binding still validates every tensor."""
        if id(p) in self._ready:
            state = self.state[p]
            if state:  # else the user reset it: start afresh
                return state
        self._check(p, name)
        state = self._prepare_state(group, p)
        self._ready.add(id(p))
        return state

    def set_fp32_optimizer_states(self, enabled: bool) -> None:
        """Whether states created from now on are float32 (True) or in the parameter's dtype; the engine
        switches an optimizer it built before the first step (bf16.bf16_optimizer_states under ZeRO-Offload)."""
        self.fp32_optimizer_states = enabled

    # -- what ZeRO-Offload and the NVMe swapper drive: they step a flat partition range by range ---------
    def ready_state(self, group: dict[str, Any], p: torch.Tensor, name: str) -> dict[str, Any]:
        """p's optimizer state, checked and converted to the kernel's layout on first use (see _ready_state)."""
        return self._ready_state(group, p, name)

    def step_tensors(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                     moments: list[list[torch.Tensor]], copies: Optional[list[torch.Tensor]], step: int,
                     grad_scale: float = 1.0) -> None:
        """One C kernel call over `params` (sharing step count `step`) with their gradients and moment
        tensors (one list per MOMENTS entry); `copies` receive the updated values in their own dtype.
        grad_scale: the gradients count multiplied by it (in fp32; the loss-scale and clip coefficient):
        inside the kernel where it takes one (FOLDS_GRAD_SCALE), else through a scaled fp32 copy."""
        if grad_scale == 1.0:
            self._kernel(group, params, grads, moments, copies, step)
        elif self.FOLDS_GRAD_SCALE:
            self._kernel(group, params, grads, moments, copies, step, grad_scale=grad_scale)
        else:
            scaled = [g.float().mul(grad_scale) for g in grads]
            scaled = [s if p.dtype == torch.float32 else s.to(p.dtype) for s, p in zip(scaled, params)]
            self._kernel(group, params, scaled, moments, copies, step)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None,
             fp16_param_groups: Optional[Sequence[Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            copy_group = _copy_group(fp16_param_groups, gi, len(group["params"]))
            idx = [pi for pi, p in enumerate(group["params"]) if p.grad is not None]
            if not idx:
                continue
            params = [group["params"][pi] for pi in idx]
            states = [self._ready_state(group, p, f"params[{gi}][{pi}]") for pi, p in zip(idx, params)]
            # in place, in one C call: ours alone, see __setstate__ and state_dict
            counts = self.ds_opt_op.bump_steps([st["step"] for st in states])
            by_step: dict[int, list[int]] = {}
            for j, count in enumerate(counts):
                by_step.setdefault(count, []).append(j)
            pending = dict(by_step)
            for step, js in by_step.items():
                ps = [params[j] for j in js]
                grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps]
                moments = [[states[j][k] for j in js] for k in self.MOMENTS]
                staged = None if copy_group is None else _stage([copy_group[idx[j]] for j in js])
                try:
                    self._kernel(group, ps, grads, moments, None if staged is None else staged[0], step)
                except Exception:
                    for left in pending.values():  # the buckets not stepped keep their step counts
                        for j in left:
                            states[j]["step"] -= 1
                    for j in js:  # name the parameter the way users index it, when that is the cause
                        self._check(params[j], f"params[{gi}][{idx[j]}]")
                    raise
                del pending[step]
                if staged is not None:
                    for dst, src in staged[1]:
                        dst.copy_(src, non_blocking=True)
        return loss

    # Steps are counted in place (a new tensor per parameter per step costs microseconds each),
    # so no step tensor of ours may be shared with another optimizer: torch's load_state_dict
    # keeps the step tensor objects it is given, in both directions, and torch counts in place.
    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also runs inside load_state_dict: loaded states are re-checked on their first step."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
        self._ready: set[int] = set()
        for st in self.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["state"] = {k: {**v, "step": v["step"].clone()} if torch.is_tensor(v.get("step")) else v
                       for k, v in sd["state"].items()}
        return sd


def _kernel_state_dtypes(param_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The moment dtypes the C kernels take beside a parameter of param_dtype."""
    if param_dtype == torch.float32:
        return (torch.float32, torch.bfloat16)
    return (torch.float32, param_dtype)


def _stage(copies: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Kernel-ready copy targets: each copy itself when it is a contiguous host tensor, else a
    host buffer (pinned when a GPU is present) whose contents go to the copy after the step."""
    ready, pending = [], []
    for c in copies:
        if c.device.type == "cpu" and c.is_contiguous():
            ready.append(c)
            continue
        pin = c.device.type != "cpu" and torch.cuda.is_available()
        buf = torch.empty(c.shape, dtype=c.dtype, pin_memory=pin)
        ready.append(buf)
        pending.append((c, buf))
    return ready, pending


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

"""What FusedAdam, FusedLamb and FusedLion share: optimizer state in torch's format (a 0-dim
float32 CPU `step` tensor per parameter, float32 moment tensors), steps counted per parameter
but launched per bucket of equal step, and state dicts that keep float32 moments on load
(torch casts loaded state to the parameter's dtype, which would round bf16 moments)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def init_state(state: dict[str, Any], group: dict[str, Any], p: torch.Tensor, moments: Sequence[str]) -> None:
    """Fresh state for p: the step count (a group-level 'step' from an older DeepSpeed
    checkpoint seeds it, as DeepSpeed does) and float32 zero moments."""
    state["step"] = torch.tensor(float(group.get("step", 0)), dtype=torch.float32)
    for key in moments:
        state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)


def normalize_state(state: dict[str, Any], p: torch.Tensor, moments: Sequence[str]) -> None:
    """Accepts state written by others: an int step (DeepSpeed), a device step tensor (torch's
    fused/capturable AdamW), moments in the parameter's dtype."""
    step = state["step"]
    if not torch.is_tensor(step):
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
    elif step.device.type != "cpu" or step.dtype != torch.float32:
        state["step"] = step.detach().to(device="cpu", dtype=torch.float32)
    for key in moments:
        m = state[key]
        if m.dtype != torch.float32 or m.device != p.device or not m.is_contiguous():
            state[key] = m.to(device=p.device, dtype=torch.float32).contiguous()


def advance_steps(states: Sequence[dict[str, Any]]) -> list[int]:
    """Adds 1 to every state's step (one foreach call) and returns the new values."""
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1.0)
    return [int(v) for v in torch.stack(steps).tolist()]


def bucket(keys: Iterable[Any]) -> dict[Any, list[int]]:
    """Positions grouped by key, keys in first-seen order (one kernel call per bucket)."""
    out: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return out


def check_param(p: torch.Tensor, grad: torch.Tensor, name: str,
                sparse_error: type[Exception] = RuntimeError, require_cuda: bool = True) -> None:
    if grad.is_sparse:
        raise sparse_error(f"{name} does not support sparse gradients")
    if p.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"{name} only support fp16, bf16 and fp32, got a {p.dtype} parameter")
    if require_cuda and p.device.type != "cuda":
        raise ValueError(f"{name} runs on CUDA tensors, got a parameter on {p.device}; use the CPU "
                         f"optimizers (DeepSpeedCPUAdam, DeepSpeedCPULion) for host parameters")


def check_cuda(p: torch.Tensor, name: str) -> None:
    if p.device.type != "cuda":
        raise ValueError(f"{name} runs on CUDA or host tensors, got a parameter on {p.device}")


def contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad if grad.is_contiguous() else grad.contiguous()


def launch_with_contiguous_retry(launch: Callable[[list[torch.Tensor]], Any], grads: list[torch.Tensor]) -> None:
    """launch(grads); the kernels need contiguous gradients, which they nearly always are, so the
    check is left to the binding and a refused launch is retried with contiguous copies."""
    try:
        launch(grads)
    except ValueError:
        if all(g.is_contiguous() for g in grads):
            raise
        launch([contiguous_grad(g) for g in grads])


def restore_fp32_moments(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any],
                         moments: Sequence[str]) -> None:
    """After torch's load_state_dict: re-take each moment from the saved tensor as float32 on the
    parameter's device, so moments saved in float32 are not rounded through the parameter dtype."""
    saved_state = state_dict.get("state", {})
    for saved_group, group in zip(state_dict.get("param_groups", []), optimizer.param_groups):
        for pid, p in zip(saved_group["params"], group["params"]):
            src = saved_state.get(pid)
            if not src or p not in optimizer.state:  # an empty entry (saved before any step) is no state
                continue
            dst = optimizer.state[p]
            for key in moments:
                if key in src and torch.is_tensor(src[key]) and src[key].is_floating_point():
                    dst[key] = src[key].to(device=p.device, dtype=torch.float32).contiguous()
            normalize_state(dst, p, moments)


def zero_grads(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    if set_to_none:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    else:
        torch.optim.Optimizer.zero_grad(optimizer, set_to_none=False)

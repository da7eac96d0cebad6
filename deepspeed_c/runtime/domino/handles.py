"""Where Domino waits for the all-reduce a backward launched: the pending handles of each half.

The asynchronous linear's backward starts the all-reduce of its input gradient and files the handle
under its half's key, then computes its weight (and bias) gradient while the all-reduce runs;
`_Wait_bwd_comm` sits on the linear's input in the forward, so its backward (the first op that reads
the reduced gradient) waits for the handles filed under that key. Autograd runs that wait node next
(it was created right before the linear, so it is the newest ready node), so in the backward the
all-reduce hides behind the weight-gradient GEMM, as in DeepSpeed's Domino; the other half's compute
overlaps the forward's all-reduces (transformer.py). A key holds a list: every filed handle is waited,
even if two were filed before one wait."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.runtime.autograd_paths import transforms_active

__all__ = ["DominoUtil", "NoOper", "_Wait_bwd_comm", "file_handle", "wait_handles"]


class DominoUtil:
    """DeepSpeed's names for the two halves and the default handle table."""

    BATCH_0 = "BATCH0"
    BATCH_1 = "BATCH1"
    HANDLE_DIC: dict = {"BATCH0": None, "BATCH1": None}


def file_handle(handle_dic: dict, h_id: Any, handle: Optional[Any]) -> None:
    if handle is None:
        return
    pending = handle_dic.get(h_id)
    if pending is None:
        pending = []
    elif not isinstance(pending, list):  # a caller's table holding one bare handle, as DeepSpeed's does
        pending = [pending]
    pending.append(handle)
    handle_dic[h_id] = pending


def wait_handles(handle_dic: dict, h_id: Any) -> None:
    pending = handle_dic.get(h_id)
    handle_dic[h_id] = None
    if pending is None:
        return
    for handle in (pending if isinstance(pending, list) else [pending]):
        handle.wait()


class NoOper(torch.autograd.Function):
    """Identity forward; backward waits for the half's filed all-reduces, then passes the gradient on."""

    @staticmethod
    def symbolic(graph: Any, input_: Any, handle_dic: Any, h_id: Any) -> Any:
        return input_

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, handle_dic: dict, h_id: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.handle_dic, ctx.h_id = handle_dic, h_id
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:  # type: ignore[override]
        wait_handles(ctx.handle_dic, ctx.h_id)
        return grad_output, None, None


def _Wait_bwd_comm(input_: torch.Tensor, dic_: dict, h_id: Any) -> torch.Tensor:
    """`input_`, whose gradient is waited for (the filed all-reduces of half `h_id`) before autograd uses it.
    Under a torch.func transform nothing is filed (the linear runs its differentiable form): `input_` itself."""
    if transforms_active():
        return input_
    return NoOper.apply(input_, dic_, h_id)

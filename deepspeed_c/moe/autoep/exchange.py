"""The token exchange of an expert-parallel layer: all_to_all_single with uneven splits, differentiable.

Rows sent to rank r arrive there in the sender's rank order; the gradient of an exchange is the same
exchange with the split lists swapped (each row's gradient goes back to the rank it came from)."""
from __future__ import annotations

from typing import Any

import torch


def exchange_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Sends rows[sum(in_splits[:r]):...] to rank r of group; returns the rows received, out_splits[r] from r."""
    import deepspeed_c.comm as dist

    out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _Exchange(torch.autograd.Function):
    """Its backward is an exchange too, applied through this Function, so a backward that builds a graph
    (create_graph: gradient penalties) differentiates it again; setup_context lets torch.func.grad run it."""

    @staticmethod
    def forward(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any  # type: ignore[override]
                ) -> torch.Tensor:
        return exchange_rows(rows, out_splits, in_splits, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, out_splits, in_splits, group = inputs
        ctx.splits, ctx.group = (out_splits, in_splits), group

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _Exchange.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    return _Exchange.apply(rows, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """counts [ep, L]: rows this rank sends to each rank's local experts; returns [ep, L]: rows each rank
    sends to this rank's local experts."""
    import deepspeed_c.comm as dist

    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out

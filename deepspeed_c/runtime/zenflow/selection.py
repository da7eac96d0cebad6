"""ZenFlow's column selection over one rank's ZeRO partition, and the device-side Adam of the selected
elements.

Importance of a column is the sum of |gradient| over its elements (DeepSpeed's criterion). A rank holds
slices of each matrix, so every rank sums its own slices per column and one all-reduce makes the whole
matrix's column sums; every rank then takes the same top-k (topk_ratio of the columns, DeepSpeed's
int(topk_ratio * cols)). A matrix is a parameter of two or more dimensions, its columns the last one;
a vector (bias, norm weight) is treated as one row whose columns are all selected: DeepSpeed steps its
1-D parameters wholly on the device every step too."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from deepspeed_c.runtime.zenflow.columns import ColumnLayout


@dataclass
class GroupSlices:
    """One param group's view of this rank's partition: (param, param_off, part_start, len) per slice."""
    slices: list[tuple[int, int, int, int]]
    shapes: list[torch.Size]

    def cols(self) -> list[int]:
        return [int(s[-1]) if len(s) >= 2 else max(1, math.prod(s)) for s in self.shapes]

    def is_matrix(self, i: int) -> bool:
        return len(self.shapes[i]) >= 2


def column_sums(part: torch.Tensor, view: GroupSlices) -> list[Optional[torch.Tensor]]:
    """Per matrix of the group: this rank's share of sum |g| per column (fp32, on part's device)."""
    cols = view.cols()
    sums: list[Optional[torch.Tensor]] = [None] * len(view.shapes)
    for i, shape in enumerate(view.shapes):
        if view.is_matrix(i):
            sums[i] = torch.zeros(cols[i], dtype=torch.float32, device=part.device)
    for i, param_off, part_start, length in view.slices:
        if sums[i] is None or length == 0:
            continue
        c = cols[i]
        r0, r1 = param_off // c, (param_off + length - 1) // c
        buf = torch.zeros((r1 - r0 + 1) * c, dtype=torch.float32, device=part.device)
        lo = param_off - r0 * c
        buf[lo:lo + length] = part[part_start:part_start + length].float().abs()
        sums[i] += buf.view(-1, c).sum(0)
    return sums


def select_columns(sums: Sequence[list[Optional[torch.Tensor]]], topk_ratio: float, group: Any,
                   world_size: int) -> list[list[Optional[torch.Tensor]]]:
    """Every group's per-parameter selected columns (host int64), the same on every rank: vectors get
    all their columns, matrices their top int(topk_ratio * cols) by the all-reduced column sums."""
    flat = [s for g in sums for s in g if s is not None]
    if flat and world_size > 1:
        import deepspeed_c.comm as dist

        joined = torch.cat(flat)
        dist.all_reduce(joined, group=group)
        flat = list(joined.split([s.numel() for s in flat]))
    it = iter(flat)
    out: list[list[Optional[torch.Tensor]]] = []
    for g in sums:
        row: list[Optional[torch.Tensor]] = []
        for s in g:
            if s is None:
                row.append(None)
                continue
            total = next(it)
            k = int(topk_ratio * total.numel())
            top = torch.topk(total, k).indices if k > 0 else torch.zeros(0, dtype=torch.int64)
            row.append(torch.sort(top.cpu()).values)
        out.append(row)
    return out


def layout_for(view: GroupSlices, selected: list[Optional[torch.Tensor]]) -> ColumnLayout:
    """The selected elements of this rank's partition: matrices' chosen columns, vectors whole."""
    cols = view.cols()
    full = [sel if view.is_matrix(i) else torch.arange(cols[i]) for i, sel in enumerate(selected)]
    return ColumnLayout.build(view.slices, cols, full)


class SelectedAdam:
    """Adam/AdamW over the packed selected elements of one group, on the device in fp32, the update rule of
    the C CPU Adam (so with every column selected it steps as the host would). Moments start at zero at
    every selection, as DeepSpeed's selective optimizer clears them."""

    def __init__(self, master: torch.Tensor, adamw_mode: bool) -> None:
        self.master = master  # fp32, device
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.step_count = 0
        self.adamw_mode = adamw_mode

    @torch.no_grad()
    def step(self, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """One step with the (unscaled, clipped, fp32) packed gradient: the fused CUDA Adam on a GPU, the C
        CPU Adam on a CPU run (the host's own kernel: with every column selected, bit for bit the host's step)."""
        self.step_count += 1
        if self.master.numel() == 0:
            return
        beta1, beta2 = group["betas"]
        kw = dict(lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                  weight_decay=float(group["weight_decay"]), step=self.step_count,
                  bias_correction=bool(group.get("bias_correction", True)))
        if self.master.is_cuda:
            from deepspeed_c.ops.adam.fused_adam import multi_tensor_adam

            multi_tensor_adam([grad], [self.master], [self.exp_avg], [self.exp_avg_sq], adam_w_mode=self.adamw_mode,
                              **kw)
        else:
            from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step

            cpu_adam_step([self.master], [grad], [self.exp_avg], [self.exp_avg_sq], adamw_mode=self.adamw_mode, **kw)

    def state_dict(self) -> dict[str, Any]:
        return {"exp_avg": self.exp_avg.cpu(), "exp_avg_sq": self.exp_avg_sq.cpu(), "step": self.step_count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        self.step_count = int(sd["step"])

"""ZenFlow's selective AdamW (DeepSpeed's deepspeed.ops.adam.ZenFlowSelectiveAdamW and
ZenFlowSelectiveAdamW_stage3): the device-side optimizer of ZenFlow, which each step updates only the
selected columns of each matrix (and whole vectors) from a gradient of just those columns.

The protocol is attributes on the parameters, set by whoever selects:
  selected_indices     the chosen columns (stage 1/2: columns of param.data; stage 3: rows of the
                       partition seen as (numel // ds_shape[-1], ds_shape[-1]), i.e. the transposed layout)
  selected_grad        the gradient of the selected part (consumed by a step: set to None)
  temp_selected_param  optional snapshot of the selected part (temp_copy_param) written back into the
                       weights before the update: the host step may have overwritten those elements
  exp_avg_cpu_data /
  exp_avg_sq_cpu_data  with offload=True the moments live in host memory on the parameter; each update
                       copies them to the compute device and back (copy_mv_from_cpu / copy_mv_to_cpu)
Stage 3 reads the partition `ds_tensor` (its slice complete_column_offset .. + complete_numel), groups by
`group_id` in group_step, and handles a partition that is not on the compute device (host or NVMe: swapped in
through param.nvme_swapper and out again after the update).

The update is torch's AdamW (torch.optim.adamw.adamw) on the selected elements, with per-parameter state
(`step` as a float32 0-dim tensor, exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad), so with every column
selected it steps exactly as torch.optim.AdamW. deepspeed_c's engine runs ZenFlow through
runtime/zenflow/ (packed selected elements, the C CPU Adam on the host); these classes are the public
optimizers for code that drives the selection itself."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch.optim.adamw import adamw as _torch_adamw

from deepspeed_c.utils.logging import logger

_Entry = tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor, dict]


def _has_grad(p: Any) -> bool:
    return getattr(p, "selected_grad", None) is not None


class _SelectiveAdamW(torch.optim.AdamW):
    """What both stages share; subclasses say where a parameter's selected elements are (_select) and how
    they go back (_write_back)."""

    def __init__(self, *args: Any, offload: bool = False, bucket_size: float = 5e8, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.bucket_size = bucket_size
        # DeepSpeed binds the step variant per instance (its tests compare opt.step with it)
        self.step = self._step_with_offload if offload else self._step_without_offload  # type: ignore

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for param_state in self.state.values():  # a half-precision step counter loses counts: widened
            step = param_state.get("step")
            if torch.is_tensor(step) and step.dtype in (torch.float16, torch.bfloat16):
                param_state["step"] = step.float()

    # -- where the selected elements are (per stage) ------------------------------------------------------
    def _select(self, param: Any) -> torch.Tensor:
        raise NotImplementedError

    def _write_back(self, param: Any, selected: torch.Tensor) -> None:
        raise NotImplementedError

    # -- moments -------------------------------------------------------------------------------------
    def clear_selected_mv(self) -> None:
        """Zeroes the selective moments (a new selection starts them afresh)."""
        logger.info("Zenflow: clearing selective optimizer states...")
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                if self.offload:
                    param.exp_avg_cpu_data.zero_()
                    param.exp_avg_sq_cpu_data.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    def copy_mv_from_cpu(self, params: Iterable[Any]) -> None:
        for param in params:
            param.exp_avg = param.exp_avg_cpu_data.to(param.device, non_blocking=True)
            param.exp_avg_sq = param.exp_avg_sq_cpu_data.to(param.device, non_blocking=True)

    def copy_mv_to_cpu(self, params: Iterable[Any]) -> None:
        for param in params:
            param.exp_avg_cpu_data.copy_(param.exp_avg.data, non_blocking=True)
            param.exp_avg_sq_cpu_data.copy_(param.exp_avg_sq.data, non_blocking=True)
            param.exp_avg = None
            param.exp_avg_sq = None

    def _state(self, param: Any, selected: torch.Tensor, group: dict) -> dict:
        state = self.state.setdefault(param, {})
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=selected.device)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(selected)
            if not self.offload:
                state["exp_avg"] = torch.zeros_like(selected)
                state["exp_avg_sq"] = torch.zeros_like(selected)
        return state

    def _entry(self, param: Any, selected: torch.Tensor, group: dict, grad: Optional[torch.Tensor] = None) -> _Entry:
        grad = param.selected_grad if grad is None else grad
        if grad.shape != selected.shape:
            raise ValueError(f"{type(self).__name__}: selected_grad has shape {tuple(grad.shape)}, the selected "
                             f"elements {tuple(selected.shape)} (selected_indices {len(param.selected_indices)})")
        state = self._state(param, selected, group)
        if self.offload:  # the host moments, brought over by copy_mv_from_cpu
            return param, selected, param.exp_avg.view_as(selected), param.exp_avg_sq.view_as(selected), state
        return param, selected, state["exp_avg"], state["exp_avg_sq"], state

    @staticmethod
    def _adamw(entries: Sequence[_Entry], grads: Sequence[torch.Tensor], group: dict) -> None:
        if not entries:
            return
        beta1, beta2 = group["betas"]
        _torch_adamw([e[1] for e in entries], list(grads), [e[2] for e in entries], [e[3] for e in entries],
                     [e[4]["max_exp_avg_sq"] for e in entries] if group["amsgrad"] else [],
                     [e[4]["step"] for e in entries], foreach=False, amsgrad=group["amsgrad"], beta1=beta1,
                     beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=False)

    def _update(self, params: Sequence[Any], group: dict, apply_temp: bool) -> None:
        """One AdamW step of the selected elements of `params` (those with a selected_grad), the snapshot
        applied first where apply_temp, the results written back, the gradients consumed."""
        entries = []
        for p in params:
            if not _has_grad(p):
                continue
            selected = self._select(p)
            temp = getattr(p, "temp_selected_param", None)
            if apply_temp and temp is not None:
                selected.copy_(temp)
            entries.append(self._entry(p, selected, group))
        self._adamw(entries, [e[0].selected_grad for e in entries], group)
        for e in entries:
            self._write_back(e[0], e[1])
            e[0].selected_grad = None
            if apply_temp and hasattr(e[0], "temp_selected_param"):
                e[0].temp_selected_param = None

    def _apply_temp(self, param: Any) -> None:
        temp = getattr(param, "temp_selected_param", None)
        if temp is None:
            return
        selected = self._select(param)
        selected.copy_(temp.to(selected.device, non_blocking=True))
        self._write_back(param, selected)
        param.temp_selected_param = None

    def _buckets(self, params: Sequence[Any]) -> Iterable[list]:
        """The parameters with a gradient in buckets of about bucket_size elements (offload: the moments of
        one bucket at a time on the device)."""
        bucket, numel = [], 0
        for p in params:
            if _has_grad(p):
                bucket.append(p)
                numel += p.numel()
                if numel >= self.bucket_size:
                    yield bucket
                    bucket, numel = [], 0
        if bucket:
            yield bucket


class ZenFlowSelectiveAdamW(_SelectiveAdamW):
    """ZeRO stage 1/2: the selected columns are param.data[:, selected_indices]; a vector is selected whole."""

    def _select(self, param: Any) -> torch.Tensor:
        return param.data[:, param.selected_indices] if param.dim() != 1 else param.data

    def _write_back(self, param: Any, selected: torch.Tensor) -> None:
        if param.dim() != 1:  # a vector was updated in place
            param.data[:, param.selected_indices] = selected

    def temp_copy_param(self, group_to_paramlist: dict) -> None:
        """Snapshots every selected part ({group_id: params}) into temp_selected_param (on the host with offload)."""
        for params in group_to_paramlist.values():
            for param in params:
                if hasattr(param, "selected_grad"):
                    snap = self._select(param).clone().detach()
                    param.temp_selected_param = snap.cpu() if self.offload else snap

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for group in self.param_groups:
            self._update(group["params"], group, apply_temp=True)

    @torch.no_grad()
    def _step_with_offload(self) -> None:
        for group_id, group in enumerate(self.param_groups):
            for bucket in self._buckets(group["params"]):
                for param in bucket:
                    self._apply_temp(param)
                self.group_step({group_id: bucket})

    @torch.no_grad()
    def group_step(self, group_to_paramlist: dict) -> None:
        """One step of the given parameters ({group_id: params}), moments brought from and back to the host
        with offload."""
        for group_id, params in group_to_paramlist.items():
            if self.offload:
                self.copy_mv_from_cpu(params)
            self._update(params, self.param_groups[group_id], apply_temp=False)
            if self.offload:
                self.copy_mv_to_cpu(params)
            for param in params:
                param.selected_grad = None


class ZenFlowSelectiveAdamW_stage3(_SelectiveAdamW):  # noqa: N801 (DeepSpeed's name)
    """ZeRO stage 3: the selected elements are rows selected_indices of this rank's partition ds_tensor
    (its complete_column_offset .. + complete_numel slice seen as rows of ds_shape[-1]); a vector's
    partition is selected whole."""

    @staticmethod
    def _rows(param: Any, data: torch.Tensor) -> Optional[torch.Tensor]:
        """The partition slice as rows, None for a vector."""
        if len(param.ds_shape) == 1:
            return None
        width = int(param.ds_shape[-1])
        return data.narrow(0, param.complete_column_offset, param.complete_numel).view(-1, width)

    def _select(self, param: Any) -> torch.Tensor:
        rows = self._rows(param, param.ds_tensor.data)
        return param.ds_tensor.data if rows is None else rows[param.selected_indices, :]

    def _write_back(self, param: Any, selected: torch.Tensor) -> None:
        rows = self._rows(param, param.ds_tensor.data)
        if rows is not None:
            rows[param.selected_indices.to(rows.device), :] = selected.to(rows.device)
        elif selected.data_ptr() != param.ds_tensor.data.data_ptr():
            param.ds_tensor.data.copy_(selected)

    # -- partitions away from the compute device (host, NVMe) ----------------------------------------------
    def _is_partition_offloaded(self, param: Any) -> bool:
        """An NVMe partition is a 0-dim placeholder; a host one sits on another device than its gradient."""
        data = param.ds_tensor.data
        return data.dim() == 0 or data.device != param.selected_grad.device

    def _swap_in_if_offloaded(self, param: Any) -> bool:
        """Reads an NVMe partition back; True when this call did (the caller then swaps it out or releases it)."""
        swapper = getattr(param, "nvme_swapper", None)
        if param.ds_tensor.data.dim() == 0 and swapper is not None:
            swapper.swap_in([param], async_op=False)
            return True
        return False

    def _swap_out_if_offloaded(self, param: Any, swapped_in: bool) -> None:
        if swapped_in:
            param.nvme_swapper.swap_out_and_release([param])

    def _release_if_offloaded(self, param: Any, swapped_in: bool) -> None:
        """A partition swapped in only to be read is dropped, not written back."""
        if swapped_in:
            param.nvme_swapper.remove_partition_and_release_buffers([param])

    def temp_copy_param(self, paramlist: Sequence[Any]) -> None:
        """Snapshots the selected rows of each parameter with a gradient into temp_selected_param."""
        with torch.no_grad():
            for param in paramlist:
                if not hasattr(param, "selected_grad"):
                    continue
                swapped = self._swap_in_if_offloaded(param)
                rows = self._rows(param, param.ds_tensor.data)
                snap = (param.ds_tensor.data if rows is None
                        else rows[param.selected_indices.to(rows.device), :]).clone().detach()
                param.temp_selected_param = snap.cpu() if self.offload else snap
                self._release_if_offloaded(param, swapped)

    def _selective_step_one_param(self, param: Any, group: dict, apply_temp: bool = False) -> None:
        """The update of one parameter whose partition may sit elsewhere than its gradient: computed on the
        gradient's device, written back where the partition lives."""
        device = param.selected_grad.device
        data = param.ds_tensor.data
        rows = self._rows(param, data)
        selected = (data if rows is None else rows[param.selected_indices.to(data.device), :]).to(device, copy=True)
        temp = getattr(param, "temp_selected_param", None)
        if apply_temp and temp is not None:
            selected.copy_(temp.to(device))
        if self.offload:  # moments on the compute device, kept on the param for copy_mv_to_cpu
            param.exp_avg = param.exp_avg.to(device)
            param.exp_avg_sq = param.exp_avg_sq.to(device)
        entry = self._entry(param, selected, group, grad=param.selected_grad.to(device))
        self._adamw([entry], [param.selected_grad.to(device)], group)
        self._write_back(param, selected)

    @torch.no_grad()
    def _group_step_offloaded(self, params: Sequence[Any], group: dict) -> None:
        """One parameter at a time, so at most one NVMe partition is resident."""
        for param in params:
            if not hasattr(param, "selected_grad") or param.selected_grad is None:
                continue
            swapped = self._swap_in_if_offloaded(param)
            if self.offload:
                self.copy_mv_from_cpu([param])
            self._selective_step_one_param(param, group, apply_temp=True)
            if self.offload:
                self.copy_mv_to_cpu([param])
            self._swap_out_if_offloaded(param, swapped)
            if hasattr(param, "temp_selected_param"):
                param.temp_selected_param = None
            param.selected_grad = None

    def _any_offloaded(self, params: Sequence[Any]) -> bool:
        return any(_has_grad(p) and self._is_partition_offloaded(p) for p in params)

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for group in self.param_groups:
            if self._any_offloaded(group["params"]):
                self._group_step_offloaded(group["params"], group)
            else:
                self._update(group["params"], group, apply_temp=True)

    @torch.no_grad()
    def _step_with_offload(self) -> None:
        for group in self.param_groups:
            for bucket in self._buckets(group["params"]):
                for param in bucket:
                    if not self._is_partition_offloaded(param):  # else group_step applies it per parameter
                        self._apply_temp(param)
                self.group_step(bucket)

    @torch.no_grad()
    def group_step(self, paramlist: Sequence[Any]) -> None:
        """One step of the given parameters, grouped by their group_id."""
        by_group: dict[int, list] = {}
        for param in paramlist:
            by_group.setdefault(param.group_id, []).append(param)
        for group_id in sorted(by_group):
            params, group = by_group[group_id], self.param_groups[group_id]
            if self._any_offloaded(params):
                self._group_step_offloaded(params, group)
                continue
            if self.offload:
                self.copy_mv_from_cpu(params)
            self._update(params, group, apply_temp=False)
            if self.offload:
                self.copy_mv_to_cpu(params)
            for param in params:
                param.selected_grad = None

"""ZenFlow's ZeRO step (a ZeroStepStrategy): each step the selected columns of this rank's partition are
stepped on the device (SelectedAdam) and the whole unscaled, clipped gradient is added to a device-side
accumulator; on an update boundary the accumulated sum goes to the host once and the C CPU Adam steps the
whole fp32 master with its mean (1/n as the kernel's grad_scale: no pass over the accumulator) (in a
background thread with overlap_step, whose result is applied at the next boundary, so the device never waits
for the host), after which the host's weights replace the unselected elements of the model while the
selected ones keep the device's values. The host step covers the selected elements too, as DeepSpeed's
(ZenFlowCPUAdam steps the whole partition): their host moments are read again once a reselection drops
them, and are checkpointed; skipping them would change results.

Boundaries follow DeepSpeed's ZenFlow: the first full_warm_up_rounds steps are plain ZeRO-Offload steps;
then columns are (re)selected at the first step and every select_interval steps (the selected
elements' device values are written into the host master first, so it holds the whole model); the host
steps every update_interval steps, or, with update_interval "auto", once auto_ratio of the matrices have
gathered as much left-out gradient as selected gradient (DeepSpeed's criterion), and always right before
a reselection.

The background host step runs cores * (1 - pt_reserved_cores_perc) OpenMP threads, and every core for the
pieces left once the training thread blocks on it at a boundary (its reserved cores are idle then); the
training thread blocks only there, when the next boundary comes before the host step has finished."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_empty
from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.step_sequence import StepOutcome
from deepspeed_c.runtime.zenflow import columns
from deepspeed_c.runtime.zenflow.selection import (GroupSlices, SelectedAdam, column_sums, layout_for,
                                                   select_columns)
from deepspeed_c.runtime.zenflow.zenflow_config import ZenFlowSchedule
from deepspeed_c.runtime.zero.grad_partition import chunk_range
from deepspeed_c.runtime.zero.step_strategy import Decide, GradNorm, ZeroStepStrategy

HOST_PIECE = 1 << 25  # elements of the accumulator per device-to-host copy the host step can start on


class ZenFlowStep(ZeroStepStrategy):

    def __init__(self, optimizer: Any, masters: Sequence[torch.Tensor], plans: Sequence[PartitionPlan],
                 shapes: Sequence[Sequence[torch.Size]], writer: Any, schedule: ZenFlowSchedule, *,
                 rank: int, world_size: int, group: Any, device: torch.device, lp_dtype: torch.dtype,
                 pin_memory: bool, host_lp: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """shapes: each group's parameters' full shapes (plan order); device, lp_dtype: the model's; host_lp:
        host buffers of the model dtype to reuse for the host step's weights (the offload's), None where none."""
        self.optimizer = optimizer  # the C CPU Adam over the host masters
        self.masters = list(masters)
        self.plans = list(plans)
        self.writer = writer
        self.sched = schedule
        self.world_size = world_size
        self.group = group
        self.device = device
        self.lp_dtype = lp_dtype
        self.views = [GroupSlices([(i, pstart, lstart, n) for i, _, pstart, lstart, n, _ in
                                   plan.slices("runtime", rank)], [torch.Size(s) for s in ss])
                      for plan, ss in zip(plans, shapes)]
        self.ranges = [[chunk_range(plan, b, world_size) for b in range(plan.num_buckets)] for plan in plans]
        pin = pin_memory and self.device.type == "cuda"
        sizes = [m.numel() for m in self.masters]
        # two accumulators on a GPU: one takes the gradients while the other's copy to the host (on a side
        # stream) and its zeroing finish, so the step never waits for that copy; on a CPU run with
        # overlap_step: one takes the gradients while the background host step reads the other in place
        cuda = self.device.type == "cuda"
        self.acc_sets = [[torch.zeros(n, dtype=torch.float32, device=self.device) for n in sizes]
                         for _ in range(2 if cuda or schedule.overlap_step else 1)]
        self.cur = 0
        self.zeroed: list[Any] = [None] * len(self.acc_sets)  # events: that set's copy and zeroing are done
        self.side = torch.cuda.Stream(self.device) if cuda else None
        self.acc_host = [host_empty(n, torch.float32, pin) if self.device.type != "cpu" else None
                         for n in sizes]
        given = list(host_lp) if host_lp is not None else [None] * len(sizes)
        self.lp_host = [b if b is not None and b.dtype == self.lp_dtype and b.numel() == n
                        else host_empty(n, self.lp_dtype, pin) for b, n in zip(given, sizes)]
        # the model's weights as this rank last wrote them (never the master itself, which the host steps)
        self.dev_lp = [m.detach().to(device=self.device, dtype=self.lp_dtype, copy=True) for m in self.masters]
        # on a GPU the host step's result is copied up by the worker as soon as it is done, on the side stream,
        # into these buffers, which become dev_lp at the boundary that takes the result: the compute stream
        # never runs that copy itself (incoming_ready: the copy's event, None when none is in flight)
        self.incoming = [torch.empty_like(lp) for lp in self.dev_lp] if cuda else []
        self.incoming_ready: Any = None
        # host_steps, host_adam_s (the C Adam), d2h_wait_s (the worker awaiting the accumulator's copy),
        # wait_s (the training thread blocked on a host step at a boundary), handoffs (host steps given to the
        # background), joins (background host steps the training thread took the result of)
        self.stats: dict[str, float] = {"host_steps": 0, "host_adam_s": 0.0, "d2h_wait_s": 0.0, "wait_s": 0.0,
                                        "handoffs": 0, "joins": 0}
        self.host_log: list[float] = []  # each host step's C Adam seconds (a benchmark reads and clears it)
        self.accumulated = 0  # steps in the accumulator
        self.steps = 0  # applied (not skipped) steps
        self.layouts: Optional[list[columns.ColumnLayout]] = None
        self.positions: list[torch.Tensor] = []
        self.selected: list[SelectedAdam] = []
        self.columns: Optional[list[list[Optional[torch.Tensor]]]] = None
        self.adamw = bool(getattr(optimizer, "adam_w_mode", True))
        # update_interval "auto": DeepSpeed's running critical / left-out gradient sums per matrix
        self.auto_critic: Optional[torch.Tensor] = None
        self.auto_left: Optional[torch.Tensor] = None
        self.auto_steps = 0
        self.pending: Optional[Future] = None
        self.unapplied = False  # a host step finished whose result the model has not taken yet
        self.pool: Optional[ThreadPoolExecutor] = None
        self.h2d_done: Any = None
        self.worker_threads = 0
        self.all_threads = 0
        # set while the training thread is blocked on the host step: its reserved cores are idle then, so the
        # worker steps the pieces left with every core
        self.blocked = threading.Event()
        if schedule.overlap_step:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-host-adam")
            # OpenMP's thread count is per calling thread: the worker sets its own (pt_reserved_cores_perc of
            # the cores stay with PyTorch), the main thread's host steps keep theirs
            cores = os.cpu_count() or 1
            self.worker_threads = max(1, int(cores * (1.0 - schedule.pt_reserved_cores_perc)))
            self.all_threads = max(self.worker_threads, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                   else cores)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, parts: Sequence[torch.Tensor], *, clip_grad: float, grad_norm: GradNorm,
             decide: Decide) -> StepOutcome:
        return decide(grad_norm(parts, False), apply_coef=lambda coef: self.apply(parts, coef))

    @torch.no_grad()
    def apply(self, parts: Sequence[torch.Tensor], coef: float) -> None:
        t = self.steps
        self.steps += 1
        if self.zeroed[self.cur] is not None:
            torch.cuda.current_stream().wait_event(self.zeroed[self.cur])
            self.zeroed[self.cur] = None
        for acc, part in zip(self.acc, parts):
            acc.add_(part, alpha=coef)
        self.accumulated += 1
        if t < self.sched.full_warm_up_rounds:  # warm-up: every element stepped by the host, synchronously
            self._host_step(sync=True)
            self._write_model()
            return
        since = t - self.sched.full_warm_up_rounds
        if self.layouts is None or since == 0 or (self.sched.select_interval and t % self.sched.select_interval == 0):
            self._reselect(parts)
        for g, part in enumerate(parts):
            pos = self.positions[g]
            if pos.numel() == 0:
                continue
            grad = part[pos].float()
            if coef != 1.0:
                grad.mul_(coef)
            self.selected[g].step(grad, self.optimizer.param_groups[g])
        if self._update_boundary(t, parts, coef):
            self._host_step(sync=not self.sched.overlap_step)
        self._write_model()

    def _update_boundary(self, t: int, parts: Sequence[torch.Tensor], coef: float) -> bool:
        nxt = t + 1
        if self.sched.select_interval and nxt % self.sched.select_interval == 0:
            return True  # the next step reselects: the host takes what has accumulated first
        if not self.sched.auto_update:
            return (nxt - self.sched.full_warm_up_rounds) % self.sched.update_interval == 0
        return self._auto_due(parts, coef)

    def _auto_due(self, parts: Sequence[torch.Tensor], coef: float) -> bool:
        """DeepSpeed's auto update: per matrix, the selected gradient's running mean (scaled by 1/(10 topk))
        against the left-out gradient summed since the last update (scaled by 1/(10 (1 - topk))); due when
        auto_ratio of the matrices have as much left out as selected."""
        crit, total = [], []
        for g, part in enumerate(parts):
            view = self.views[g]
            sums = column_sums(part, view)
            for i, s in enumerate(sums):
                if s is None:
                    continue
                sel = self.columns[g][i] if self.columns is not None else None
                total.append(s.sum())
                crit.append(s[sel.to(s.device)].sum() if sel is not None and sel.numel() else s.new_zeros(()))
        if not crit:
            return True
        both = torch.stack([torch.stack(crit), torch.stack(total)]) * abs(coef)
        if self.world_size > 1:
            import deepspeed_c.comm as dist

            dist.all_reduce(both, group=self.group)
        critic, everything = both[0], both[1]
        if self.auto_critic is None:
            self.auto_critic = torch.zeros_like(critic)
            self.auto_left = torch.zeros_like(critic)
        self.auto_steps += 1
        k = self.auto_steps
        topk = self.sched.topk_ratio
        self.auto_critic = (self.auto_critic * (k - 1) + critic) / k / max(topk * 10, 1e-12)
        self.auto_left = self.auto_left + (everything - critic) / max((1 - topk) * 10, 1e-12)
        need = int((self.auto_left >= self.auto_critic).sum().item())
        if need >= int(self.sched.auto_ratio * critic.numel()):
            self.auto_steps = 0
            self.auto_left.zero_()
            return True
        return False

    # -- selection ---------------------------------------------------------------------------------
    def _reselect(self, parts: Sequence[torch.Tensor]) -> None:
        self.settle(apply=True)
        sums = [column_sums(part, view) for part, view in zip(parts, self.views)]
        self.columns = select_columns(sums, self.sched.topk_ratio, self.group, self.world_size)
        self.layouts = [layout_for(view, sel) for view, sel in zip(self.views, self.columns)]
        self.positions = [lay.positions().to(self.device) for lay in self.layouts]
        self.selected = [SelectedAdam(columns.gather(m.detach(), lay).to(self.device), self.adamw)
                         for m, lay in zip(self.masters, self.layouts)]

    def _selected_to_host(self) -> None:
        """The selected elements' device values into the host masters (the masters then hold the model)."""
        if self.layouts is None:
            return
        for m, lay, sel in zip(self.masters, self.layouts, self.selected):
            columns.scatter(m.detach(), lay, sel.master.to("cpu"))

    # -- the host step -----------------------------------------------------------------------------
    def _host_step(self, sync: bool) -> None:
        """Hands the accumulated mean gradient to the host (one copy), then steps it there: now, or in the
        background with its result applied at the next boundary (the previous one's result first)."""
        self._finish_pending()
        # the mean over the accumulated steps is the C Adam's grad_scale (the same fp32 multiply as scaling
        # the accumulator first, without that pass over it)
        scale = 1.0 / max(1, self.accumulated)
        accs = self.acc
        self.accumulated = 0
        copied = None
        if self.side is None:  # CPU run: the host steps the accumulator itself and zeroes it after
            grads = list(accs)
            self.cur = (self.cur + 1) % len(self.acc_sets)
        else:
            grads = [h for h in self.acc_host if h is not None]
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                # in pieces, each with its event: the host steps a piece as soon as it has arrived, while the
                # next ones are still on their way
                copied = []
                for g, (host, acc) in enumerate(zip(grads, accs)):
                    for lo in range(0, acc.numel(), HOST_PIECE):
                        hi = min(acc.numel(), lo + HOST_PIECE)
                        host[lo:hi].copy_(acc[lo:hi], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record()
                        copied.append((g, lo, hi, ev))
                for acc in accs:
                    acc.zero_()
                zeroed = torch.cuda.Event()
                zeroed.record()
            self.zeroed[self.cur] = zeroed
            self.cur = (self.cur + 1) % len(self.acc_sets)
        groups = [dict(g) for g in self.optimizer.param_groups]  # lr as of this step
        if sync:
            self._host_adam(groups, grads, copied, scale)
            self._apply_host()
        else:
            assert self.pool is not None
            self.pending = self.pool.submit(self._host_adam, groups, grads, copied, scale)
            self.stats["handoffs"] += 1

    @property
    def acc(self) -> list[torch.Tensor]:
        """The accumulator taking this interval's gradients."""
        return self.acc_sets[self.cur]

    def _host_adam(self, groups: list[dict[str, Any]], grads: list[torch.Tensor],
                   copied: Optional[list[tuple[int, int, int, Any]]], scale: float) -> None:
        worker = bool(self.worker_threads) and threading.current_thread() is not threading.main_thread()
        threads = 0
        t0 = time.perf_counter()
        if self.h2d_done is not None:  # lp_host is still being read by the previous result's copy
            self.h2d_done.synchronize()
        waited = time.perf_counter() - t0
        opt = self.optimizer
        steps = []
        for g, master in enumerate(self.masters):
            state = opt.ready_state(opt.param_groups[g], master, f"params[{g}][0]")
            steps.append((state, int(opt.ds_opt_op.bump_steps([state["step"]])[0])))
        # the pieces of the accumulator's copy (GPU), else every group whole
        pieces = copied if copied is not None else [(g, 0, m.numel(), None) for g, m in enumerate(self.masters)]
        for g, lo, hi, arrived in pieces:
            if arrived is not None:
                t1 = time.perf_counter()
                arrived.synchronize()
                waited += time.perf_counter() - t1
            if worker:  # per piece: the training thread may have started waiting since the last one
                want = self.all_threads if self.blocked.is_set() else self.worker_threads
                if want != threads:
                    threads = want
                    opt.ds_opt_op.num_threads(threads)
            state, step = steps[g]
            moments = [[state[k][lo:hi]] for k in opt.MOMENTS]
            opt.step_tensors(groups[g], [self.masters[g].detach()[lo:hi]], [grads[g][lo:hi]], moments,
                             [self.lp_host[g][lo:hi]], step, grad_scale=scale)
        if self.side is None:  # CPU run: the accumulator just stepped takes gradients again from zero
            for grad in grads:
                grad.zero_()
        adam = time.perf_counter() - t0 - waited
        self.stats["host_adam_s"] += adam
        if len(self.host_log) < 4096:
            self.host_log.append(adam)
        self.stats["d2h_wait_s"] += waited
        self.stats["host_steps"] += 1
        if self.side is not None:  # the result goes up now, on the side stream (after the accumulator's copy)
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.side):
                for inc, lp in zip(self.incoming, self.lp_host):
                    inc.copy_(lp, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            self.incoming_ready = ready

    def _finish_pending(self) -> None:
        self._wait_pending()
        if self.unapplied:
            self.unapplied = False
            self._apply_host()

    def _wait_pending(self) -> None:
        if self.pending is not None:
            job, self.pending = self.pending, None
            t0 = time.perf_counter()
            self.blocked.set()
            try:
                job.result()  # re-raises the host step's error here
            finally:
                self.blocked.clear()
                self.stats["wait_s"] += time.perf_counter() - t0
            self.stats["joins"] += 1
            self.unapplied = True

    def _apply_host(self) -> None:
        """The host's updated weights into the device copy; the selected elements keep the device's."""
        if self.incoming_ready is not None:  # already copied up by the worker: the buffers change places
            torch.cuda.current_stream().wait_event(self.incoming_ready)
            self.dev_lp, self.incoming = self.incoming, self.dev_lp
            self.h2d_done, self.incoming_ready = self.incoming_ready, None
        else:
            for g, lp in enumerate(self.dev_lp):
                lp.copy_(self.lp_host[g], non_blocking=True)
            if self.device.type == "cuda":
                self.h2d_done = torch.cuda.Event()
                self.h2d_done.record()
        self._selected_into_lp()

    def _selected_into_lp(self) -> None:
        for g, lp in enumerate(self.dev_lp):
            if self.positions and self.positions[g].numel():
                lp[self.positions[g]] = self.selected[g].master.to(self.lp_dtype)

    def _write_model(self) -> None:
        self._selected_into_lp()
        for g, lp in enumerate(self.dev_lp):
            for b, (start, end) in enumerate(self.ranges[g]):
                self.writer.submit(g, b, lp[start:end])
        self.writer.finish()

    # -- consistency points: checkpoints, reselection, shutdown --------------------------------------
    def settle(self, apply: bool = False) -> None:
        """The host step in flight finished (applied to the model only with `apply`: a checkpoint leaves it for
        the boundary that would take it, so a resumed run follows the same steps), and the selected columns'
        device values written into the host masters: the masters then hold the newest weights."""
        if apply:
            if self.pending is not None or self.unapplied:
                self._finish_pending()
                self._write_model()
        else:
            self._wait_pending()
        self._selected_to_host()

    def state_dict(self) -> dict[str, Any]:
        """ZenFlow's own state beside the optimizer's (call settle() first): the accumulated gradient not yet
        stepped by the host, the selected columns, their device moments and the schedule's counters."""
        return {"steps": self.steps, "accumulated": self.accumulated, "acc": [a.cpu() for a in self.acc],
                # with a host result not yet taken, the model's weights differ from the masters: kept apart
                "unapplied": self.unapplied, "model": [lp.cpu() for lp in self.dev_lp] if self.unapplied else None,
                "columns": self.columns, "selected": [s.state_dict() for s in self.selected],
                "auto_steps": self.auto_steps,
                "auto": None if self.auto_critic is None else (self.auto_critic.cpu(), self.auto_left.cpu())}

    def forget(self) -> None:
        """Before a load replaces the masters: the step in flight is dropped (superseded) and the selection
        forgotten, so nothing writes the old device values into the loaded masters."""
        self.close_pending()
        self.layouts, self.positions, self.selected, self.columns = None, [], [], None

    def load_state_dict(self, sd: Optional[dict[str, Any]]) -> None:
        """Restores state_dict()'s after the masters were loaded (None: a fresh accumulator, and columns
        selected again at the next step)."""
        self.forget()
        for m, lp in zip(self.masters, self.dev_lp):
            lp.copy_(m.detach().to(self.lp_dtype))
        if self.side is not None:
            self.side.synchronize()
        self.zeroed = [None] * len(self.acc_sets)
        for accs in self.acc_sets:
            for a in accs:
                a.zero_()
        self.accumulated = 0
        if sd is None:
            return
        self.steps, self.accumulated, self.auto_steps = int(sd["steps"]), int(sd["accumulated"]), int(sd["auto_steps"])
        for a, saved in zip(self.acc, sd["acc"]):
            a.copy_(saved)
        # own copies: a checkpoint loader may hand tensors mapped from its file
        self.columns = None if sd["columns"] is None else [[None if c is None else c.clone() for c in row]
                                                            for row in sd["columns"]]
        if self.columns is not None:
            self.layouts = [layout_for(view, sel) for view, sel in zip(self.views, self.columns)]
            self.positions = [lay.positions().to(self.device) for lay in self.layouts]
            self.selected = [SelectedAdam(columns.gather(m.detach(), lay).to(self.device), self.adamw)
                             for m, lay in zip(self.masters, self.layouts)]
            for sel, saved in zip(self.selected, sd["selected"]):
                sel.load_state_dict(saved)
        if sd.get("auto") is not None:
            self.auto_critic, self.auto_left = (x.to(self.device, copy=True) for x in sd["auto"])
        if sd.get("unapplied"):  # the masters hold the host's result; the model the weights before it
            for g, (m, lp) in enumerate(zip(self.masters, self.dev_lp)):
                self.lp_host[g].copy_(m.detach().to(self.lp_dtype))
                lp.copy_(sd["model"][g])
            self.unapplied = True
            self._write_model()

    def close_pending(self) -> None:
        """Waits for a host step in flight and drops its result (superseded by a load)."""
        self._wait_pending()
        self.unapplied = False
        self.incoming_ready = None

    def close(self) -> None:
        self.close_pending()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

"""SpeculativeOffload: ZeRO-Offload's host side (offload.CPUOffload) whose C CPU Adam steps each reduced
gradient chunk as soon as it reaches host memory, in a worker thread, while backward still runs: the
speculation is that the step will be taken unclipped with the loss scale of this backward. The step then
either commits (the check agrees: the host results only go back to the device and into the shards) or
rolls back (overflow, or a norm above gradient_clipping), after which the ordinary host step runs with the
true coefficient: the result is exactly the non-speculative one either way. A step that can roll back
writes its updated master and moments into spare buffers (the C kernel's out-of-place form, no extra
memory traffic), which become the live ones at the commit: the rollback discards them and costs nothing.

With a ZeRO-3 store attached (attach_store), the step is deferred: it returns once it knows whether the
speculation commits (or has handed the ordinary step's buckets to the worker, first layers first), and the
next forward takes each bucket's new weights when it reaches the unit that uses them (the store's
before_read hook), so the host step overlaps the next forward too. Anything else that reads the weights or
the optimizer state first finishes the step (settle)."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_empty
from deepspeed_c.runtime.superoffload.deferred import BucketTracker
from deepspeed_c.runtime.superoffload.device_share import DeviceShare
from deepspeed_c.runtime.superoffload.job_queue import ForwardOrderQueue
from deepspeed_c.runtime.zero.offload import CPUOffload


def worker_threads(op: Any, threads: Optional[int], main_threads: int) -> int:
    """The OpenMP team of the worker's C Adam calls. OpenMP's thread count is per thread: a new thread starts
    from the process default (every core of the machine, hyperthreads included, whatever torch set for the
    training thread), so the worker is told. offload_optimizer.cpuadam_cores_perc when set; else the training
    thread's count (the plain step's), less one core for the training thread itself, which runs backward and
    the next forward beside the worker: a static OpenMP schedule waits for its slowest thread, and one that
    shares a core with the training thread is slow."""
    if threads is not None:
        return max(1, int(threads))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(int(main_threads), cores - 1))


# While a worker runs: the longest the training thread keeps the GIL from it. Each of the worker's GIL
# acquisitions (a C call's return, an event's wait, the queue) waits up to this for the training thread, which runs
# forward/backward Python meanwhile; CPython's default, 5 ms, made those waits a large part of the worker's time. The
# training thread only gives way when the worker asks (the worker's Python between C calls is short).
WORKER_SWITCH_INTERVAL = 5e-4
_switch = {"users": 0, "before": 0.0}


def _hold_switch_interval(take: bool) -> None:
    """The process's GIL switch interval at most WORKER_SWITCH_INTERVAL while any SpeculativeOffload lives; the
    previous value back when the last one closes (unless someone else changed it meanwhile)."""
    if take:
        if _switch["users"] == 0:
            _switch["before"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch["before"], WORKER_SWITCH_INTERVAL))
        _switch["users"] += 1
        return
    _switch["users"] -= 1
    if _switch["users"] == 0 and sys.getswitchinterval() == min(_switch["before"], WORKER_SWITCH_INTERVAL):
        sys.setswitchinterval(_switch["before"])


class SpeculativeOffload(CPUOffload):

    def __init__(self, *args: Any, stage_on_host: Optional[bool] = None, **kwargs: Any) -> None:
        # every chunk goes through the host buffer (also on a CPU run), where the speculative step picks it up
        super().__init__(*args, stage_on_host=True, **kwargs)
        # cpuadam_cores_perc, else the training thread's count less its own core (see worker_threads)
        self.threads = worker_threads(self.optimizer.ds_opt_op, kwargs.get("threads"),
                                      self.optimizer.ds_opt_op.num_threads()) if self.fused else None
        if not self.fused:
            raise ValueError("offload_optimizer.super_offload steps with the C CPU optimizers (DeepSpeedCPUAdam); "
                             f"got {type(self.optimizer).__name__}")
        self.spec_coef: Callable[[], float] = lambda: 1.0
        # where a step that can roll back writes (per group: master and moments; made at the first use, in the
        # states' dtypes), None when no step can disagree with the speculation (then it steps in place)
        self.spare: Optional[list[Optional[dict[str, torch.Tensor]]]] = None
        self.stepped: list[tuple[int, int, int]] = []  # (group, start, end) speculatively stepped
        self.bumped: set[int] = set()  # groups whose step count this speculation advanced
        self.coef_used: Optional[float] = None
        self.jobs = ForwardOrderQueue()
        self.errors: list[BaseException] = []
        self.queued: list[tuple[int, int, int]] = []  # (group, start, end) handed to the worker this backward
        self.queued_coef: Optional[float] = None
        self.worker = threading.Thread(target=self._work, name="superoffload-cpu-adam", daemon=True)
        _hold_switch_interval(True)
        self.switch_held = True
        self.worker.start()
        self.commits = 0
        self.share: Optional[DeviceShare] = None  # offload_optimizer.ratio < 1: the groups' first buckets
        self.resident_depth = 0
        self.rollbacks = 0
        # a step clipped (its coefficient not the speculated one) makes the next backward not speculate: under a
        # norm that stays above gradient_clipping every speculative step would be thrown away, costing host
        # time and memory bandwidth the ordinary step then lacks; the norm of each step re-decides
        self.speculating = True
        self.plain_steps = 0  # steps taken the ordinary way without a speculation to roll back
        self.drain_s = 0.0  # the step blocked on the speculative host step still running
        self.worker_s = 0.0  # the worker's time in host steps (awaiting each chunk's copy down included)
        # GPU: each speculatively stepped chunk goes up at once (its own stream, beside the gradients' copies
        # down) into a device staging buffer the commit gathers from; a rollback just ignores it
        self.up_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.dev_stage: Optional[list[torch.Tensor]] = None
        self.up_event: Any = None  # the last chunk's copy up in this speculation
        self.stage_free: Any = None  # the compute stream is done reading the staging buffer (last commit)
        # the deferred step (attach_store): the buckets whose new weights the model has not taken yet
        self.store: Any = None
        self.defer = True  # benchmarks' A/B switch
        self.unit_key: dict[int, tuple[int, int]] = {}  # store unit -> (group, bucket)
        self.tracker = BucketTracker(self.chunk_ranges)
        self.inflight: Optional[str] = None  # "commit" or "plain": a decided step still being taken up
        self.deferred_steps = 0
        self.deferred: set[tuple[int, int]] = set()
        self.writer: Any = None
        self.compute_stream: Any = None

    def attach_store(self, store: Any) -> None:
        """ZeRO-3's parameter store: its units' reads (before_read) take the deferred step's buckets."""
        if getattr(store, "file_backed", False):
            return  # NVMe-backed shards: the step completes before it returns
        self.store = store
        self.unit_key = {store.first_unit[g] + b: (g, b) for g in range(len(self.masters))
                         for b in range(len(self.chunk_ranges[g]))}
        store.before_reads(self.before_read)

    def set_device_share(self, ratio: float) -> None:
        """offload_optimizer.ratio: the share of each group's state offloaded; the rest (whole buckets from the
        group's start) is stepped on the device."""
        share = DeviceShare(self.optimizer, self.masters, self.chunk_ranges, ratio, self.device, self.lp_dtypes)
        self.share = share if share.active() else None

    @contextlib.contextmanager
    def resident(self) -> Any:
        """The whole optimizer state in host memory for its readers (checkpoints), the device share re-read
        afterwards (a load may have written it)."""
        self.settle()
        outer = self.resident_depth == 0  # nested uses (a load's refresh inside it) see the host as it is
        self.resident_depth += 1
        try:
            if outer and self.share is not None:
                self.share.to_host(self.masters)
            with super().resident():
                yield
        finally:
            self.resident_depth -= 1
        if outer and self.share is not None:
            self.share.from_host(self.masters)

    def set_speculation(self, coef: Callable[[], float], may_roll_back: bool = True) -> None:
        """The coefficient the speculative step assumes (1 / the loss scale of the running backward), and
        whether a step can disagree with it at all (gradient clipping, loss scaling or an overflow check):
        without, every speculative step commits and no snapshot is taken (zero_grad without a step then
        inverts the update arithmetically, see rollback)."""
        self.spec_coef = coef
        if may_roll_back and self.spare is None:
            self.spare = [None] * len(self.sizes)
        elif not may_roll_back:
            self.spare = None

    # -- backward: each final chunk staged, then stepped speculatively ---------------------------------
    def _stage_chunk(self, g: int, start: int, end: int, chunk: torch.Tensor) -> None:
        self.settle()  # the last step's host work is done before this backward's gradients overwrite its input
        if self.share is not None and self.share.on_device(g, end):
            self._staged[g] += end - start  # the device steps it: nothing goes to the host
            return
        super()._stage_chunk(g, start, end, chunk)
        if not self.speculating:
            return
        arrived = None
        if self.cuda:
            arrived = torch.cuda.Event()
            arrived.record()
        coef = self.spec_coef()
        if coef != 1.0 and self.grad_dtypes[g] == torch.float32:
            return  # the kernel would unscale fp32 gradients in place: this step runs the ordinary way
        self.queued.append((g, start, end))
        self.queued_coef = coef
        # the hyperparameters as of this backward: a deferred step may still run after a scheduler changed them
        group = dict(self.optimizer.param_groups[g])
        self.jobs.put(self._order(g, start), ("spec", g, start, end, arrived, coef, group),
                      None if arrived is None else arrived.query)

    def _order(self, g: int, start: int) -> tuple:
        """Where a chunk comes in the next forward: each group is laid out in module order, so its depth is the
        chunk's place in its group (groups, say with and without weight decay, interleave by depth)."""
        return (start / max(1, self.sizes[g]), g, start)

    def _work(self) -> None:
        if self.threads is not None:
            self.optimizer.ds_opt_op.num_threads(self.threads)
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                t0 = time.perf_counter()
                if job[0] == "spec":
                    self._speculate(*job[1:])
                else:
                    self._plain_bucket(*job[1:])
                self.worker_s += time.perf_counter() - t0
            except BaseException as e:  # reported at the step
                self.errors.append(e)
                self.tracker.fail(e)
            finally:
                self.jobs.task_done()

    @torch.no_grad()
    def _speculate(self, g: int, start: int, end: int, arrived: Any, coef: float, group: dict) -> None:
        if arrived is not None:
            arrived.synchronize()
        opt = self.optimizer
        master = self.masters[g]
        state = opt.ready_state(opt.param_groups[g], master, f"params[{g}][0]")
        if g not in self.bumped:
            opt.ds_opt_op.bump_steps([state["step"]])
            self.bumped.add(g)
        step = int(state["step"].item())
        self.stepped.append((g, start, end))
        self.coef_used = coef
        host = self.host_grads[g]
        assert host is not None
        last_up = self._last_h2d  # the previous step's copies up still read the host weights: awaited first
        if last_up is not None:
            last_up.synchronize()
        if self.spare is None:
            # one C call for the whole chunk (its copy up waits for all of it anyway): each call returns into the
            # GIL, which the training thread holds while it runs Python (up to sys.getswitchinterval(), 5 ms,
            # a wait): sub-chunk calls made the worker wait for the GIL hundreds of times a step
            self._kernel(group, state, master, host, self.host_lp[g], start, end, coef, step)
            lp = self.host_lp[g]
            self._done(g, start, end, lp if lp is not None else master.detach())
            return
        if self.spare[g] is None:
            pin = self.cuda and self.host_lp[g] is None  # the master itself is the copy up's source only then
            self.spare[g] = {"master": host_empty(master.numel(), master.dtype, pin),
                             **{k: host_empty(state[k].numel(), state[k].dtype, pin) for k in opt.MOMENTS}}
        out = self.spare[g]
        lp = self.host_lp[g]
        w = master.detach()
        # the coefficient folded into the kernel (an fp32 multiply as it reads the gradient): no scaled copy; one
        # call for the whole chunk, GIL released throughout (see above)
        opt.step_tensors_into(group, [w[start:end]], [host[start:end]], [[state[k][start:end]] for k in opt.MOMENTS],
                              None if lp is None else [lp[start:end]], [out["master"][start:end]],
                              [[out[k][start:end]] for k in opt.MOMENTS], step, grad_scale=coef)
        self._done(g, start, end, lp if lp is not None else out["master"])

    @torch.no_grad()
    def _plain_bucket(self, g: int, b: int, coef: float, step: int, group: dict) -> None:
        """The deferred ordinary step of bucket b of group g (worker thread)."""
        start, end = self.chunk_ranges[g][b]
        master = self.masters[g]
        state = self.optimizer.state[master]
        grad, lp = self.host_grads[g], self.host_lp[g]
        self._kernel(group, state, master, grad, lp, start, end, coef, step)  # one call: one GIL wait (_speculate)
        self._done(g, start, end, lp if lp is not None else master.detach())

    def _done(self, g: int, start: int, end: int, src: torch.Tensor) -> None:
        """[start, end) of group g is stepped, its model-dtype result in src: sent up (GPU) and marked."""
        self.tracker.stepped(g, start, end, self._send_up(g, start, end, src), src)

    def _send_up(self, g: int, start: int, end: int, src: torch.Tensor) -> Any:
        """The result [start, end) of group g into the device staging buffer (GPU; worker thread): the event
        that follows the copy."""
        if self.up_stream is None:
            return None
        if self.dev_stage is None:
            self.dev_stage = [torch.empty(n, dtype=dt, device=self.device) for n, dt in zip(self.sizes, self.lp_dtypes)]
        with torch.cuda.stream(self.up_stream):
            if self.stage_free is not None:  # the last commit's gathers read the buffer until then
                self.up_stream.wait_event(self.stage_free)
            t0 = self._event()
            self.dev_stage[g][start:end].copy_(src[start:end], non_blocking=True)
            t1 = self._event()
        self.stats.record_copy("h2d", t0, t1)
        self.stats.h2d_bytes += (end - start) * src.element_size()
        self.up_event = t1
        return t1

    def _drain(self) -> None:
        t0 = time.perf_counter()
        self.jobs.join()
        self.drain_s += time.perf_counter() - t0
        if self.errors:
            err, self.errors = self.errors[0], []
            self._undo()
            raise err

    # -- the step: commit or roll back -------------------------------------------------------------------
    def complete(self, ranges: Optional[Sequence[tuple[int, int, int]]] = None) -> bool:
        """Whether `ranges` (default: the speculatively stepped ones) cover every host-stepped element."""
        covered = [0] * len(self.sizes)
        for g, start, end in (self.stepped if ranges is None else ranges):
            covered[g] += end - start
        cut = self.share.cut if self.share is not None else [0] * len(self.sizes)
        return covered == [n - c for n, c in zip(self.sizes, cut)]

    @torch.no_grad()
    def step(self, coef: float, gatherer: Any, parts: Sequence[Optional[torch.Tensor]]) -> None:
        self.settle()
        if self.store is not None and self.defer:
            self._deferred_step(coef, gatherer, parts)
            return
        self._drain()
        self.queued, self.queued_coef = [], None
        self.tracker.clear()  # only a deferred step waits on it
        if self.share is not None:
            self.share.step(coef, parts, gatherer, self.chunk_ranges)
        if self.stepped and self.complete() and coef == self.coef_used:
            self._commit(gatherer)
            return
        if not self.stepped:
            self.plain_steps += 1
        self._undo()
        # the next backward speculates when this step's coefficient is the one it would have assumed (unclipped)
        self.speculating = coef == self.spec_coef()
        super().step(coef, gatherer, parts)

    def rollback(self) -> None:
        """The step was skipped (overflow), or gradients were dropped without one: the speculation is undone."""
        self.settle()
        self._drain()
        self._undo()

    # -- the deferred step (a ZeRO-3 store attached) -------------------------------------------------------
    def _deferred_step(self, coef: float, gatherer: Any, parts: Sequence[Optional[torch.Tensor]]) -> None:
        """Decides the step and returns: the speculation commits as its chunks finish, or the ordinary step's
        buckets go to the worker (the first layers first); the model takes each bucket when it reads it."""
        self.writer = gatherer
        self.compute_stream = torch.cuda.current_stream() if self.cuda else None
        self.deferred_steps += 1
        if self.share is not None:
            self.share.step(coef, parts, gatherer, self.chunk_ranges)
        if self.queued and self.complete(self.queued) and coef == self.queued_coef:
            self.inflight = "commit"  # the chunks still queued finish in the background
        else:
            self._drain()
            if not self.stepped:
                self.plain_steps += 1
            self._undo()
            self.tracker.clear()
            self.speculating = coef == self.spec_coef()
            self._host_grads(parts)  # every gradient chunk in host memory
            if self._last_h2d is not None:  # the pinned host weights are about to be rewritten
                self._last_h2d.synchronize()
                self._last_h2d = None
            opt = self.optimizer
            for g, master in enumerate(self.masters):
                state = opt.ready_state(opt.param_groups[g], master, f"params[{g}][0]")
                step = int(opt.ds_opt_op.bump_steps([state["step"]])[0])
                group = dict(opt.param_groups[g])  # a scheduler may change the live one before the worker reads it
                for b in self._host_buckets(g):
                    self.jobs.put(self._order(g, self.chunk_ranges[g][b][0]), ("plain", g, b, coef, step, group))
            self.inflight = "plain"
        self.queued, self.queued_coef = [], None
        self._staged = [0] * len(self.sizes)
        self._last_d2h = None
        self.deferred = {(g, b) for g in range(len(self.masters)) for b in self._host_buckets(g)}
        gatherer.finish()  # gathered copies are stale: the next reads gather again, taking the new buckets first

    def _host_buckets(self, g: int) -> list[int]:
        """Group g's buckets the host steps: past the device share, and not empty on this rank."""
        first = self.share.buckets[g] if self.share is not None else 0
        return [b for b, (start, end) in enumerate(self.chunk_ranges[g]) if b >= first and end > start]

    def before_read(self, units: Sequence[int]) -> None:
        """The store is about to read these units' shards (a forward's gather, GatheredParameters): their
        buckets of the deferred step go into the shards first."""
        if not self.deferred:
            return
        for u in units:
            key = self.unit_key.get(u)
            if key is not None and key in self.deferred:
                self._commit_bucket(key)
        if not self.deferred:
            self.settle()

    def _commit_bucket(self, key: tuple[int, int]) -> None:
        event, source = self.tracker.wait(key)
        g, b = key
        start, end = self.chunk_ranges[g][b]
        if self.cuda:
            with torch.cuda.stream(self.compute_stream):
                self.compute_stream.wait_event(event)
                assert self.dev_stage is not None
                self.writer.submit(g, b, self.dev_stage[g][start:end])
        else:
            self.writer.submit(g, b, source[start:end])
        self.deferred.discard(key)

    def settle(self) -> None:
        """The deferred step finished: every bucket in the model, the worker idle, a commit's spares live."""
        if self.inflight is None:
            return
        for key in sorted(self.deferred):  # buckets no forward read yet
            self._commit_bucket(key)
        self._drain()
        self.stats.collect()  # the worker's copy timings (their list would grow step after step)
        if self.inflight == "commit":
            self._swap_in_spares()
            self.stepped, self.bumped, self.coef_used = [], set(), None
            self.commits += 1
        self.stats.steps += 1
        if self.cuda:
            with torch.cuda.stream(self.compute_stream):
                self.stage_free = torch.cuda.Event()
                self.stage_free.record()
            self._last_h2d, self.up_event = self.up_event, None  # host weights rewritten only after these copies
        self.tracker.clear()
        self.inflight = None

    def _undo(self) -> None:
        self.queued, self.queued_coef = [], None
        self.tracker.clear()
        if self.up_event is not None:  # whatever went up is ignored (the staging buffer is not the model), but
            self.up_event.synchronize()  # its copies read the host weights the ordinary step rewrites
            self.up_event = None
        if not self.stepped:
            return
        opt = self.optimizer
        for g, start, end in self.stepped:
            if self.spare is not None:
                continue  # the speculative results went to the spare buffers: the live state is untouched
            # stepped in place (nothing could make the step disagree, yet it was not taken): invert the update
            from deepspeed_c.ops.adam.cpu_adam import adam_inverse

            state = opt.state[self.masters[g]]
            master = self.masters[g].detach()
            host = self.host_grads[g]
            assert host is not None
            adam_inverse(master[start:end], host[start:end], state["exp_avg"][start:end],
                         state["exp_avg_sq"][start:end], opt.param_groups[g], int(state["step"].item()),
                         bool(getattr(opt, "adam_w_mode", True)))
        for g in self.bumped:
            opt.state[self.masters[g]]["step"] -= 1
        self.stepped, self.bumped, self.coef_used = [], set(), None
        self.rollbacks += 1

    def _commit(self, gatherer: Any) -> None:
        """The speculative results go to the device and into their buckets' gathers (the step itself is done)."""
        self._staged = [0] * len(self.sizes)
        self._last_d2h = None  # every chunk's copy was awaited by its speculative step
        if self._last_h2d is not None:
            self._last_h2d.synchronize()
            self._last_h2d = None
        self.stats.collect()
        self._swap_in_spares()
        if self.cuda and self.dev_stage is not None and self.up_event is not None:
            self._commit_staged(gatherer)
            return
        dev_lps: list[Optional[torch.Tensor]] = [None] * len(self.masters)
        if self.cuda:
            dev_lps = [torch.empty(n, dtype=dt, device=self.device) for n, dt in zip(self.sizes, self.lp_dtypes)]
            self.stream.wait_stream(torch.cuda.current_stream())
        for g, master in enumerate(self.masters):
            lp = self.host_lp[g]
            src = lp if lp is not None else master.detach()
            for b, (start, end) in enumerate(self.chunk_ranges[g]):
                if self.share is not None and b < self.share.buckets[g]:
                    continue  # stepped and gathered on the device
                dev = dev_lps[g]
                if dev is not None:
                    for lo in range(start, end, self.sub_chunk):
                        hi = min(end, lo + self.sub_chunk)
                        self._to_device(dev[lo:hi], src[lo:hi])
                self._submit_bucket(gatherer, g, b, start, end, src, dev)
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self._last_h2d = self._event()
        gatherer.finish()
        self.stepped, self.bumped, self.coef_used = [], set(), None
        self.commits += 1
        self.stats.steps += 1

    def _commit_staged(self, gatherer: Any) -> None:
        """GPU commit: every chunk is on its way up already; the compute stream awaits the last copy and the
        buckets' gathers read the staging buffer."""
        assert self.dev_stage is not None
        up = self.up_event
        torch.cuda.current_stream().wait_event(up)
        for g in range(len(self.masters)):
            for b, (start, end) in enumerate(self.chunk_ranges[g]):
                if self.share is not None and b < self.share.buckets[g]:
                    continue  # stepped and gathered on the device
                gatherer.submit(g, b, self.dev_stage[g][start:end])
        gatherer.finish()
        self.stage_free = torch.cuda.Event()
        self.stage_free.record()
        self._last_h2d, self.up_event = up, None  # host weights are rewritten only once these copies are done
        self.stepped, self.bumped, self.coef_used = [], set(), None
        self.commits += 1
        self.stats.steps += 1

    def _step_group(self, g: int, master: torch.Tensor, grad: torch.Tensor, coef: float, gatherer: Any,
                    dev_lp: Optional[torch.Tensor]) -> None:
        """The ordinary host step of group g (CPUOffload's), without the buckets the device steps."""
        opt = self.optimizer
        group = opt.param_groups[g]
        lp = self.host_lp[g]
        src = lp if lp is not None else master.detach()
        state = opt.ready_state(group, master, f"params[{g}][0]")
        step = int(opt.ds_opt_op.bump_steps([state["step"]])[0])
        first = self.share.buckets[g] if self.share is not None else 0
        for b, (start, end) in enumerate(self.chunk_ranges[g]):
            if b < first:
                continue
            for lo in range(start, end, self.sub_chunk):
                hi = min(end, lo + self.sub_chunk)
                self._kernel(group, state, master, grad, lp, lo, hi, coef, step)
                if dev_lp is not None:
                    self._to_device(dev_lp[lo:hi], src[lo:hi])
            self._submit_bucket(gatherer, g, b, start, end, src, dev_lp)

    def _swap_in_spares(self) -> None:
        """The spare buffers holding the committed step become the live master and moments (the tensors keep
        their identity: the master's storage is swapped under it); the old ones are the next step's spares."""
        if self.spare is None:
            return
        opt = self.optimizer
        for g, master in enumerate(self.masters):
            out = self.spare[g]
            if out is None:
                continue
            state = opt.state[master]
            old = master.data
            master.data = out["master"]
            out["master"] = old
            for k in opt.MOMENTS:
                state[k], out[k] = out[k], state[k]

    def reset(self) -> None:
        """Gradients dropped without a step (zero_grad, a skipped step): any speculation is undone. Right after
        a step (the engine's zero_grad) there is none: a deferred step goes on."""
        if self.inflight is None:
            self.rollback()
        super().reset()

    def close(self) -> None:
        self.rollback()
        if self.store is not None:
            self.store.before_reads(None)
        self.jobs.put((float("inf"),), None)
        self.worker.join(timeout=30)
        if self.switch_held:  # close may run twice (destroy, then the interpreter's exit)
            self.switch_held = False
            _hold_switch_interval(False)
        super().close()

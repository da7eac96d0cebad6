"""What the engine reports about training, as a collaborator: wall-clock timers
(`wall_clock_breakdown`), the throughput timer, the `steps_per_print` progress line and the
monitor events (TensorBoard, CSV, W&B, Comet through deepspeed_c.monitor.MonitorMaster)."""
from __future__ import annotations

import math
import time
from typing import Any, Optional

from deepspeed_c.utils import timer as timers_mod
from deepspeed_c.utils.logging import log_dist

FORWARD_TIMERS = (timers_mod.FORWARD_MICRO_TIMER, timers_mod.FORWARD_GLOBAL_TIMER)
BACKWARD_TIMERS = (timers_mod.BACKWARD_MICRO_TIMER, timers_mod.BACKWARD_GLOBAL_TIMER)
BACKWARD_INNER_TIMERS = (timers_mod.BACKWARD_INNER_MICRO_TIMER, timers_mod.BACKWARD_INNER_GLOBAL_TIMER)
BACKWARD_REDUCE_TIMERS = (timers_mod.BACKWARD_REDUCE_MICRO_TIMER, timers_mod.BACKWARD_REDUCE_GLOBAL_TIMER)
STEP_TIMERS = (timers_mod.STEP_MICRO_TIMER, timers_mod.STEP_GLOBAL_TIMER)
MICRO_TIMERS = [names[0] for names in (FORWARD_TIMERS, BACKWARD_TIMERS, BACKWARD_INNER_TIMERS,
                                       BACKWARD_REDUCE_TIMERS, STEP_TIMERS)]
GLOBAL_TIMERS = [names[1] for names in (FORWARD_TIMERS, BACKWARD_TIMERS, BACKWARD_INNER_TIMERS,
                                        BACKWARD_REDUCE_TIMERS, STEP_TIMERS)]


def _monitor_master(monitor_config: Any) -> Optional[Any]:
    if not getattr(monitor_config, "enabled", False):
        return None
    try:
        from deepspeed_c.monitor import MonitorMaster
    except ImportError:
        raise NotImplementedError("deepspeed_c: a monitor section (tensorboard / wandb / csv_monitor / comet) is "
                                  "enabled but deepspeed_c.monitor.MonitorMaster is not available") from None
    return MonitorMaster(monitor_config)


class EngineReport:

    def __init__(self, config: Any, global_rank: int) -> None:
        self.global_rank = global_rank
        self.wall_clock_breakdown = bool(config.wall_clock_breakdown)
        self.memory_breakdown = bool(config.memory_breakdown)
        spp = config.steps_per_print
        self.steps_per_print: Optional[int] = None if spp is None or spp == math.inf else int(spp)
        self.timers = timers_mod.SynchronizedWallClockTimer() if self.wall_clock_breakdown else timers_mod.NoopTimer()
        self.tput_timer = timers_mod.ThroughputTimer(config.timers_config.throughput,
                                                     batch_size=config.train_batch_size,
                                                     steps_per_output=self.steps_per_print)
        self.monitor = _monitor_master(config.monitor_config)
        self.timer_cache: dict[str, float] = {}
        self._losses: list[float] = []
        self._last_report = time.perf_counter()
        self._samples_since_report = 0

    # -- timers ----------------------------------------------------------------------------------
    def start(self, names: tuple[str, ...]) -> None:
        if self.wall_clock_breakdown:
            for name in names:
                self.timers(name).start()

    def stop(self, names: tuple[str, ...]) -> None:
        if self.wall_clock_breakdown:
            for name in names:
                self.timers(name).stop()

    # -- per micro-step and per step -------------------------------------------------------------
    def record_loss(self, loss: Any) -> None:
        self._losses.append(loss)

    def after_step(self, *, boundary: bool, global_steps: int, global_samples: int, skipped_steps: int,
                   lr: list[float], mom: list[Any], loss_scale: Optional[float], train_batch_size: int) -> None:
        """Called at the end of every engine.step(); global_steps is already advanced on a boundary."""
        report = boundary and (self.global_rank == 0)
        self.tput_timer.stop(global_step=boundary, report_speed=report)
        if not boundary:
            if self.wall_clock_breakdown:
                self._update_cache()
                self.timers.log(names=MICRO_TIMERS, memory_breakdown=self.memory_breakdown)
            return
        losses, self._losses = self._losses, []
        printing = self.steps_per_print is not None and global_steps % self.steps_per_print == 0
        loss = None
        if losses and (printing or self.monitor is not None):
            loss = float(sum(float(x) for x in losses) / len(losses))
        self._samples_since_report += train_batch_size
        if printing:
            now = time.perf_counter()
            rate = self._samples_since_report / max(now - self._last_report, 1e-9)
            self._last_report, self._samples_since_report = now, 0
            parts = [f"step={global_steps}", f"skipped={skipped_steps}", f"lr={lr}", f"mom={mom}"]
            if loss is not None:
                parts.append(f"loss={loss:.6g}")
            if loss_scale is not None:
                parts.append(f"loss_scale={loss_scale:g}")
            parts.append(f"samples/sec={rate:.3f}")
            log_dist(", ".join(parts), ranks=[0])
        if self.monitor is not None and self.global_rank == 0:
            events = [("Train/Samples/lr", lr[0] if lr else 0.0, global_samples)]
            if loss is not None:
                events.append(("Train/Samples/train_loss", loss, global_samples))
            if loss_scale is not None:
                events.append(("Train/Samples/loss_scale", loss_scale, global_samples))
            if self.wall_clock_breakdown:
                events += [(f"Train/Samples/elapsed_time_ms_{label}", self.timers(name).elapsed(reset=False),
                            global_samples) for label, name in (
                                ("forward", timers_mod.FORWARD_GLOBAL_TIMER),
                                ("backward", timers_mod.BACKWARD_GLOBAL_TIMER),
                                ("backward_inner", timers_mod.BACKWARD_INNER_GLOBAL_TIMER),
                                ("backward_allreduce", timers_mod.BACKWARD_REDUCE_GLOBAL_TIMER),
                                ("step", timers_mod.STEP_GLOBAL_TIMER))]
            self.monitor.write_events(events)
        if self.wall_clock_breakdown:
            self._update_cache()
            self.timers.log(names=MICRO_TIMERS, memory_breakdown=self.memory_breakdown)
            self.timers.log(names=GLOBAL_TIMERS)

    def _update_cache(self) -> None:
        self.timer_cache = {name: self.timers(name).elapsed(reset=False) for name in MICRO_TIMERS + GLOBAL_TIMERS}

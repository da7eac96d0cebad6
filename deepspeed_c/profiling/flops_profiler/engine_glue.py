"""The engine's side of the `flops_profiler` config section, as a collaborator the engine holds.

As in DeepSpeed: on global rank 0, every forward of global step `profile_step` runs under the
profiler (start_profile before, stop_profile after, so the backward and the optimizer step run on
an unpatched torch); the step() of that global step prints the profile with the engine's fwd/bwd/
step timers (the config turns wall_clock_breakdown on) and ends it. Unlike DeepSpeed, which prints
at every micro-step of that step under gradient accumulation, the profile is printed once, at the
accumulation boundary (the last micro-step's forward is the one counted)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from deepspeed_c.profiling.flops_profiler.profiler import FlopsProfiler


class EngineFlopsProfile:

    def __init__(self, config: Any, global_rank: int, profiler: Optional[FlopsProfiler] = None,
                 autotuning: Any = None) -> None:
        """config: the flops_profiler section; profiler: the FlopsProfiler of the model (None when neither
        the profiler nor autotuning is on); autotuning: an autotuning experiment's AutotuningMetrics
        (deepspeed_c/autotuning/metrics.py), which profiles (silently) its first measured step, times the
        measured steps and writes the metrics. The engine builds them (runtime/engine/profile_setup.py)."""
        self.config = config
        self.global_rank = global_rank
        self.profiler = profiler
        self.autotuning = autotuning
        self.profile_step = autotuning.config.start_profile_step if autotuning is not None else config.profile_step

    def active(self, global_steps: int) -> bool:
        return self.profiler is not None and self.global_rank == 0 and global_steps == self.profile_step

    @contextlib.contextmanager
    def forward(self, global_steps: int) -> Iterator[None]:
        """Wraps the model's forward; torch is restored even when the forward raises."""
        if self.autotuning is not None and self.autotuning.probing:
            with self.autotuning.measure_activations():
                yield
            return
        if not self.active(global_steps):
            yield
            return
        self.profiler.start_profile(ignore_list=None)
        try:
            yield
        finally:
            self.profiler.stop_profile()

    def after_step(self, was_active: bool, boundary: bool, global_steps: int) -> None:
        """was_active: active() taken at the start of step(), before global_steps advanced."""
        if self.autotuning is not None:
            if was_active and self.profiler is not None:
                self.autotuning.fwd_flops = 3 * self.profiler.get_total_flops()
                self.profiler.end_profile()
            self.autotuning.after_step(boundary, global_steps)
            return
        if not was_active or self.profiler is None:
            return
        if boundary:
            cfg = self.config
            self.profiler.print_model_profile(profile_step=global_steps, module_depth=cfg.module_depth,
                                              top_modules=cfg.top_modules, detailed=cfg.detailed,
                                              output_file=cfg.output_file)
        self.profiler.end_profile()

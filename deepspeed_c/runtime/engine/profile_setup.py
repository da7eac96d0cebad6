"""The engine building its flops-profile collaborator (the `flops_profiler` section and an autotuning
experiment's metrics): the FlopsProfiler gets the engine as its `ds_engine`, as in DeepSpeed, for the
summary's timers and sizes; AutotuningMetrics gets the model and the batch-size accessors."""
from __future__ import annotations

from typing import Any

from deepspeed_c.profiling.flops_profiler.engine_glue import EngineFlopsProfile


def build_flops_profile(engine: Any, config: Any) -> EngineFlopsProfile:
    """config: the engine's DeepSpeedConfig."""
    flops_cfg = config.flops_profiler_config
    tuning = getattr(config, "autotuning_config", None)
    autotuning = None
    if tuning is not None and tuning.enabled:
        from deepspeed_c.autotuning.metrics import AutotuningMetrics

        autotuning = AutotuningMetrics(tuning, engine.module, global_rank=engine.global_rank,
                                       train_micro_batch_size_per_gpu=engine.train_micro_batch_size_per_gpu,
                                       train_batch_size=engine.train_batch_size,
                                       gradient_accumulation_steps=engine.gradient_accumulation_steps)
    profiler = None
    if flops_cfg.enabled or autotuning is not None:
        from deepspeed_c.profiling.flops_profiler.profiler import FlopsProfiler

        profiler = FlopsProfiler(engine.module, engine, flops_cfg.recompute_fwd_factor)
    return EngineFlopsProfile(flops_cfg, engine.global_rank, profiler, autotuning)

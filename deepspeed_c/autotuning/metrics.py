"""The engine's side of an autotuning experiment: the experiment's config carries
`autotuning.enabled` and `autotuning.metric_path`; the engine times global steps
start_profile_step+1 .. end_profile_step (wall clock, device synchronised, all ranks barriered),
rank 0 writes {"latency", "throughput", "FLOPS_per_gpu"} as JSON to metric_path, and every rank
exits with status 0 (as DeepSpeed's engine does) so the experiment ends without running the rest
of the script."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional


def _sync_all() -> None:
    import torch.distributed as dist

    from deepspeed_c.accelerator import get_accelerator

    get_accelerator().synchronize()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class AutotuningMetrics:

    def __init__(self, engine: Any, config: Any) -> None:
        self.config = config
        self.engine = engine
        self._t0: Optional[float] = None
        self.fwd_flops = 0.0  # 3 x one micro-batch's forward flops, from the profiled step (DeepSpeed's estimate)

    def after_step(self, boundary: bool, global_steps: int) -> None:
        if not boundary:
            return
        cfg = self.config
        if global_steps == cfg.start_profile_step:
            _sync_all()
            self._t0 = time.perf_counter()
        if global_steps < cfg.end_profile_step or self._t0 is None:
            return
        _sync_all()
        steps = max(cfg.end_profile_step - cfg.start_profile_step, 1)
        latency = (time.perf_counter() - self._t0) / steps  # seconds per global step
        gas = self.engine.gradient_accumulation_steps()
        metrics = {"latency": latency, "throughput": self.engine.train_batch_size() / latency,
                   "FLOPS_per_gpu": self.fwd_flops * gas / latency}
        if self.engine.global_rank == 0 and cfg.metric_path:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metric_path)), exist_ok=True)
            with open(cfg.metric_path, "w") as f:
                json.dump(metrics, f)
        _sync_all()
        print(f"Autotuning: done with running current ds config ({metrics})", flush=True)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # exiting with a live gloo group can abort the process
        sys.exit(0)

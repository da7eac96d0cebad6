"""The engine's side of an autotuning experiment: the experiment's config carries
`autotuning.enabled` and `autotuning.metric_path`; the engine times global steps
start_profile_step+1 .. end_profile_step (wall clock, device synchronised, all ranks barriered),
rank 0 writes {"latency", "throughput", "FLOPS_per_gpu"} as JSON to metric_path, and every rank
exits with status 0 (as DeepSpeed's engine does) so the experiment ends without running the rest
of the script.

A probe experiment (`autotuning.model_info: {"profile": true}` and `model_info_path`) instead
measures, over its first forward, the bytes of the tensors autograd saves for backward (the
activation memory of one micro-batch, each storage counted once), and rank 0 writes
{"num_params", "trainable_num_params", "activation_mem_per_sample"} to model_info_path; the
tuner's memory model (autotuning/memory.py) uses it to skip points that cannot fit."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch


def _sync_all() -> None:
    import torch.distributed as dist

    from deepspeed_c.accelerator import get_accelerator

    get_accelerator().synchronize()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class AutotuningMetrics:

    def __init__(self, config: Any, module: torch.nn.Module, *, global_rank: int,
                 train_micro_batch_size_per_gpu: Callable[[], int], train_batch_size: Callable[[], int],
                 gradient_accumulation_steps: Callable[[], int]) -> None:
        """config: the autotuning section; module: the trained model; the batch sizes as callables (they
        read the engine's current values, which set_train_batch_size may change)."""
        self.config = config
        self.module = module
        self.global_rank = global_rank
        self.train_micro_batch_size_per_gpu = train_micro_batch_size_per_gpu
        self.train_batch_size = train_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._t0: Optional[float] = None
        self._activation_bytes: Optional[int] = None
        self.fwd_flops = 0.0  # 3 x one micro-batch's forward flops, from the profiled step (DeepSpeed's estimate)

    @property
    def probing(self) -> bool:
        info = self.config.model_info or {}
        return bool(info.get("profile", False)) and bool(self.config.model_info_path)

    @contextlib.contextmanager
    def measure_activations(self) -> Iterator[None]:
        if self._activation_bytes is not None:  # the first forward only
            yield
            return
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # e.g. a tensor without storage
                pass
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        # parameters are saved too (as matmul operands): they are model states, not activations
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters() if p.numel()}
        self._activation_bytes = sum(n for ptr, n in seen.items() if ptr not in params)

    def _write_model_info(self) -> None:
        _sync_all()
        params = list(self.module.parameters())
        numel = [int(getattr(p, "ds_numel", p.numel())) for p in params]
        info = {"num_params": sum(numel),
                "trainable_num_params": sum(n for n, p in zip(numel, params) if p.requires_grad),
                "activation_mem_per_sample": (self._activation_bytes or 0)
                / self.train_micro_batch_size_per_gpu()}
        if self.global_rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.config.model_info_path)), exist_ok=True)
            with open(self.config.model_info_path, "w") as f:
                json.dump(info, f)
        self._exit(f"Autotuning: model info {info}")

    def _exit(self, message: str) -> None:
        _sync_all()
        print(message, flush=True)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # exiting with a live gloo group can abort the process
        sys.exit(0)

    def after_step(self, boundary: bool, global_steps: int) -> None:
        if not boundary:
            return
        if self.probing:
            self._write_model_info()
        cfg = self.config
        if global_steps == cfg.start_profile_step:
            _sync_all()
            self._t0 = time.perf_counter()
        if global_steps < cfg.end_profile_step or self._t0 is None:
            return
        _sync_all()
        steps = max(cfg.end_profile_step - cfg.start_profile_step, 1)
        latency = (time.perf_counter() - self._t0) / steps  # seconds per global step
        gas = self.gradient_accumulation_steps()
        metrics = {"latency": latency, "throughput": self.train_batch_size() / latency,
                   "FLOPS_per_gpu": self.fwd_flops * gas / latency}
        if self.global_rank == 0 and cfg.metric_path:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metric_path)), exist_ok=True)
            with open(cfg.metric_path, "w") as f:
                json.dump(metrics, f)
        self._exit(f"Autotuning: done with running current ds config ({metrics})")

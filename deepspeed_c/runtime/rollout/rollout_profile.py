"""Timing of HybridEngineRollout.generate (HybridEngineRolloutConfig.enable_profiling): the split DeepSpeed's
get_last_profile() reports, including the prefill forward and the decode forwards of the model that generated.

The generating model is not always engine.module (the hybrid engine generates on its fused copy, built lazily),
so forwards are observed through process-wide module hooks kept only for the duration of one generate: a
forward counts when it enters a module that has `generate` (a Hugging Face causal LM) and no such forward is
already running. Device work is timed with the accelerator's events where it runs asynchronously, with the host
clock where it does not (CPU)."""
from __future__ import annotations

import time
from typing import Any, Optional

import torch


class ForwardTimer:
    """Records (start, end) of every outermost causal-LM forward while installed."""

    def __init__(self, accelerator: Any) -> None:
        self._host = accelerator.use_host_timers()
        self._event = accelerator.Event
        self._depth = 0
        self._start: Any = None
        self.spans: list[tuple[Any, Any]] = []
        self._handles: list[Any] = []

    def _now(self) -> Any:
        if self._host:
            return time.perf_counter()
        event = self._event(enable_timing=True)
        event.record()
        return event

    def _pre(self, module: torch.nn.Module, _args: Any) -> None:
        if callable(getattr(module, "generate", None)):
            self._depth += 1
            if self._depth == 1:
                self._start = self._now()

    def _post(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if callable(getattr(module, "generate", None)) and self._depth > 0:
            self._depth -= 1
            if self._depth == 0:
                self.spans.append((self._start, self._now()))

    def __enter__(self) -> "ForwardTimer":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def span_ms(self, span: tuple[Any, Any]) -> float:
        start, end = span
        return (end - start) * 1000.0 if self._host else float(start.elapsed_time(end))

    def stage_times(self) -> tuple[Optional[float], Optional[float], int]:
        """(prefill ms, decode ms in total, number of decode forwards); (None, None, 0) when none ran."""
        if not self.spans:
            return None, None, 0
        times = [self.span_ms(span) for span in self.spans]
        return times[0], sum(times[1:]), len(times) - 1


def profile_dict(marks: dict[str, float], timer: Optional[ForwardTimer], batch_rows: int, response_len: int,
                 prompts: int, samples: int, prompt_len: int) -> dict[str, Any]:
    """DeepSpeed's profile keys from the host marks start / expanded / generated / done (seconds)."""
    generation_ms = (marks["generated"] - marks["expanded"]) * 1000.0
    total_ms = (marks["done"] - marks["start"]) * 1000.0
    prefill, decode, decodes = timer.stage_times() if timer is not None else (None, None, 0)
    overhead = generation_ms if prefill is None else max(0.0, generation_ms - prefill - decode)
    tokens = batch_rows * response_len
    return {"prompt_expansion_ms": (marks["expanded"] - marks["start"]) * 1000.0, "generation_ms": generation_ms,
            "prefill_forward_ms": prefill, "decode_forward_ms": decode, "generation_overhead_ms": overhead,
            "num_decode_forwards": decodes, "post_processing_ms": (marks["done"] - marks["generated"]) * 1000.0,
            "total_ms": total_ms, "num_generated_tokens": tokens,
            "tokens_per_second": tokens / (total_ms / 1000.0) if total_ms > 0.0 else 0.0,
            "batch_size": prompts, "num_samples_per_prompt": samples, "prompt_length": prompt_len,
            "response_length": response_len}


def continuous_stats(counters: dict[str, Any], marks: dict[str, float]) -> dict[str, Any]:
    """get_last_continuous_stats() under DeepSpeed's keys. deepspeed_c's continuous path keeps no KV cache
    (continuous_rollout.py): cache_capacity is None, nothing is trimmed, and peak_cache_length is the widest
    sequence a forward saw. end_to_end_ms and tokens_per_second need enable_profiling (None otherwise)."""
    timed = "start" in marks
    total_ms = (marks["generated"] - marks["start"]) * 1000.0 if timed else None
    tokens = counters["num_generated_tokens"]
    return {"cache_capacity": None, "peak_cache_length": counters["peak_cache_length"], "cache_memory_bytes": 0,
            "trim_count": 0, "trimmed_columns": 0, "trim_latency_ms": 0.0, "trim_bytes_moved": 0,
            "trim_frequency": 0.0, "decode_steps": counters["decode_steps"], "end_to_end_ms": total_ms,
            "tokens_per_second": (tokens / (total_ms / 1000.0) if total_ms else 0.0) if timed else None,
            "num_generated_tokens": tokens, "active_batch_sizes": list(counters["active_batch_sizes"])}


def continuous_profile(marks: dict[str, float], timer: ForwardTimer, counters: dict[str, Any], batch: Any,
                       max_batch_size: int) -> dict[str, Any]:
    """get_last_profile() after a continuous-batching generate, under DeepSpeed's keys. One forward here serves
    both the rows just admitted and the running ones: a forward that started rows only counts as prefill time,
    every other forward as decode time."""
    spans = [timer.span_ms(span) for span in timer.spans]
    prefill = sum(ms for ms, only in zip(spans, counters["prefill_only"]) if only)
    decode = sum(spans) - prefill
    generation_ms = (marks["generated"] - marks["start"]) * 1000.0
    total_ms = (marks["done"] - marks["start"]) * 1000.0
    tokens = counters["num_generated_tokens"]
    return {"prompt_expansion_ms": 0.0, "generation_ms": generation_ms, "prefill_forward_ms": prefill,
            "decode_forward_ms": decode, "generation_overhead_ms": max(0.0, generation_ms - prefill - decode),
            "num_prefill_forwards": counters["num_prefill_forwards"],
            "num_decode_forwards": counters["decode_steps"], "scheduler_overhead_ms": None,
            "cache_management_overhead_ms": 0.0, "post_processing_ms": (marks["done"] - marks["generated"]) * 1000.0,
            "total_ms": total_ms, "num_generated_tokens": tokens,
            "tokens_per_second": tokens / (total_ms / 1000.0) if total_ms > 0.0 else 0.0,
            "batch_size": batch.batch_size, "num_samples_per_prompt": 1,
            "prompt_length": int(batch.response_start_idx[0]) if batch.batch_size else 0,
            "response_length": max(counters["response_lengths"], default=0),
            "active_batch_size": max(counters["active_batch_sizes"], default=0),
            "continuous_batch_size": max_batch_size}

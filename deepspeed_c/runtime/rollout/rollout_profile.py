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

    def _ms(self, span: tuple[Any, Any]) -> float:
        start, end = span
        return (end - start) * 1000.0 if self._host else float(start.elapsed_time(end))

    def stage_times(self) -> tuple[Optional[float], Optional[float], int]:
        """(prefill ms, decode ms in total, number of decode forwards); (None, None, 0) when none ran."""
        if not self.spans:
            return None, None, 0
        times = [self._ms(span) for span in self.spans]
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

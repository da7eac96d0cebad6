"""deepspeed.runtime.rollout.hybrid_engine_rollout: on-policy generation from a training engine's live weights.

HybridEngineRollout.generate calls `engine.module.generate`, which DeepSpeedHybridEngine routes to its own
generate (fused inference blocks refilled from the training weights, ZeRO-3 gathered, LoRA folded in; see
runtime/hybrid_engine.py); on a plain engine it is Hugging Face's generate over the training module. EOS is
ignored while generating so every data-parallel rank runs the same number of forwards (ZeRO-3 gathers are
collectives); the first EOS of each response is kept and what follows is padded afterwards.

Not built in deepspeed_c (each raises NotImplementedError naming its knob when it would act): CUDA-graph decode
(`use_graph_capture`) and shared prompt prefill (`use_shared_prefill`, n_samples_per_prompt > 1)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from deepspeed_c.runtime.rollout import continuous_rollout
from deepspeed_c.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig
from deepspeed_c.runtime.rollout.rollout_profile import (ForwardTimer, continuous_profile, continuous_stats,
                                                         profile_dict)
from deepspeed_c.runtime.rollout.sampling_utils import (pad_after_eos, pad_token_id_of, rollout_attention,
                                                        sample_top_p)


@dataclass
class HybridEngineRolloutConfig:
    """HybridEngineRollout's knobs (DeepSpeed's names and defaults). The last four shape DeepSpeed's
    continuous-batching KV cache; deepspeed_c's continuous path keeps no cache (continuous_rollout.py), so
    only continuous_cache_capacity's lower bound is checked."""
    use_graph_capture: bool = False
    enable_profiling: bool = False
    use_shared_prefill: bool = False
    align_decode_fronts: bool = False
    enable_cache_trimming: bool = False
    continuous_cache_capacity: Optional[int] = None


def _knob(cfg: Any, name: str, default: Any) -> Any:
    # any object with the attributes will do (a RolloutConfig carries only use_graph_capture)
    return getattr(cfg, name, default) if cfg is not None else default


class HybridEngineRollout(RolloutEngine):
    """Rollout engine over a DeepSpeed (hybrid) engine.

    Args:
        engine: the engine wrapping the policy (a Hugging Face causal LM).
        tokenizer: anything with pad_token_id and eos_token_id (one of them not None).
        cfg: an optional HybridEngineRolloutConfig (or RolloutConfig)."""

    name = "hybrid_engine"

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.use_graph_capture = _knob(cfg, "use_graph_capture", False)
        self.enable_profiling = _knob(cfg, "enable_profiling", False)
        self.use_shared_prefill = _knob(cfg, "use_shared_prefill", False)
        self.align_decode_fronts = _knob(cfg, "align_decode_fronts", False)
        self.enable_cache_trimming = _knob(cfg, "enable_cache_trimming", False)
        self.continuous_cache_capacity = _knob(cfg, "continuous_cache_capacity", None)
        self._last_profile: Optional[dict[str, Any]] = None
        self._last_continuous_stats: Optional[dict[str, Any]] = None

    # -- generation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        cbs = getattr(sampling, "continuous_batch_size", None)
        if isinstance(cbs, int) and not isinstance(cbs, bool):  # SamplingConfig validated it
            return self._generate_continuous(request, sampling, cbs)
        pad = pad_token_id_of(self.tokenizer)
        greedy = sampling.temperature <= 0.0
        n = sampling.n_samples_per_prompt
        if self.use_shared_prefill and n > 1:
            raise NotImplementedError("deepspeed_c: HybridEngineRolloutConfig.use_shared_prefill (one prefill "
                                      "shared by a prompt's samples) is not built; leave it False")
        marks: dict[str, float] = {}
        accelerator = self._mark(marks, "start")
        prompts, prompt_mask = request.prompt_ids, request.prompt_attention_mask
        if n > 1:  # the samples of one prompt are adjacent rows
            prompts, prompt_mask = prompts.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0)
        self._mark(marks, "expanded")
        module = self.engine.module
        timer = ForwardTimer(accelerator) if accelerator is not None and not (self.use_graph_capture and greedy) \
            else None
        with timer if timer is not None else contextlib.nullcontext():
            if self.use_graph_capture and greedy:
                output_ids = self._generate_graph(prompts, prompt_mask, sampling.max_new_tokens, pad, module,
                                                  prompts.device)
            else:
                output_ids = module.generate(prompts, **self._generate_kwargs(sampling, prompt_mask, pad))
        self._mark(marks, "generated")
        prompt_len = request.prompt_ids.shape[1]
        output_ids, response_mask = pad_after_eos(output_ids, prompt_len, self.tokenizer.eos_token_id, pad)
        batch = RolloutBatch(input_ids=output_ids,
                             attention_mask=rollout_attention(output_ids, prompt_mask, response_mask),
                             response_start_idx=torch.full((output_ids.shape[0], ), prompt_len, dtype=torch.long,
                                                           device=prompts.device))
        if accelerator is not None:
            self._mark(marks, "done")
            self._last_profile = profile_dict(marks, timer, batch.batch_size, batch.seq_len - prompt_len,
                                              int(request.prompt_ids.shape[0]), n, prompt_len)
        return batch

    def _mark(self, marks: dict[str, float], name: str) -> Any:
        """With enable_profiling: waits for the device and records the host time; returns the accelerator."""
        if not self.enable_profiling:
            return None
        from deepspeed_c.accelerator import get_accelerator

        accelerator = get_accelerator()
        accelerator.synchronize()
        marks[name] = time.perf_counter()
        return accelerator

    @staticmethod
    def _generate_kwargs(sampling: SamplingConfig, prompt_mask: torch.Tensor, pad: int) -> dict[str, Any]:
        sample = sampling.temperature > 0.0
        kwargs: dict[str, Any] = {
            "attention_mask": prompt_mask,
            "max_new_tokens": sampling.max_new_tokens,
            # no early stop: under ZeRO-3 every rank must run as many forwards (gathers) as the others
            "eos_token_id": None,
            "do_sample": sample,
            "temperature": float(sampling.temperature) if sample else 1.0,
            "top_p": sampling.top_p if sample else 1.0,
            "pad_token_id": pad,
        }
        if sample:
            kwargs["top_k"] = max(sampling.top_k, 0)  # Hugging Face's "no top-k" is 0
        return kwargs

    def _generate_graph(self, prompt_ids: torch.Tensor, prompt_attn: torch.Tensor, max_new_tokens: int,
                        pad_token_id: int, module: Any, device: torch.device) -> torch.Tensor:
        """DeepSpeed's greedy decode through a captured CUDA graph over a static KV cache."""
        raise NotImplementedError("deepspeed_c: HybridEngineRolloutConfig.use_graph_capture (RolloutConfig."
                                  "use_graph_capture), CUDA-graph greedy decode, is not built; leave it False "
                                  "(greedy rollouts then run the engine's generate)")

    def _generate_continuous(self, request: RolloutRequest, sampling: SamplingConfig,
                             max_batch_size: int) -> RolloutBatch:
        continuous_rollout.validate(request, sampling, max_batch_size, self.use_shared_prefill)
        if self.use_graph_capture:
            self._generate_graph(request.prompt_ids, request.prompt_attention_mask, sampling.max_new_tokens,
                                 pad_token_id_of(self.tokenizer), self.engine.module, request.prompt_ids.device)
        engine = self.engine
        if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3 and getattr(engine, "dp_world_size", 1) > 1:
            # rows retire at their own EOS, so ranks would run different numbers of gathering forwards
            raise NotImplementedError("deepspeed_c: SamplingConfig.continuous_batch_size under ZeRO-3 over more "
                                      "than one rank is not built; use continuous_batch_size=None")
        module = engine.module
        continuous_rollout.check_lengths(module, request.prompt_ids.shape[1], sampling.max_new_tokens,
                                         self.continuous_cache_capacity)
        eos = self.tokenizer.eos_token_id
        eos_ids = None if eos is None else torch.as_tensor(eos).reshape(-1)
        marks: dict[str, float] = {}
        accelerator = self._mark(marks, "start")
        was_training = module.training
        module.eval()  # no dropout in greedy decode; the trainer's mode comes back below
        try:
            with ForwardTimer(accelerator) if accelerator is not None else contextlib.nullcontext() as timer:
                batch, counters = continuous_rollout.generate(module, request, sampling, max_batch_size, eos_ids,
                                                              pad_token_id_of(self.tokenizer))
        finally:
            module.train(was_training)
        self._mark(marks, "generated")
        self._last_continuous_stats = continuous_stats(counters, marks)
        if accelerator is not None:
            self._mark(marks, "done")
            self._last_profile = continuous_profile(marks, timer, counters, batch, max_batch_size)
        return batch

    # -- helpers kept under DeepSpeed's names ------------------------------------------------------------
    @staticmethod
    def _pad_after_eos(output_ids: torch.Tensor, response_start: int, eos_token_id: Any,
                       pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_after_eos(output_ids, response_start, eos_token_id, pad_token_id)

    @staticmethod
    def _sample_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        return sample_top_p(logits, temperature, top_p)

    # -- results of the last generate -------------------------------------------------------------------
    def get_last_profile(self) -> Optional[dict[str, Any]]:
        """The last generate's timing split (enable_profiling; rollout_profile.py), else None."""
        return self._last_profile

    def get_last_continuous_stats(self) -> Optional[dict[str, Any]]:
        """Statistics of the last continuous-batching generate (DeepSpeed's keys; rollout_profile.py), else None."""
        return self._last_continuous_stats

    def sync_weights(self, step: int) -> None:
        """Nothing to do: the hybrid engine generates from the training weights themselves."""
        return None

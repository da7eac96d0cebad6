"""Greedy continuous-batching generation for HybridEngineRollout (SamplingConfig.continuous_batch_size).

Each prompt is its own request; at most `max_batch_size` decode together, a request retires at its first EOS or
after max_new_tokens, and a waiting prompt takes the freed row before the next step. deepspeed_c runs every step
as a full forward over each active row's prompt and tokens so far (left-padded to a common length, positions
from the mask) instead of DeepSpeed's static KV cache, so the cache knobs (align_decode_fronts,
enable_cache_trimming, continuous_cache_capacity) change no token: each row's tokens are those of greedy
generation of its prompt alone."""
from __future__ import annotations

from inspect import signature
from typing import Any, Optional

import torch

from deepspeed_c.runtime.rollout.base import RolloutBatch, RolloutRequest, SamplingConfig
from deepspeed_c.runtime.rollout.continuous_batching import ContinuousBatchRequest, ContinuousBatchScheduler


def validate(request: RolloutRequest, sampling: SamplingConfig, max_batch_size: int, shared_prefill: bool) -> None:
    if request.prompt_ids.shape[0] == 0:
        raise ValueError("continuous batching requires at least one request (prompt_ids has no rows)")
    if max_batch_size <= 0:
        raise ValueError(f"continuous_batch_size (max_batch_size) must be positive; got {max_batch_size}")
    if shared_prefill:
        raise ValueError("continuous batching does not support shared prompt prefill (use_shared_prefill)")
    if sampling.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive; got {sampling.max_new_tokens}")
    if sampling.temperature > 0:
        raise ValueError(f"continuous batching currently supports greedy decoding only: set temperature <= 0 "
                         f"(got {sampling.temperature})")
    if sampling.n_samples_per_prompt != 1:
        raise ValueError(f"continuous batching currently supports one sample per prompt "
                         f"(n_samples_per_prompt={sampling.n_samples_per_prompt})")
    empty = (~request.prompt_attention_mask.bool().any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"continuous batching requires at least one prompt token per request; rows {empty} of "
                         "prompt_attention_mask are all zero")


def check_lengths(module: Any, prompt_len: int, max_new_tokens: int, capacity: Optional[int]) -> None:
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + max_new_tokens > limit:
        raise ValueError(f"continuous batching request exceeds the model maximum position embeddings "
                         f"({prompt_len} prompt + {max_new_tokens} new > {limit})")
    if capacity is not None and capacity < prompt_len:
        raise ValueError(f"continuous_cache_capacity ({capacity}) must be at least the padded prompt length "
                         f"({prompt_len})")


def _call(module: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Logits of the last position; passes only the keyword arguments the model's forward accepts."""
    params = signature(module.forward).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    out = module(ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1, :]


def _penalized(logits: torch.Tensor, seen: list[torch.Tensor], penalty: float) -> torch.Tensor:
    """Hugging Face's repetition penalty over each row's prompt and tokens so far (the model's generation_config
    applies it in generate too)."""
    logits = logits.clone()
    for row, ids in enumerate(seen):
        scores = logits[row].gather(0, ids)
        logits[row].scatter_(0, ids, torch.where(scores < 0, scores * penalty, scores / penalty))
    return logits


def _step(module: Any, rows: list[tuple[torch.Tensor, torch.Tensor]], penalty: float) -> torch.Tensor:
    """Greedy next token of each (ids, mask) row, the rows left-padded to one length."""
    width = max(ids.shape[0] for ids, _ in rows)
    ids = torch.stack([torch.nn.functional.pad(i, (width - i.shape[0], 0)) for i, _ in rows])
    mask = torch.stack([torch.nn.functional.pad(m, (width - m.shape[0], 0)) for _, m in rows]).long()
    positions = (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 1)
    logits = _call(module, ids, attention_mask=mask, position_ids=positions, use_cache=False)
    if penalty != 1.0:
        logits = _penalized(logits, [i[m.bool()] for i, m in rows], penalty)
    return logits.argmax(dim=-1)


def generate(module: Any, request: RolloutRequest, sampling: SamplingConfig, max_batch_size: int,
             eos_ids: Optional[torch.Tensor], pad_token_id: int) -> tuple[RolloutBatch, dict[str, Any]]:
    """Runs the schedule; returns the batch and counters named as DeepSpeed's: decode_steps (steps that extended
    rows already generating), num_prefill_forwards (steps that started admitted rows; one forward can be both),
    peak_cache_length (the widest row sequence a forward saw), active_batch_sizes, prefill_only (per step),
    num_generated_tokens and response_lengths."""
    prompts, prompt_mask = request.prompt_ids, request.prompt_attention_mask
    penalty = getattr(getattr(module, "generation_config", None), "repetition_penalty", None) or 1.0
    scheduler = ContinuousBatchScheduler(max_batch_size, sampling.max_new_tokens)
    for row in range(prompts.shape[0]):
        scheduler.submit(ContinuousBatchRequest(row))
    responses: dict[int, list[int]] = {row: [] for row in range(prompts.shape[0])}
    stats: dict[str, Any] = {"decode_steps": 0, "num_prefill_forwards": 0, "peak_cache_length": prompts.shape[1],
                             "active_batch_sizes": [], "prefill_only": []}
    eos = set() if eos_ids is None else set(eos_ids.tolist())
    update = scheduler.schedule()
    while update.active:
        active = list(update.active_ids)
        rows = []
        for rid in active:
            tail = torch.tensor(responses[rid], dtype=prompts.dtype, device=prompts.device)
            rows.append((torch.cat([prompts[rid], tail]),
                         torch.cat([prompt_mask[rid].long(), torch.ones_like(tail, dtype=torch.long)])))
        tokens = _step(module, rows, float(penalty))
        stats["decode_steps"] += int(len(update.admitted) < len(active))
        stats["num_prefill_forwards"] += int(bool(update.admitted))
        stats["peak_cache_length"] = max(stats["peak_cache_length"], max(ids.shape[0] for ids, _ in rows))
        stats["active_batch_sizes"].append(len(active))
        stats["prefill_only"].append(len(update.admitted) == len(active))  # the step decoded no running row
        finished = []
        for rid, token in zip(active, tokens.tolist()):
            responses[rid].append(token)
            if token in eos:
                finished.append(rid)
        update = scheduler.advance(finished)
    stats["num_generated_tokens"] = sum(len(r) for r in responses.values())
    stats["response_lengths"] = [len(responses[row]) for row in range(prompts.shape[0])]
    return _assemble(request, responses, pad_token_id), stats


def _assemble(request: RolloutRequest, responses: dict[int, list[int]], pad_token_id: int) -> RolloutBatch:
    """Prompt then response per row, right-padded with pad_token_id; attention 1 on every generated token."""
    prompts, prompt_mask = request.prompt_ids, request.prompt_attention_mask
    rows, width = prompts.shape[0], max(len(r) for r in responses.values())
    tail = torch.full((rows, width), pad_token_id, dtype=prompts.dtype, device=prompts.device)
    tail_mask = torch.zeros((rows, width), dtype=prompt_mask.dtype, device=prompts.device)
    for row in range(rows):
        n = len(responses[row])
        tail[row, :n] = torch.tensor(responses[row], dtype=prompts.dtype)
        tail_mask[row, :n] = 1
    start = torch.full((rows, ), prompts.shape[1], dtype=torch.long, device=prompts.device)
    return RolloutBatch(input_ids=torch.cat([prompts, tail], dim=1),
                        attention_mask=torch.cat([prompt_mask, tail_mask], dim=1), response_start_idx=start)

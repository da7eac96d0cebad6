"""HybridEngineRollout on one CPU process over a tiny LLaMA (random weights, built from a config; the tokenizer is
a stand-in holding pad/eos ids), at ZeRO 0 and 3 with the hybrid engine (fused inference blocks) and on a plain
engine (Hugging Face's generate over the training module).

Reference: Hugging Face's generate on a deep copy of the model as built, with the rollout's post-processing (keep
the first EOS, pad after it, masks) written out as a loop. Greedy tokens equal it exactly, left-padded prompts and
n_samples_per_prompt included; continuous batching equals per-prompt greedy with rows retiring at EOS; sampled
tokens lie in the reference model's top-k at their position."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import pytest
import torch

from deepspeed_c.runtime.rollout import (HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig,
                                         build_rollout)
from deepspeed_c.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig
from tests.distributed.hybrid_models import prompts, tiny_lm

NEW = 8


class Tok:
    """What the rollout reads of a Hugging Face tokenizer."""

    def __init__(self, pad: Optional[int] = 0, eos: Optional[int] = 2) -> None:
        self.pad_token_id, self.eos_token_id = pad, eos


def _engine(stage: int, hybrid: bool = True) -> tuple[Any, torch.nn.Module]:
    import deepspeed_c

    model = tiny_lm("llama", seed=3)
    ref = copy.deepcopy(model).eval()
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    engine.eval()
    return engine, ref


@pytest.fixture(scope="module", params=[(0, True), (3, True), (0, False)], ids=["z0-hybrid", "z3-hybrid", "z0-plain"])
def setup(request: Any) -> tuple[Any, torch.nn.Module]:
    return _engine(*request.param)


def _request(rows: int = 3, seed: int = 1) -> RolloutRequest:
    ids = prompts(rows, 6, seed)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # a left-padded prompt
    return RolloutRequest(ids, mask)


def _hf_greedy(ref: torch.nn.Module, req: RolloutRequest, new: int = NEW) -> torch.Tensor:
    with torch.no_grad():
        return ref.generate(req.prompt_ids, attention_mask=req.prompt_attention_mask, max_new_tokens=new,
                            do_sample=False, eos_token_id=None, pad_token_id=0)


def _expected(full: torch.Tensor, prompt_mask: torch.Tensor, eos: Optional[int], pad: int) -> tuple:
    """The rollout's post-processing as a loop: keep up to the first EOS of each response, pad after it."""
    ids, mask = full.clone(), torch.zeros_like(full)
    p = prompt_mask.shape[1]
    for r in range(full.shape[0]):
        mask[r, :p] = prompt_mask[r]
        ended = False
        for c in range(p, full.shape[1]):
            if ended:
                ids[r, c] = pad
                continue
            mask[r, c] = 1 if (full[r, c] != pad or full[r, c] == eos) else 0
            ended = eos is not None and int(full[r, c]) == eos
    return ids, mask


def test_greedy_equals_hf_generate(setup: tuple) -> None:
    engine, ref = setup
    req = _request()
    rollout = build_rollout(RolloutConfig(), engine, Tok(eos=None))
    assert isinstance(rollout, HybridEngineRollout) and rollout.engine is engine
    out = rollout.generate(req, SamplingConfig(max_new_tokens=NEW, temperature=0.0, n_samples_per_prompt=2))
    want = _hf_greedy(ref, req).repeat_interleave(2, dim=0)
    assert out.input_ids.shape == (6, 6 + NEW)
    assert torch.equal(out.input_ids, want)
    assert torch.equal(out.attention_mask[:, :6], req.prompt_attention_mask.repeat_interleave(2, dim=0))
    assert bool(out.attention_mask[:, 6:].all()) and out.response_start_idx.tolist() == [6] * 6


def test_first_eos_is_kept_and_the_rest_padded(setup: tuple) -> None:
    engine, ref = setup
    req = _request()
    full = _hf_greedy(ref, req)
    eos = int(full[0, 6 + 2])  # a token that row 0 really generates, at response position 2
    out = HybridEngineRollout(engine, Tok(pad=0, eos=eos)).generate(req, SamplingConfig(NEW, temperature=0.0))
    ids, mask = _expected(full, req.prompt_attention_mask, eos, 0)
    assert torch.equal(out.input_ids, ids) and torch.equal(out.attention_mask, mask)
    assert int(mask[0, 6:].sum()) <= 3 and int(out.input_ids[0, -1]) == 0  # row 0 really ended


def test_continuous_batching_equals_per_prompt_greedy(setup: tuple) -> None:
    engine, ref = setup
    req = _request(rows=4, seed=5)
    full = _hf_greedy(ref, req)
    eos = int(full[2, 6 + 1])  # row 2 (at least) retires early and frees its row
    rollout = HybridEngineRollout(engine, Tok(pad=0, eos=eos))
    out = rollout.generate(req, SamplingConfig(NEW, temperature=0.0, continuous_batch_size=2))
    ids, mask = _expected(full, req.prompt_attention_mask, eos, 0)
    width = int(mask[:, 6:].sum(dim=1).max())  # the batch is as wide as its longest response
    assert torch.equal(out.input_ids, ids[:, :6 + width]) and torch.equal(out.attention_mask, mask[:, :6 + width])
    stats = rollout.get_last_continuous_stats()
    lengths = mask[:, 6:].sum(dim=1).tolist()
    sizes, decode_steps = _simulate(lengths, 2)
    assert stats["active_batch_sizes"] == sizes and stats["decode_steps"] == decode_steps
    assert stats["num_generated_tokens"] == sum(lengths) and stats["end_to_end_ms"] is None
    assert stats["trim_count"] == 0 and stats["peak_cache_length"] == 6 + max(lengths) - 1
    profiled = HybridEngineRollout(engine, Tok(pad=0, eos=eos), HybridEngineRolloutConfig(enable_profiling=True))
    again = profiled.generate(req, SamplingConfig(NEW, temperature=0.0, continuous_batch_size=2))
    assert torch.equal(again.input_ids, out.input_ids)
    profile = profiled.get_last_profile()
    assert profile["continuous_batch_size"] == 2 and profile["active_batch_size"] == 2
    assert profile["num_decode_forwards"] == decode_steps and profile["response_length"] == max(lengths)
    assert profile["decode_forward_ms"] > 0 and profiled.get_last_continuous_stats()["end_to_end_ms"] > 0


def _simulate(lengths: list[int], slots: int) -> tuple[list[int], int]:
    """FIFO rows of the given response lengths through `slots` rows: the active size of each step, and the
    number of steps in which some row was already generating (DeepSpeed's decode_steps)."""
    queue, active, sizes, decode_steps = list(range(len(lengths))), [], [], 0
    done = {i: 0 for i in queue}
    while queue or active:
        while len(active) < slots and queue:
            active.append(queue.pop(0))
        sizes.append(len(active))
        decode_steps += any(done[i] > 0 for i in active)
        for i in active:
            done[i] += 1
        active = [i for i in active if done[i] < lengths[i]]
    return sizes, decode_steps


def test_sampled_tokens_lie_in_the_reference_top_k(setup: tuple) -> None:
    engine, ref = setup
    req = _request()
    torch.manual_seed(0)
    rollout = HybridEngineRollout(engine, Tok(eos=None), HybridEngineRolloutConfig(enable_profiling=True))
    out = rollout.generate(req, SamplingConfig(NEW, temperature=0.8, top_k=3, n_samples_per_prompt=2))
    assert torch.equal(out.input_ids[:, :6], req.prompt_ids.repeat_interleave(2, dim=0))
    with torch.no_grad():
        mask = out.attention_mask
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        logits = ref(out.input_ids, attention_mask=mask, position_ids=pos).logits
    top = logits[:, 5:-1].topk(3, dim=-1).indices
    assert bool((top == out.input_ids[:, 6:, None]).any(-1).all())
    profile = rollout.get_last_profile()
    assert profile["num_generated_tokens"] == 6 * NEW and profile["num_samples_per_prompt"] == 2
    assert (profile["batch_size"], profile["prompt_length"], profile["response_length"]) == (3, 6, NEW)
    # the model that generated (the fused copy or the training module) ran one prefill and NEW - 1 decodes
    assert profile["num_decode_forwards"] == NEW - 1
    assert profile["prefill_forward_ms"] > 0 and profile["decode_forward_ms"] > 0
    assert profile["generation_ms"] >= profile["prefill_forward_ms"] + profile["decode_forward_ms"]
    assert set(profile) == {"prompt_expansion_ms", "generation_ms", "prefill_forward_ms", "decode_forward_ms",
                            "generation_overhead_ms", "num_decode_forwards", "post_processing_ms", "total_ms",
                            "num_generated_tokens", "tokens_per_second", "batch_size", "num_samples_per_prompt",
                            "prompt_length", "response_length"}
    assert HybridEngineRollout(engine, Tok()).get_last_profile() is None


def test_bad_input_is_named() -> None:
    engine, _ = _engine(0)
    req = _request()
    with pytest.raises(ValueError, match="pad_token_id or eos_token_id"):
        HybridEngineRollout(engine, Tok(None, None)).generate(req, SamplingConfig(NEW, temperature=0.0))
    with pytest.raises(NotImplementedError, match="use_graph_capture"):
        build_rollout(RolloutConfig(use_graph_capture=True), engine, Tok()).generate(req, SamplingConfig(NEW, 0.0))
    shared = HybridEngineRollout(engine, Tok(), HybridEngineRolloutConfig(use_shared_prefill=True))
    with pytest.raises(NotImplementedError, match="use_shared_prefill"):
        shared.generate(req, SamplingConfig(NEW, n_samples_per_prompt=2))
    rollout = HybridEngineRollout(engine, Tok())
    with pytest.raises(ValueError, match="greedy decoding only"):
        rollout.generate(req, SamplingConfig(NEW, temperature=1.0, continuous_batch_size=2))
    with pytest.raises(ValueError, match="one sample per prompt"):
        rollout.generate(req, SamplingConfig(NEW, temperature=0.0, n_samples_per_prompt=2, continuous_batch_size=2))
    with pytest.raises(ValueError, match="maximum position embeddings"):
        rollout.generate(req, SamplingConfig(200, temperature=0.0, continuous_batch_size=2))
    capped = HybridEngineRollout(engine, Tok(), HybridEngineRolloutConfig(continuous_cache_capacity=3))
    with pytest.raises(ValueError, match="continuous_cache_capacity"):
        capped.generate(req, SamplingConfig(NEW, temperature=0.0, continuous_batch_size=2))
    with pytest.raises(ValueError, match="max_out_tokens"):  # the hybrid engine's own limit
        rollout.generate(req, SamplingConfig(100, temperature=0.0))

"""deepspeed.runtime.rollout's contract: the dataclasses' fields, defaults and shape checks (each error naming the
field), RolloutEngine's abstract methods, build_rollout's dispatch and errors, the EOS/pad helpers and the
continuous-batching scheduler's admission/retirement bookkeeping (checked against a hand-run schedule)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import deepspeed_c.runtime.rollout as rollout_pkg
from deepspeed_c.runtime.rollout import (HybridEngineRollout, RolloutBatch, RolloutConfig, RolloutEngine,
                                         RolloutRequest, SamplingConfig, build_rollout)
from deepspeed_c.runtime.rollout.continuous_batching import (ContinuousBatchRequest, ContinuousBatchScheduler)
from deepspeed_c.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig


def _fields(cls: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_public_names_and_defaults() -> None:
    assert set(rollout_pkg.__all__) == {"HybridEngineRollout", "JSDLossOutput", "RolloutBatch", "RolloutConfig",
                                        "RolloutEngine", "RolloutRequest", "ResponseTokenBatch", "SamplingConfig",
                                        "build_rollout", "generalized_jsd_loss"}
    assert _fields(RolloutConfig) == {"engine": "hybrid_engine", "use_graph_capture": False}
    f = _fields(SamplingConfig)
    assert f.pop("max_new_tokens") is dataclasses.MISSING
    assert f == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "n_samples_per_prompt": 1,
                 "continuous_batch_size": None}
    assert _fields(HybridEngineRolloutConfig) == {
        "use_graph_capture": False, "enable_profiling": False, "use_shared_prefill": False,
        "align_decode_fronts": False, "enable_cache_trimming": False, "continuous_cache_capacity": None}
    assert [f.name for f in dataclasses.fields(RolloutBatch)] == ["input_ids", "attention_mask", "response_start_idx"]


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=4, top_p=1.5), "top_p"), (dict(max_new_tokens=4, top_k=2.0), "top_k"),
    (dict(max_new_tokens=4, n_samples_per_prompt=0), "n_samples_per_prompt"),
    (dict(max_new_tokens=4, continuous_batch_size=0), "continuous_batch_size"),
    (dict(max_new_tokens=4, temperature="hot"), "temperature"),
])
def test_sampling_config_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**kwargs)


def test_request_and_batch_shape_checks() -> None:
    with pytest.raises(ValueError, match="prompt_ids must be 2-D"):
        RolloutRequest(torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match="prompt_attention_mask shape .* does not match"):
        RolloutRequest(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(ValueError, match="input_ids must be 2-D"):
        RolloutBatch(torch.zeros(4, dtype=torch.long), torch.ones(4), torch.tensor([1]))
    with pytest.raises(ValueError, match="attention_mask shape .* does not match"):
        RolloutBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 5), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="response_start_idx must be 1-D of length 2"):
        RolloutBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4), torch.tensor([[1, 1]]))
    b = RolloutBatch(torch.zeros(3, 7, dtype=torch.long), torch.ones(3, 7), torch.tensor([2, 2, 2]))
    assert (b.batch_size, b.seq_len) == (3, 7)


def test_rollout_engine_is_abstract() -> None:
    with pytest.raises(TypeError):
        RolloutEngine()

    class Echo(RolloutEngine):
        def generate(self, request, sampling):
            return RolloutBatch(request.prompt_ids, request.prompt_attention_mask,
                                torch.full((request.prompt_ids.shape[0], ), 1))

        def sync_weights(self, step):
            return None

    e = Echo()
    assert e.name == "base" and e.shutdown() is None and e.sync_weights(3) is None


def test_build_rollout_dispatch_and_errors() -> None:
    with pytest.raises(ValueError, match="Unknown rollout engine 'vllm'"):
        build_rollout(RolloutConfig(engine="vllm"), object(), object())
    with pytest.raises(ValueError, match="needs both student_engine and tokenizer; missing tokenizer"):
        build_rollout(RolloutConfig(), student_engine=object())
    with pytest.raises(ValueError, match="missing student_engine, tokenizer"):
        build_rollout(RolloutConfig())
    eng, tok = object(), object()
    r = build_rollout(RolloutConfig(use_graph_capture=True), eng, tok, unused_kw=1)
    assert isinstance(r, HybridEngineRollout) and r.engine is eng and r.tokenizer is tok
    assert r.use_graph_capture is True and r.enable_profiling is False and r.sync_weights(5) is None


def test_pad_after_eos_and_top_p_helpers() -> None:
    ids = torch.tensor([[9, 9, 5, 2, 7, 2], [9, 9, 5, 6, 7, 8], [9, 9, 2, 0, 0, 0]])
    out, attn = HybridEngineRollout._pad_after_eos(ids, 2, eos_token_id=2, pad_token_id=0)
    assert out.tolist() == [[9, 9, 5, 2, 0, 0], [9, 9, 5, 6, 7, 8], [9, 9, 2, 0, 0, 0]]
    assert attn.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    # eos == pad: the first EOS still counts as a token; several EOS ids
    out, attn = HybridEngineRollout._pad_after_eos(ids, 2, eos_token_id=[7, 6], pad_token_id=2)
    assert out.tolist()[:2] == [[9, 9, 5, 2, 7, 2], [9, 9, 5, 6, 2, 2]]
    assert attn.tolist()[:2] == [[1, 0, 1, 0], [1, 1, 0, 0]]
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.9]]).repeat(400, 1)
    tokens = HybridEngineRollout._sample_top_p(logits, temperature=1.0, top_p=0.6).flatten()
    assert set(tokens.tolist()) == {2, 3}  # the 0.6 nucleus is the two likeliest tokens


def test_scheduler_admits_fifo_and_retires() -> None:
    s = ContinuousBatchScheduler(max_batch_size=2, max_new_tokens=3)
    for rid in "abcd":
        s.submit(ContinuousBatchRequest(rid))
    with pytest.raises(ValueError, match="duplicate request_id"):
        s.submit(ContinuousBatchRequest("a"))
    with pytest.raises(TypeError, match="ContinuousBatchRequest"):
        s.submit("e")
    u = s.schedule()
    assert u.active_ids == ("a", "b") and u.admitted_slots == (0, 1) and u.keep_slots == () and u.retired == ()
    u = s.advance(finished_ids=["a"])  # "a" hit EOS after 1 token
    assert u.keep_slots == (1, ) and u.retired == ("a", ) and u.active_ids == ("b", "c")
    assert u.admitted_slots == (1, ) and [r.request_id for r in s.pending] == ["d"]
    with pytest.raises(ValueError, match="not active: 'a'"):
        s.advance(finished_ids=["a"])
    u = s.advance()  # b: 2 tokens, c: 1
    assert u.retired == () and u.active_ids == ("b", "c")
    u = s.advance()  # b reaches the 3-token budget
    assert u.retired == ("b", ) and u.keep_slots == (1, ) and u.active_ids == ("c", "d")
    s.submit(ContinuousBatchRequest("a"))  # a retired id may come back
    u = s.advance()
    assert u.retired == ("c", ) and u.active_ids == ("d", "a")
    for _ in range(3):
        u = s.advance()
    assert u.active == () and s.pending == ()
    with pytest.raises(ValueError, match="max_batch_size must be positive"):
        ContinuousBatchScheduler(0, 3)
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        ContinuousBatchScheduler(1, 0)

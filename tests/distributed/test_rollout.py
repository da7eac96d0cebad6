"""HybridEngineRollout on 2 real gloo ranks at ZeRO-3 (fp32, tiny HF causal LMs built from configs): each rank
rolls out its own left-padded prompts after a training step; greedy tokens equal Hugging Face's generate on a plain
copy holding the gathered weights, with the rollout's EOS post-processing written out as a loop. The EOS id is
chosen so that rank 0's first row ends by its second token while rank 1 runs to max_new_tokens: generation
ignores EOS so both ranks make the same number of gathering forwards (no hang). LLaMA takes the fused path,
OPT the fallback (HF generate over the ZeRO-3 hooks). Continuous batching there raises, naming the field."""
from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

NEW = 6


class Tok:
    def __init__(self, eos: int) -> None:
        self.pad_token_id, self.eos_token_id = 0, eos


def _body(rank: int, world: int, kind: str) -> dict[str, Any]:
    import deepspeed_c
    from deepspeed_c.runtime.rollout import RolloutConfig, RolloutRequest, SamplingConfig, build_rollout
    from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters
    from tests.distributed.hybrid_models import prompts, tiny_lm

    model = tiny_lm(kind, seed=3)
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "hybrid_engine": {"enabled": True, "max_out_tokens": 64}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    batch = prompts(2, 10, seed=50 + rank)
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()  # the rollout must see the trained weights
    with GatheredParameters(list(engine.module.parameters())):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ref.load_state_dict(state, strict=False)
    ref.eval()
    ids = prompts(2, 5, seed=10 + rank)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    with torch.no_grad():
        full = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    # rank 0: an EOS its first row emits early; rank 1: an id its rows never emit
    seen = set(full[:, 5:].flatten().tolist())
    eos = int(full[0, 5 + 1]) if rank == 0 else next(t for t in range(3, 97) if t not in seen)
    engine.eval()
    rollout = build_rollout(RolloutConfig(), engine, Tok(eos))
    out = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(NEW, temperature=0.0))
    err = ""
    try:
        rollout.generate(RolloutRequest(ids, mask), SamplingConfig(NEW, temperature=0.0, continuous_batch_size=2))
    except NotImplementedError as e:
        err = str(e)
    engine.train()
    engine.backward(engine(input_ids=batch, labels=batch).loss)  # training goes on after the rollout
    engine.step()
    return {"ids": out.input_ids.tolist(), "mask": out.attention_mask.tolist(), "full": full.tolist(),
            "prompt_mask": mask.tolist(), "eos": eos, "start": out.response_start_idx.tolist(), "err": err,
            "fused": engine.uses_fused_inference}


def _expected(full: list, prompt_mask: list, eos: int) -> tuple[list, list]:
    ids, masks = [], []
    for row, pm in zip(full, prompt_mask):
        r, m, ended = list(row[:5]), list(pm), False
        for tok in row[5:]:
            r.append(0 if ended else tok)
            m.append(0 if ended else int(tok != 0 or tok == eos))
            ended = ended or tok == eos
        ids.append(r)
        masks.append(m)
    return ids, masks


@pytest.mark.parametrize("kind,fused", [("llama", True), ("opt", False)])
def test_zero3_rollout_equals_hf_generate_on_both_ranks(kind: str, fused: bool) -> None:
    results = run_distributed(_body, 2, args=(kind, ), timeout=300)
    for rank, r in enumerate(results):
        assert r["fused"] is fused
        ids, mask = _expected(r["full"], r["prompt_mask"], r["eos"])
        assert r["ids"] == ids and r["mask"] == mask, rank
        assert r["start"] == [5, 5]
        assert "continuous_batch_size" in r["err"]
    assert 0 < sum(results[0]["mask"][0][5:]) <= 2  # rank 0's first response ended at its EOS ...
    assert all(all(m[5:]) for m in results[1]["mask"])  # ... while rank 1 generated every token

"""ZenFlow on 2 real gloo ranks through deepspeed_c.initialize (a tiny GPT):
- update_interval 1 with overlap_step off steps every element every step: the same weights as plain
  ZeRO-Offload (within fp32 rounding; on the CPU the selected elements take the same C kernel: equal bits);
- DeepSpeed's default knobs (topk 0.1, update_interval "auto", selection once), with and without overlap_step,
  and a fixed update_interval 4 with overlap and reselection: 200 fine-tune steps whose losses stay within
  the tolerance stated at test_fine_tune_tracks_plain_offload of plain offload's;
- a checkpoint taken with a host step in flight and gradient accumulated resumes exactly: the next steps'
  losses and the final weights equal the uninterrupted run's.
All cases run in one shared launch of 2 ranks (a module fixture), the fine-tunes of one ZeRO stage share
plain offload's run, and the pretrained model they start from is trained once (rank 0) and broadcast: the
same runs and assertions as one launch per case, less startup."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.distributed.zenflow_models import ds_config, flat_weights, resume_run, train
from tests.harness import run_distributed

ONE = {"update_interval": 1, "overlap_step": False, "select_strategy": "step", "select_interval": 1000}


def _pair_body(rank: int, world: int, cases: list) -> dict:
    """Per case (id, stage, zenflow knobs, steps, extra config): plain offload and ZenFlow from the same
    weights, in one launch for all cases (a launch of 2 ranks costs more than these 8-step runs)."""
    out = {}
    for case, stage, zen, steps, extra in cases:
        plain, e0 = train(rank, world, dict(ds_config(stage), **(extra or {})), steps)
        w0 = flat_weights(e0).numpy()
        e0.destroy()
        zf, e1 = train(rank, world, dict(ds_config(stage, zenflow=zen), **(extra or {})), steps)
        name = type(e1.optimizer).__name__
        assert name == ("ZenFlowZeroOptimizer_Stage3" if stage == 3 else "ZenFlowZeroOptimizer"), (case, name)
        w1 = flat_weights(e1).numpy()
        e1.destroy()
        out[case] = {"plain": plain, "zen": zf, "w_plain": w0, "w_zen": w1}
    return out


EXTRAS = {"gas2": {"gradient_accumulation_steps": 2},
          "fp16-overflow": {"fp16": {"enabled": True, "initial_scale_power": 20}}}


PAIRS = [(f"stage{s}", s, ONE, 8, None) for s in (1, 2, 3)] + [(k, 2, ONE, 8, v) for k, v in EXTRAS.items()]


@pytest.fixture(scope="module")
def pairs(runs) -> list[dict]:
    return [r["pairs"] for r in runs]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_update_interval_1_equals_plain_offload(pairs, stage):
    out = [r[f"stage{stage}"] for r in pairs]
    for r in out:
        np.testing.assert_allclose(r["zen"], r["plain"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(r["w_zen"], r["w_plain"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[0]["w_zen"], out[1]["w_zen"])  # the ranks hold one model


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_update_interval_1_equals_plain_offload_with_accumulation_and_fp16(pairs, extra):
    """Gradient accumulation, and fp16 whose first steps overflow and are skipped: still plain offload's run."""
    for r in (rank[extra] for rank in pairs):
        np.testing.assert_array_equal(r["zen"], r["plain"])
        np.testing.assert_array_equal(r["w_zen"], r["w_plain"])


TUNES = {"defaults": ({}, True, 2), "defaults-overlap": ({"overlap_step": True}, True, 2),
         "interval4-overlap-reselect": ({"update_interval": 4, "overlap_step": True, "select_strategy": "step",
                                         "select_interval": 40}, False, 2),
         "stage3-defaults-overlap": ({"overlap_step": True}, True, 3)}


def _tune_body(rank: int, world: int, cases: list) -> dict:
    """Per case (id, zenflow knobs, stage): the 200-step fine-tune's 25-step window means, ZenFlow's and plain
    offload's. Plain offload's run depends only on the stage: run once per stage, shared by its cases."""
    import torch
    import torch.distributed as dist

    from tests.distributed.zenflow_models import make_gpt, pretrained_gpt

    # every rank starts from the same pretrained weights: rank 0 trains them (the same plain-torch steps every
    # rank would run, bit for bit) and broadcasts them
    model = pretrained_gpt() if rank == 0 else make_gpt()
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
    plain: dict = {}
    out = {}
    for case, zen, stage in cases:
        if stage not in plain:
            plain[stage], e = train(rank, world, ds_config(stage, lr=1e-3), 200, model=model, rule=2)
            e.destroy()
        zf, e = train(rank, world, ds_config(stage, zenflow=zen, lr=1e-3), 200, model=model, rule=2)
        e.destroy()
        out[case] = {"plain": np.asarray(plain[stage]).reshape(-1, 25).mean(1),
                     "zen": np.asarray(zf).reshape(-1, 25).mean(1)}
    return out


@pytest.fixture(scope="module")
def fine_tunes(runs) -> dict:
    return runs[0]["tunes"]


@pytest.mark.parametrize("case", list(TUNES))
def test_fine_tune_tracks_plain_offload(fine_tunes, case):
    """The stated tolerance, over 25-step windows of a 200-step fine-tune (pretrained on one rule, tuned to
    another): with DeepSpeed's default knobs ZenFlow's window means stay within 2.5x plain offload's + 0.05
    nats and its last window within 0.05 nats (measured: at most 2.2x, last window +0.03); a host step only
    every 4 steps (and reselection every 40) lags more (measured 5.6x, +0.08): within 6x + 0.05 and 0.1 nats."""
    r = fine_tunes[case]
    default_knobs = TUNES[case][1]
    plain, zf = r["plain"], r["zen"]
    assert plain[-1] < 0.1 * plain[0], f"the fine-tune does not learn: {plain}"
    assert zf[-1] < 0.1 * zf[0], f"ZenFlow does not learn: {zf}"
    factor, last = (2.5, 0.05) if default_knobs else (6.0, 0.1)
    assert np.all(zf <= factor * plain + 0.05), (zf, plain)
    assert abs(zf[-1] - plain[-1]) <= last, (zf, plain)


def _resume_body(rank: int, world: int, root: str, stages: list) -> dict:
    zen = {"update_interval": 3, "overlap_step": True, "select_strategy": "step", "select_interval": 6}
    # saved after step 5: 2 accumulated steps and a host step in flight
    return {s: resume_run(rank, world, ds_config(s, zenflow=zen), 10, 5, os.path.join(root, f"z{s}"), "zf")
            for s in stages}


@pytest.fixture(scope="module")
def resumes(runs) -> list[dict]:
    return [r["resumes"] for r in runs]


def _all_body(rank: int, world: int, root: str) -> dict:
    return {"pairs": _pair_body(rank, world, PAIRS),
            "tunes": _tune_body(rank, world, [(case, zen, stage) for case, (zen, _, stage) in TUNES.items()]),
            "resumes": _resume_body(rank, world, root, [2, 3])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """Every case of the module in one launch of 2 ranks: per rank, {"pairs", "tunes", "resumes"}."""
    root = str(tmp_path_factory.mktemp("zf_ck"))
    return run_distributed(_all_body, world_size=2, args=(root,), timeout=1800)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_resumes_with_accumulated_state(resumes, stage):
    for r in (rank[stage] for rank in resumes):
        np.testing.assert_array_equal(r["resumed"], r["full"])
        np.testing.assert_array_equal(r["w_res"], r["w_full"])

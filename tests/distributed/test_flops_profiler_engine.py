"""The engine's `flops_profiler` section on 2 gloo ranks at ZeRO stages 0-3: rank 0 prints the
profile once, at the accumulation boundary of global step `profile_step`; its fwd MACs equal the
MLP's analytic count for one micro-batch, its params the full model's (ds_numel at stage 3);
rank 1 prints nothing; losses are bit-identical to the same run without the profiler; torch's
functions are the originals afterwards."""
from __future__ import annotations

import contextlib
import functools
import io
from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed

STEPS, GAS, MICRO, PROFILE_STEP = 3, 2, 2, 1


def _train(rank: int, world: int, stage: int, profile: bool) -> tuple[np.ndarray, str]:
    import deepspeed_c

    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                           "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                           "zero_optimization": {"stage": stage},
                           "flops_profiler": {"enabled": profile, "profile_step": PROFILE_STEP, "module_depth": -1,
                                              "top_modules": 2, "detailed": True}}
    engine, _, _, _ = deepspeed_c.initialize(model=make_model("mlp", seed=7), config=cfg)
    batches = make_batches("mlp", STEPS * GAS, MICRO * world, seed=3)
    losses = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for x, y in batches:
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = loss_fn(engine(x[lo:hi]), y[lo:hi])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().numpy().copy())
    engine.destroy()
    return np.array(losses), out.getvalue()


def body(rank: int, world: int) -> dict[str, Any]:
    import torch.nn.functional as F

    originals = (F.linear, torch.matmul, torch.Tensor.__matmul__)
    result: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        for profile in (False, True):
            result[f"{stage}-{profile}"] = _train(rank, world, stage, profile)
    result["restored"] = originals == (F.linear, torch.matmul, torch.Tensor.__matmul__)
    return result


@functools.lru_cache(maxsize=None)
def _results() -> list[dict[str, Any]]:
    return run_distributed(body, 2, args=(), timeout=300)


def _value(text: str, label: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith(label))
    return line[len(label):].strip()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_prints_profile_once_and_training_is_unchanged(stage):
    from deepspeed_c.profiling.flops_profiler import macs_to_string, params_to_string

    results = _results()
    model = make_model("mlp", seed=7)
    params = sum(p.numel() for p in model.parameters())
    widths = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    macs = MICRO * sum(i * o for i, o in widths)
    for rank, res in enumerate(results):
        plain, _ = res[f"{stage}-False"]
        profiled, text = res[f"{stage}-True"]
        assert np.array_equal(plain, profiled)  # bit-identical losses
        assert res["restored"]
        if rank == 1:
            assert "DeepSpeed Flops Profiler" not in text
            continue
        assert text.count("DeepSpeed Flops Profiler") == 1
        assert f"Profile Summary at step {PROFILE_STEP + 1}:" in text  # printed after the step advanced it
        assert _value(text, "world size:") == "2" and _value(text, "batch size per GPU:") == str(MICRO)
        assert _value(text, "params per GPU:") == params_to_string(params)
        assert _value(text, "fwd MACs per GPU:") == macs_to_string(macs)
        for label in ("bwd latency:", "step latency:", "iter latency:", "samples/second:"):
            assert label in text
        assert "(net): Sequential(" in text and "depth 1:" in text

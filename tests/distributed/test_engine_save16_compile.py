"""engine.save_16bit_model / save_fp16_model (every rank calls, rank 0 writes the model's 16-bit
weights; under ZeRO-2 they are the fp32 masters of every rank rounded to bf16, checked against
zero_to_fp32 of a checkpoint taken at the same step), exclude_frozen_parameters, bad file names,
and engine.compile (DeepSpeed's signature) training to the same losses as the eager engine."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed


def _engine(stage: int, bf16: bool, freeze: bool = False):
    import deepspeed_c

    model = make_model("mlp", seed=4)
    if freeze:
        next(model.parameters()).requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg,
                                        model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def _train(engine, rank: int, world: int, steps: int = 3) -> list[float]:
    losses = []
    for x, y in make_batches("mlp", steps, 2 * world, seed=6):
        dt = next(engine.module.parameters()).dtype
        out = engine(x[2 * rank:2 * rank + 2].to(engine.device, dt))
        loss = loss_fn(out.float(), y[2 * rank:2 * rank + 2].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_body(rank: int, world: int, root: str) -> dict:
    engine = _engine(2, True)
    _train(engine, rank, world)
    assert engine.save_16bit_model(os.path.join(root, "m16")) is True
    assert engine.save_fp16_model(os.path.join(root, "old"), "weights.pt") is True
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    try:
        engine.save_16bit_model(root, save_filename="a/b.bin")
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"refused": refused, "files": sorted(os.listdir(os.path.join(root, "m16")))}


def test_save_16bit_model_zero2_bf16(tmp_path):
    res = run_distributed(save_body, 2, args=(str(tmp_path),), timeout=240)
    assert res[0]["files"] == ["pytorch_model.bin"]  # one file, no temporary left behind
    assert "save_filename" in res[0]["refused"]
    saved = torch.load(tmp_path / "m16" / "pytorch_model.bin", weights_only=True)
    old = torch.load(tmp_path / "old" / "weights.pt", weights_only=True)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    ref = make_model("mlp", seed=4).state_dict()
    assert set(saved) == set(ref) == set(old)
    for k, v in saved.items():
        assert v.dtype == torch.bfloat16 and v.device.type == "cpu" and v.shape == ref[k].shape
        assert torch.equal(v, fp32[k].to(torch.bfloat16)), k  # the masters of both ranks, rounded
        assert torch.equal(v, old[k])
        assert not torch.equal(v, ref[k].to(torch.bfloat16)), k  # it trained


def frozen_body(rank: int, world: int, root: str) -> list[str]:
    engine = _engine(0, False, freeze=True)
    _train(engine, rank, world, steps=1)
    engine.save_16bit_model(root, exclude_frozen_parameters=True)
    return [n for n, p in engine.module.named_parameters() if not p.requires_grad]


def test_save_16bit_model_excludes_frozen(tmp_path):
    frozen = run_distributed(frozen_body, 1, args=(str(tmp_path),), timeout=240)[0]
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert frozen and not set(frozen) & set(saved)
    assert set(saved) | set(frozen) == set(make_model("mlp", seed=4).state_dict())


def compile_body(rank: int, world: int, compiled: bool, stage: int = 2) -> dict:
    engine = _engine(stage, False)
    if compiled:
        engine.compile(backend="eager")
        assert engine.is_compiled
        engine.compile(backend="eager")  # a second call is a no-op, as in DeepSpeed
    losses = _train(engine, rank, world, steps=4)
    import deepspeed_c

    params = list(engine.module.parameters())
    with deepspeed_c.zero.GatheredParameters(params, enabled=stage == 3):  # ZeRO-3: whole values, not shards
        weights = np.concatenate([p.detach().cpu().reshape(-1).numpy() for p in params])
    return {"losses": losses, "weights": weights}


@pytest.mark.parametrize("stage", [2, 3])  # 3: the gather/release hooks run inside the compiled module
def test_compile_trains_like_eager(stage: int):
    eager = run_distributed(compile_body, 2, args=(False, stage), timeout=240)
    compiled = run_distributed(compile_body, 2, args=(True, stage), timeout=240)
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-6)
        assert np.linalg.norm(a["weights"] - b["weights"]) / np.linalg.norm(a["weights"]) < 1e-6


def refuse_body(rank: int, world: int) -> str:
    engine = _engine(0, False)
    try:
        engine.compile(schedule=[(0, [])])
    except NotImplementedError as e:
        return str(e)
    return ""


def test_compile_refuses_deepcompile():
    # in a spawned rank: initialize() brings up torch.distributed, which must not leak into this process
    assert "DeepCompile" in run_distributed(refuse_body, 1, timeout=120)[0]

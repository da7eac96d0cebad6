"""Tensor-parallel checkpoints between DeepSpeed 0.19.8 and deepspeed_c (issue 54), 4 gloo ranks,
TP 2 x DP 2, ZeRO-1, fp32, with the tests' Megatron-style GPT and mpu.

DeepSpeed -> deepspeed_c: the committed fixture tests/fixtures/deepspeed_megatron/tp2_dp2_z1 (written by
the real DeepSpeed with make_fixture.py: mp_rank_{00,01}_model_states.pt and
zero_pp_rank_{0,1}_mp_rank_{00,01}_optim_states.pt) loads here into a fresh engine from other initial
weights: the weights equal those DeepSpeed's own fresh engine loaded, and the next 3 losses DeepSpeed's.

deepspeed_c -> DeepSpeed: runs when DSC_DEEPSPEED_REAL names a directory the real DeepSpeed is installed
in (it is not a project dependency; skipped, and not counted as a pass, otherwise): a checkpoint saved
here after 3 steps loads into DeepSpeed's engine (make_fixture.py --load), whose loaded weights and next
3 losses must equal this engine's."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.distributed import megatron_models as mm
from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed_megatron")
sys.path.insert(0, FIXTURES)
import make_fixture as fx  # noqa: E402

DS_REAL = os.environ.get("DSC_DEEPSPEED_REAL", "")


def _engine(mpu: mm.MegatronMPU, seed: int) -> object:
    import deepspeed_c

    model = mm.sharded_model(mpu, seed=seed)
    engine, *_ = deepspeed_c.initialize(model=model, config=fx.config(mpu.dp), mpu=mpu)
    return engine


def load_deepspeed_written(rank: int, world: int) -> dict:
    mpu = mm.MegatronMPU(tp=2)
    batches = fx.data(mpu.dp)
    engine = _engine(mpu, seed=7)
    engine.load_checkpoint(os.path.join(FIXTURES, fx.CASE), tag=fx.TAG)
    loaded = mm.full_state(engine.module, mpu.context())
    losses = [fx.step(engine, mpu, batches[fx.STEPS_BEFORE_SAVE + i]) for i in range(fx.STEPS_AFTER_RESUME)]
    return {"loaded": loaded, "losses": losses, "steps": engine.global_steps}


def _load_both(rank: int, world: int) -> dict:
    return {"tp": load_deepspeed_written(rank, world), "3d": load_deepspeed_written_3d(rank, world)}


@pytest.fixture(scope="module")
def loaded_here() -> list:
    """Both DeepSpeed-written fixtures (TP2xDP2, PP2xTP2) loaded in one 4-rank launch: the same loads and
    steps as a launch per test, one 4-rank start on 2 cores instead of two."""
    return run_distributed(_load_both, 4, timeout=600)


def test_deepspeed_written_tp_checkpoint_loads_and_continues(loaded_here):
    expected = torch.load(os.path.join(FIXTURES, fx.CASE, "expected.pt"), weights_only=True)
    want = {k: v.numpy() for k, v in expected["loaded_weights"].items()}
    for r in (rank["tp"] for rank in loaded_here):
        errs = mm.rel_errors(r["loaded"], want)
        assert max(errs.values()) < 1e-6, errs
        assert r["steps"] == fx.STEPS_BEFORE_SAVE + fx.STEPS_AFTER_RESUME
        assert np.max(np.abs(np.array(r["losses"]) - expected["next_losses"])) < 1e-5, (r["losses"], expected)


def save_here(rank: int, world: int, ckpt: str) -> dict:
    mpu = mm.MegatronMPU(tp=2)
    batches = fx.data(mpu.dp)
    engine = _engine(mpu, seed=0)
    for i in range(fx.STEPS_BEFORE_SAVE):
        fx.step(engine, mpu, batches[i])
    engine.save_checkpoint(ckpt, tag=fx.TAG)
    saved = mm.full_state(engine.module, mpu.context())
    losses = [fx.step(engine, mpu, batches[fx.STEPS_BEFORE_SAVE + i]) for i in range(fx.STEPS_AFTER_RESUME)]
    return {"saved": saved, "losses": losses}


def _deepspeed_importable() -> bool:
    if not DS_REAL or not os.path.isdir(DS_REAL):
        return False
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], env=dict(os.environ, PYTHONPATH=DS_REAL,
                           DS_ACCELERATOR="cpu"), capture_output=True, timeout=300)
    return probe.returncode == 0


def _require_real_deepspeed() -> None:
    if not _deepspeed_importable():
        pytest.skip("runs the real DeepSpeed 0.19.8 when DSC_DEEPSPEED_REAL names a directory it is installed in "
                    "(not a project dependency); the other direction is tested with the committed fixture")


def _check_loaded_in_deepspeed(flag: str, ckpt: str, out: str, ours: dict) -> None:
    """make_fixture.py `flag` (--load, --load3d) loads our checkpoint into DeepSpeed's engine: its loaded
    weights are what we saved and its next losses are ours."""
    run = subprocess.run([sys.executable, os.path.join(FIXTURES, "make_fixture.py"), flag, ckpt, out],
                         env=dict(os.environ, PYTHONPATH=DS_REAL, DS_ACCELERATOR="cpu"), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = torch.load(out, weights_only=True)
    errs = mm.rel_errors({k: v.numpy() for k, v in theirs["loaded_weights"].items()}, ours["saved"])
    assert max(errs.values()) < 1e-6, errs
    assert np.max(np.abs(np.array(theirs["next_losses"]) - ours["losses"])) < 1e-5, (theirs, ours["losses"])


def test_our_tp_checkpoint_loads_in_deepspeed(tmp_path):
    _require_real_deepspeed()
    ckpt, out = str(tmp_path / "ours"), str(tmp_path / "deepspeed.pt")
    ours = run_distributed(save_here, 4, args=(ckpt,), timeout=300)[0]
    names = set(os.listdir(os.path.join(ckpt, fx.TAG)))
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"} <= names, names
    _check_loaded_in_deepspeed("--load", ckpt, out, ours)


# -- 3D: PipelineModule over PipeModelDataParallelTopology(2, 2, 1), ZeRO-1 --------------------------------
def load_deepspeed_written_3d(rank: int, world: int) -> dict:
    import deepspeed_c

    tp = mm.MegatronMPU(tp=2).context()
    engine = fx.engine_3d(deepspeed_c, tp, seed=7)
    path, _ = engine.load_checkpoint(os.path.join(FIXTURES, fx.CASE_3D), tag=fx.TAG)
    loaded = {k: v.numpy() for k, v in fx.whole_weights_3d(engine, tp).items()}
    batches = fx.data_3d()
    losses = [fx.step_3d(engine, batches[fx.STEPS_BEFORE_SAVE + i]) for i in range(fx.STEPS_AFTER_RESUME)]
    return {"loaded": loaded, "losses": losses, "path": os.path.basename(path)}


def test_deepspeed_written_3d_checkpoint_loads_and_continues(loaded_here):
    expected = torch.load(os.path.join(FIXTURES, fx.CASE_3D, "expected.pt"), weights_only=True)
    want = {k: v.numpy() for k, v in expected["loaded_weights"].items()}
    for rank, r in enumerate(rank_out["3d"] for rank_out in loaded_here):
        assert r["path"] == f"mp_rank_{rank:02d}_model_states.pt", r["path"]
        assert sorted(r["loaded"]) == sorted(want)
        errs = mm.rel_errors(r["loaded"], want)
        assert max(errs.values()) < 1e-6, errs
        assert np.max(np.abs(np.array(r["losses"]) - expected["next_losses"])) < 1e-5, (r["losses"], expected)


def save_here_3d(rank: int, world: int, ckpt: str) -> dict:
    import deepspeed_c

    tp = mm.MegatronMPU(tp=2).context()
    engine = fx.engine_3d(deepspeed_c, tp, seed=0)
    batches = fx.data_3d()
    for i in range(fx.STEPS_BEFORE_SAVE):
        fx.step_3d(engine, batches[i])
    engine.save_checkpoint(ckpt, tag=fx.TAG)
    saved = {k: v.numpy() for k, v in fx.whole_weights_3d(engine, tp).items()}
    losses = [fx.step_3d(engine, batches[fx.STEPS_BEFORE_SAVE + i]) for i in range(fx.STEPS_AFTER_RESUME)]
    return {"saved": saved, "losses": losses}


def test_our_3d_checkpoint_loads_in_deepspeed(tmp_path):
    _require_real_deepspeed()
    ckpt, out = str(tmp_path / "ours"), str(tmp_path / "deepspeed.pt")
    ours = run_distributed(save_here_3d, 4, args=(ckpt,), timeout=300)[0]
    _check_loaded_in_deepspeed("--load3d", ckpt, out, ours)

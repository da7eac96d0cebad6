"""Megatron-DeepSpeed's own pretrain_gpt.py (a checkout OUTSIDE this project, named by
DSC_MEGATRON_DEEPSPEED) trains a tiny GPT on 2 CPU ranks (gloo) with `import deepspeed` resolving to
deepspeed_c through the opt-in alias and its `deepspeed` launcher, unchanged flags
(benchmarks/megatron_client/run_pretrain_gpt.py builds them): pipeline 2 (Megatron's GPTModelPipe on our
PipelineEngine, tied embedding across the stages), tensor 2 (its mpu handed to initialize) and tensor 2 on a
one-stage PipelineEngine (only tensor rank 0 reads data; its batch_fn broadcasts it), and pipeline 2 with
`--enable-zbh1-pipeline` (its zero-bubble H1 schedule and BackwardOnlyPass / WeightPass methods, plugged into
our PipelineEngine through DeepSpeed's `_INSTRUCTION_MAP` and `schedule.TrainSchedule`), and pipeline 2 with MoE
layers (4 layers, 2 experts every second one: each stage holds one; it logs the engine's
`get_additional_losses()`: `lm loss` and `moe loss` beside `loss`). Every loss
is finite and the last is below the first; with DSC_DEEPSPEED_REAL (a directory where DeepSpeed 0.19.8 is
installed) the same commands under the real DeepSpeed give the same losses (1e-5 relative; Megatron logs 7
significant digits). Gradient clipping is off in the 2-stage comparison: across stages DeepSpeed's
fp32 clipping norm counts the non-tensor-parallel parameters of stage 0 only and the tied embedding on
both stages (its clip_grad_norm_ over the stage x tensor group); ours is the model's norm (README). The
zero-bubble run's losses equal our pipeline-2 run's (the same arithmetic in another order); the real
DeepSpeed 0.19.8 cannot run it (Megatron's BackwardOnlyPass calls `PipelineEngine.mem_status`, which 0.19.8
no longer has: AttributeError), so it is not run there.

Opt-in (a third-party checkout and its deps): DSC_MEGATRON_DEEPSPEED=/path/to/Megatron-DeepSpeed, and
DSC_MEGATRON_PYTHONPATH for what it imports that the venv lacks (six, einops, pybind11 for its dataset
helper build)."""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import re

import numpy as np
import pytest

from benchmarks.megatron_client import run_pretrain_gpt as client
from tests.harness import free_port

MDS = os.environ.get("DSC_MEGATRON_DEEPSPEED")
REAL = os.environ.get("DSC_DEEPSPEED_REAL")

pytestmark = pytest.mark.skipif(
    not MDS, reason="runs Megatron-DeepSpeed's pretrain_gpt.py when DSC_MEGATRON_DEEPSPEED names its checkout "
                    "(outside the project); nothing here checks it otherwise")

# tp2: its mpu through initialize (--no-pipeline-parallel); tp2pipe: its default GPTModelPipe on a one-stage
# PipelineEngine, where only tensor rank 0 has a data iterator
LAYOUTS = {"pp2": dict(tp=1, pp=2, clip=0.0), "tp2": dict(tp=2, pp=1, clip=1.0),
           "tp2pipe": dict(tp=2, pp=1, clip=1.0, pipe_engine=True), "pp2zb": dict(tp=1, pp=2, clip=0.0, zbh1=True),
           "pp2moe": dict(tp=1, pp=2, clip=0.0, experts=2, layers=4)}
# layouts the real DeepSpeed 0.19.8 cannot run (see the docstring)
NOT_ON_REAL = {"pp2zb"}


def _args(launcher: str, pythonpath: str, tag: str, layout: dict) -> argparse.Namespace:
    args = client.parser().parse_args(["--mds", MDS, "--launcher", launcher, "--pythonpath", pythonpath,
                                       "--tag", tag, "--port", str(free_port())])
    for k, v in layout.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def runs(compat_alias, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("mds")
    deps = os.environ.get("DSC_MEGATRON_PYTHONPATH", "")
    out = {}
    for name, layout in LAYOUTS.items():
        ours = _args(str(compat_alias / "bin" / "deepspeed"), os.pathsep.join(p for p in [str(compat_alias), deps] if p),
                     f"dsc_{name}", layout)
        out[("dsc", name)], out[("dsc_log", name)] = client.run(ours, pathlib.Path(work), timeout=600)
        if REAL and name not in NOT_ON_REAL:
            real = client.real_with_compress_stub(REAL, pathlib.Path(work) / "ds_real")
            theirs = _args(os.path.join(real, "bin", "deepspeed"), os.pathsep.join(p for p in [real, deps] if p),
                           f"real_{name}", layout)
            out[("real", name)], out[("real_log", name)] = client.run(theirs, pathlib.Path(work), timeout=600)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pretrain_gpt_trains_on_deepspeed_c(runs, layout):
    rows = runs[("dsc", layout)]
    assert [it for it, _, _ in rows] == list(range(1, 7)), rows
    losses = [loss for _, loss, _ in rows]
    assert all(math.isfinite(l) for l in losses), losses
    assert losses[-1] < losses[0] - 0.05, losses


def _moe_losses(log: str) -> list[tuple[float, float, float]]:
    """(loss, lm loss, moe loss) of each logged iteration."""
    num = r"([0-9.E+-]+)"
    return [tuple(float(g) for g in m.groups())
            for m in re.finditer(rf"\| loss: {num} \| lm loss: {num} \| moe loss: {num}", log)]


def test_moe_pipeline_reports_the_additional_losses(runs):
    ours = _moe_losses(runs[("dsc_log", "pp2moe")])
    assert len(ours) == 6, ours
    for loss, lm, moe in ours:  # Megatron's loss is its lm loss plus the MoE loss (moe_loss_coeff applied)
        assert math.isfinite(moe) and moe > 0
        np.testing.assert_allclose(loss, lm + moe, rtol=1e-5)
    if REAL:
        np.testing.assert_allclose(ours, _moe_losses(runs[("real_log", "pp2moe")]), rtol=1e-5)


def test_zero_bubble_pipeline_gives_the_pipeline_losses(runs):
    zb = [loss for _, loss, _ in runs[("dsc", "pp2zb")]]
    plain = [loss for _, loss, _ in runs[("dsc", "pp2")]]
    np.testing.assert_allclose(zb, plain, rtol=1e-6)


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - NOT_ON_REAL))
def test_pretrain_gpt_losses_equal_the_real_deepspeed(runs, layout):
    if not REAL:
        pytest.skip("compares with the real DeepSpeed 0.19.8 when DSC_DEEPSPEED_REAL names the directory it is "
                    "installed in")
    ours = [loss for _, loss, _ in runs[("dsc", layout)]]
    theirs = [loss for _, loss, _ in runs[("real", layout)]]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)

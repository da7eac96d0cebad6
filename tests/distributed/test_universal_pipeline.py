"""A pipeline checkpoint through a universal checkpoint into other pipeline and data-parallel degrees.

Saved by deepspeed_c's PipelineEngine at 2 stages x DP 2, ZeRO-1, fp32, with the tied input/output
projection of tests/distributed/pipe_models.py; converted by ds_to_universal (the stages' ZeRO files and
layer files, parameters by their layer names); loaded with checkpoint.load_universal at 2 stages x DP 1,
4 stages x DP 1 and 1 stage, and continued: the losses equal the uninterrupted run's (the global batch,
data-parallel degree x gradient accumulation, is the same everywhere; relative 1e-5).

DeepSpeed 0.19.8's own pipeline checkpoint (2 stages x DP 2, ZeRO-1, the same layers built with
deepspeed.pipe; tests/fixtures/deepspeed_pipeline), converted by our ds_to_universal, resumes at 1, 2 and 4
stages with the next losses DeepSpeed's engine had resuming from it."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tests.distributed import pipe_models as pm
from tests.harness import run_distributed

GLOBAL_MICRO = 4  # micro-batches per step over all data-parallel ranks
SAVE_AT, AFTER = 2, 2


def _engine(stages: int, dp: int, universal: bool) -> Any:
    import torch

    import deepspeed_c
    from deepspeed_c.pipe import PipelineModule

    model = PipelineModule(pm.specs(True), num_stages=stages, loss_fn=pm.loss_fn, seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": pm.MBS, "gradient_accumulation_steps": GLOBAL_MICRO // dp,
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return deepspeed_c.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))[0]


def _steps(engine: Any, dp: int, first: int, count: int) -> list[float]:
    data = pm.batches(first + count, 1, GLOBAL_MICRO)  # [step][GLOBAL_MICRO]: the same at every degree
    gas = GLOBAL_MICRO // dp
    d = engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(iter(data[s][d * gas:(d + 1) * gas]))) for s in range(first, first + count)]


def save_run(rank: int, world: int, root: str) -> list[float]:
    engine = _engine(2, 2, False)
    _steps(engine, 2, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="t")
    return _steps(engine, 2, SAVE_AT, AFTER)


def resume_run(rank: int, world: int, root: str, stages: int) -> list[float]:
    dp = world // stages
    engine = _engine(stages, dp, True)
    engine.load_checkpoint(root)  # the tag from latest_universal
    assert engine.global_steps == SAVE_AT
    return _steps(engine, dp, SAVE_AT, AFTER)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: Any) -> tuple[str, list]:
    from deepspeed_c.checkpoint.ds_to_universal import main, parse_arguments

    root = str(tmp_path_factory.mktemp("pipeu"))
    straight = run_distributed(save_run, 4, args=(root,), timeout=300)
    main(parse_arguments(["--input_folder", os.path.join(root, "t"), "--output_folder", os.path.join(root, "t_univ"),
                          "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]))
    return root, straight[-1]  # the last stage reports the loss


@pytest.mark.parametrize("stages,world", [(2, 2), (4, 4), (1, 1)])
def test_pipeline_resumes_at_other_degrees(converted: tuple, stages: int, world: int) -> None:
    root, want = converted
    got = run_distributed(resume_run, world, args=(root, stages), timeout=300)[-1]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# -- DeepSpeed 0.19.8's pipeline checkpoint (tests/fixtures/deepspeed_pipeline, its make_fixtures.py) -----
DS_PIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_pipeline")


def resume_deepspeed_written(rank: int, world: int, folder: str, stages: int) -> list[float]:
    import sys

    import deepspeed_c
    from deepspeed_c.pipe import PipelineModule

    sys.path.insert(0, DS_PIPE)
    import make_fixtures as fx

    dp = world // stages
    model = PipelineModule(pm.specs(True), num_stages=stages, loss_fn=pm.loss_fn)
    cfg = fx.config(dp)
    cfg["checkpoint"] = {"load_universal": True}
    engine = deepspeed_c.initialize(model=model, config=cfg)[0]
    engine.load_checkpoint(os.path.dirname(folder), tag=os.path.basename(folder))
    batches = fx.data(fx.STEPS_BEFORE_SAVE + fx.STEPS_AFTER_RESUME)
    gas = fx.GLOBAL_MICRO // dp
    d = engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(iter(batches[s][d * gas:(d + 1) * gas])))
            for s in range(fx.STEPS_BEFORE_SAVE, fx.STEPS_BEFORE_SAVE + fx.STEPS_AFTER_RESUME)]


@pytest.fixture(scope="module")
def deepspeed_converted(tmp_path_factory: Any) -> str:
    from deepspeed_c.checkpoint.ds_to_universal import main, parse_arguments

    out = str(tmp_path_factory.mktemp("dspipe") / "universal")
    main(parse_arguments(["--input_folder", os.path.join(DS_PIPE, "pp2_dp2_z1", "ckpt", "ckpt"), "--output_folder",
                          out, "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]))
    return out


@pytest.mark.parametrize("stages,world", [(1, 1), (2, 2), (4, 4)])
def test_deepspeed_pipeline_checkpoint_resumes_at_other_degrees(deepspeed_converted: str, stages: int,
                                                                world: int) -> None:
    import torch

    want = torch.load(os.path.join(DS_PIPE, "pp2_dp2_z1", "expected.pt"), weights_only=True)["next_losses"]
    got = run_distributed(resume_deepspeed_written, world, args=(deepspeed_converted, stages), timeout=300)[-1]
    np.testing.assert_allclose(got, want, rtol=1e-5)

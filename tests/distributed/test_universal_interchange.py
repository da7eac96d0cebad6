"""Universal checkpoints interchange with DeepSpeed 0.19.8 (fixtures: tests/fixtures/deepspeed_universal,
written by its make_fixtures.py with the real DeepSpeed).

- DeepSpeed's own ds_to_universal output of its ZeRO-1/2/3 DP-2 checkpoints loads into deepspeed_c's
  engine (checkpoint.load_universal) at DP 1 and 2 and continues with the losses DeepSpeed's engine had
  loading the same folder (relative 1e-5).
- deepspeed_c's ds_to_universal on the same DeepSpeed checkpoints writes the same values as DeepSpeed's
  script, file by file (parameters, moments, steps, param groups); when the fixtures were made, DeepSpeed's
  engine loaded deepspeed_c's output and continued with the same losses as from its own (recorded in
  expected.pt as `ours_universal`, checked equal by the generator and again here)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.universal_helpers import resume_deepspeed_written
from tests.harness import run_distributed

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
HERE = os.path.join(FIXTURES, "deepspeed_universal")
STAGES = (1, 2, 3)


def _close(got: list, want: list) -> None:
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeeds_universal_output_loads_here(world: int) -> None:
    for source in STAGES:
        case = os.path.join(HERE, f"z{source}_fp32_w2")
        expected = torch.load(os.path.join(case, "expected.pt"), weights_only=True)
        want = expected["ds_universal"][world]
        _close(expected["ours_universal"][world], want)  # DeepSpeed loading ours, when the fixture was made
        got = run_distributed(resume_deepspeed_written, world, args=(os.path.join(case, "ds_universal"), list(STAGES)),
                              timeout=300)[0]
        for stage, losses in got.items():
            _close(losses, want)


def _values(obj: Any) -> Any:
    return obj["param"] if isinstance(obj, dict) and "param" in obj else obj


@pytest.mark.parametrize("stage", STAGES)
def test_our_conversion_equals_deepspeeds(tmp_path: Any, stage: int) -> None:
    from deepspeed_c.checkpoint import safe_load
    from deepspeed_c.checkpoint.ds_to_universal import main, parse_arguments

    case = os.path.join(HERE, f"z{stage}_fp32_w2")
    out = str(tmp_path / "ours")
    main(parse_arguments(["--input_folder", os.path.join(case, "ckpt", "ckpt"), "--output_folder", out,
                          "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]))
    theirs_root, ours_root = os.path.join(case, "ds_universal", "zero"), os.path.join(out, "zero")
    params = sorted(d for d in os.listdir(theirs_root) if os.path.isdir(os.path.join(theirs_root, d)))
    assert params == sorted(d for d in os.listdir(ours_root) if os.path.isdir(os.path.join(ours_root, d)))
    for name in params:
        for f in os.listdir(os.path.join(theirs_root, name)):
            theirs = _values(safe_load.load(os.path.join(theirs_root, name, f)))
            ours = _values(safe_load.load(os.path.join(ours_root, name, f)))
            if torch.is_tensor(theirs):
                assert torch.equal(ours.reshape(-1), theirs.reshape(-1)), (name, f)
                if theirs.dim() > 1:
                    assert ours.shape == theirs.shape, (name, f)
            else:
                assert ours == theirs, (name, f)
    theirs_opt = safe_load.load(os.path.join(theirs_root, "optimizer_state.pt"))
    ours_opt = safe_load.load(os.path.join(ours_root, "optimizer_state.pt"))
    assert ours_opt["param_groups"] == theirs_opt["param_groups"]
    if stage == 3:  # where DeepSpeed's stage-3 loader reads the step
        assert float(ours_opt["optimizer_state_dict"]["state"][0]["step"]) == \
            float(theirs_opt["optimizer_state_dict"]["state"][0]["step"])

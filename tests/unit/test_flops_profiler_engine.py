"""The engine's flops_profiler section in one process: the profile goes to output_file at
profile_step (fwd flops = the MLP's analytic count), engine.flops_profiler is DeepSpeed's
FlopsProfiler, and an unknown key in the section names the closest valid one."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c.profiling.flops_profiler import FlopsProfiler, number_to_string
from tests.distributed.engine_models import MLP, loss_fn


pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def _engine(section: dict):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "flops_profiler": section}
    engine, _, _, _ = deepspeed_c.initialize(model=MLP(), config=cfg)
    return engine


def test_profile_written_to_output_file_at_profile_step(tmp_path):
    path = tmp_path / "prof" / "flops.txt"
    engine = _engine({"enabled": True, "profile_step": 2, "detailed": False, "output_file": str(path),
                      "recompute_fwd_factor": 0.5})
    assert isinstance(engine.flops_profiler, FlopsProfiler) and engine.flops_profiler_profile_step() == 2
    for step in range(4):
        loss = loss_fn(engine(torch.randn(4, 12)), torch.randn(4, 3))
        engine.backward(loss)
        engine.step()
        assert path.exists() == (step >= 2)
    text = path.read_text()
    macs = 4 * (12 * 24 + 24 * 24 + 24 * 3)
    assert "Profile Summary at step 3:" in text
    assert "{:<70}  {:<8}".format("fwd flops per GPU: ", number_to_string(2 * macs)) in text.splitlines()
    assert "bwd FLOPS per GPU = 2.5 * fwd flops per GPU / bwd latency:" in text  # 2 + recompute_fwd_factor
    assert "Detailed Profile per GPU" not in text
    engine.destroy()


def test_disabled_and_bad_keys():
    engine = _engine({"enabled": False})
    assert engine.flops_profiler is None
    engine.destroy()
    # DeepSpeed reads the section key by key: a misspelt key is ignored; here it also warns with the closest key
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigWarning

    with pytest.warns(DeepSpeedConfigWarning, match="did you mean 'profile_step'"):
        engine = _engine({"enabled": True, "profile_stepp": 2})
    assert engine.flops_profiler is not None
    engine.destroy()

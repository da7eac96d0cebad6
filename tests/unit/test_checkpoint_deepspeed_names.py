"""ZeRO checkpoint files named and keyed as DeepSpeed 0.19.8 reads them (issue 22 item 5, first part).

DeepSpeed's engine names a rank's ZeRO file `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`
whenever bf16 is enabled (any stage; `_get_zero_ckpt_prefix`), tries the other name on load, and
its ZeRO loader asserts `ds_version` inside each file's `optimizer_state_dict`. Checked: the names
and the key; a checkpoint written with the other name (deepspeed_c's bf16 stage-2 files before
this change) still loads, with identical weights."""
from __future__ import annotations

import os

import pytest
import torch

import deepspeed_c
from deepspeed_c.checkpoint import safe_load
from tests.distributed.engine_models import MLP

CFG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
       "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 2}}


pytestmark = pytest.mark.usefixtures("world_of_one")


def _engine():
    torch.manual_seed(0)
    model = MLP()
    return deepspeed_c.initialize(model=model, config=CFG, model_parameters=model.parameters())[0]


def test_bf16_stage2_names_and_ds_version(tmp_path):
    e = _engine()
    loss = e(torch.randn(2, 12).to(torch.bfloat16)).float().pow(2).mean()
    e.backward(loss)
    e.step()
    e.save_checkpoint(str(tmp_path), tag="t")
    name = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert os.path.isfile(tmp_path / "t" / name)
    # holds DeepSpeed's pickled objects (loss scaler, stage enum): loaded as DeepSpeed's own files are
    sd = safe_load.load(str(tmp_path / "t" / name))
    assert sd["optimizer_state_dict"]["ds_version"] == "0.19.8"
    # the other name (no prefix) loads too, as DeepSpeed's loader tries both
    os.rename(tmp_path / "t" / name, tmp_path / "t" / name.removeprefix("bf16_"))
    manifest = tmp_path / "t" / "dsc_manifest.json"
    if manifest.exists():
        manifest.write_text(manifest.read_text().replace(name, name.removeprefix("bf16_")))
    f = _engine()
    f.load_checkpoint(str(tmp_path), tag="t")
    for p, q in zip(e.module.parameters(), f.module.parameters()):
        assert torch.equal(p, q)

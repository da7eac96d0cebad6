"""Config leniency where DeepSpeed 0.19.8 is lenient, strictness where it is strict.

DeepSpeed's behaviour, from its config reader: the `optimizer` section is read with plain
`get("type")` / `get("params")` / `get("legacy_fusion")`, so any other key beside them (a misplaced
`torch_adam`) is ignored; `zero_allow_untested_optimizer` is read with `get_scalar_param` and used
as a truth value, so `1` allows; config files (and base64 configs) are parsed with `hjson.load`;
the stage 1/2 optimizer asserts `allgather_bucket_size % nccl_start_alignment_factor == 0` (2).
The ZeRO section stays strict (pydantic `extra="forbid"` there)."""
from __future__ import annotations

import base64
import json

import pytest

from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from tests.distributed.engine_models import make_model

BASE = {"train_batch_size": 2, "steps_per_print": 10**9}


pytestmark = pytest.mark.usefixtures("world_of_one")


def test_unknown_key_beside_params_is_accepted():
    cfg = DeepSpeedConfig({**BASE, "optimizer": {"type": "AdamW", "torch_adam": True,
                                                  "params": {"lr": 1e-3}}})
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 1e-3}


def test_zero_section_stays_strict():
    with pytest.raises(DeepSpeedConfigError, match="reduce_bucket_size"):
        DeepSpeedConfig({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_sizes": 10}})


@pytest.mark.parametrize("value,allowed", [(1, True), (0, False), ("yes", True), (True, True)])
def test_zero_allow_untested_optimizer_truthy(value, allowed):
    assert DeepSpeedConfig({**BASE, "zero_allow_untested_optimizer": value}).zero_allow_untested_optimizer is allowed


def test_hjson_config_file_and_base64(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text("{\n  # comments and unquoted keys, as DeepSpeed's hjson reader allows\n"
                    "  train_batch_size: 4\n  gradient_accumulation_steps: 2,\n"
                    "  zero_optimization: {stage: 1}\n}\n")
    cfg = DeepSpeedConfig(str(path))
    assert cfg.train_batch_size == 4 and cfg.gradient_accumulation_steps == 2 and cfg.zero_optimization_stage == 1
    encoded = base64.urlsafe_b64encode(json.dumps({**BASE, "gradient_clipping": 0.5}).encode()).decode()
    assert DeepSpeedConfig(encoded).gradient_clipping == 0.5


def test_odd_allgather_bucket_size_refused():
    import deepspeed_c

    model = make_model("mlp", seed=0)
    cfg = {**BASE, "train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 1, "allgather_bucket_size": 5001}}
    with pytest.raises(AssertionError, match="allgather_bucket_size must be a multiple"):
        deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())


def test_gradient_clipping_default_follows_0_19_8_with_a_note(caplog):
    """DeepSpeed 0.19.3 changed `gradient_clipping`'s default from 0.0 to 1.0; a config that leaves it
    out gets 1.0 and one note naming the key and both defaults."""
    import logging

    import deepspeed_c.runtime.config.ds_config as config_module

    config_module._NOTED_DEFAULTS.discard("gradient_clipping")
    with caplog.at_level(logging.WARNING):
        assert DeepSpeedConfig(dict(BASE)).gradient_clipping == 1.0
        DeepSpeedConfig(dict(BASE))
    notes = [r.getMessage() for r in caplog.records if "'gradient_clipping'" in r.getMessage()]
    assert len(notes) == 1 and "1.0" in notes[0] and "0.0" in notes[0]
    assert DeepSpeedConfig({**BASE, "gradient_clipping": 0.0}).gradient_clipping == 0.0


def test_flops_profiler_unknown_key_warns_and_is_ignored():
    # DeepSpeed reads flops_profiler key by key, so its own tests' stale `"step": 1` is simply unused
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigWarning

    with pytest.warns(DeepSpeedConfigWarning, match=r"flops_profiler\.step.*did you mean 'profile_step'"):
        cfg = DeepSpeedConfig({**BASE, "flops_profiler": {"enabled": True, "step": 3, "top_modules": 2}})
    fp = cfg.flops_profiler_config
    assert fp.enabled is True and fp.top_modules == 2 and fp.profile_step == 1
    with pytest.raises(DeepSpeedConfigError, match="flops_profiler.top_modules"):
        DeepSpeedConfig({**BASE, "flops_profiler": {"top_modules": "many"}})

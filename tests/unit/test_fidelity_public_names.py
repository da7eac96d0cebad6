"""Public names DeepSpeed 0.19.8 exports at top level and in deepspeed.utils, and the version policy.

DeepSpeed's `deepspeed/__init__.py` exports `OnDevice` (from deepspeed.utils), `DeepSpeedConfigError`
(from deepspeed.runtime.config), `__git_hash__` and `__git_branch__`, and `__version__`; its
`deepspeed.utils.groups` is a module scripts import. `OnDevice(dtype, device="meta", enabled=True)`
builds modules on `device` with floating tensors in `dtype`, integer tensors unchanged."""
from __future__ import annotations

import packaging.version
import pytest
import torch

import deepspeed_c


def test_top_level_names():
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

    assert deepspeed_c.DeepSpeedConfigError is DeepSpeedConfigError
    assert isinstance(deepspeed_c.__git_hash__, str) and isinstance(deepspeed_c.__git_branch__, str)
    assert deepspeed_c.OnDevice is deepspeed_c.utils.OnDevice


def test_version_says_the_deepspeed_release_matched():
    v = packaging.version.parse(deepspeed_c.__version__)
    assert v.release == (0, 19, 8) and v.local is not None and v.local.startswith("dsc")
    assert (deepspeed_c.__version_major__, deepspeed_c.__version_minor__, deepspeed_c.__version_patch__) == (0, 19, 8)


def test_utils_groups_is_a_module():
    assert hasattr(deepspeed_c.utils, "groups") is True
    from deepspeed_c.utils import groups

    assert groups.get_data_parallel_world_size() == 1 and groups.get_model_parallel_world_size() == 1
    with pytest.raises(AssertionError, match="ep_size_2.*not initialized.*MoE"):
        groups._get_expert_parallel_group("ep_size_2")


def test_on_device_meta_and_dtype():
    before = torch.get_default_dtype()
    with deepspeed_c.OnDevice(dtype=torch.bfloat16, device="meta"):
        lin = torch.nn.Linear(8, 4)
        idx = torch.arange(3)
    assert lin.weight.device.type == "meta" and lin.weight.dtype == torch.bfloat16
    assert idx.dtype == torch.int64 and idx.device.type == "meta"
    assert torch.get_default_dtype() == before
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with deepspeed_c.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        off = torch.nn.Linear(2, 2)
    assert off.weight.device.type == "cpu" and off.weight.dtype == before
    with pytest.raises(TypeError, match="dtype"):
        deepspeed_c.OnDevice(dtype=torch.int32)

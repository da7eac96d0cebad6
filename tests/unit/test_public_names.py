"""DeepSpeed's public import paths that the foundation provides."""
import logging

import pytest
import torch

import deepspeed_c
from deepspeed_c.ops.op_builder import ALL_OPS


def test_logger_is_a_logging_logger():
    from deepspeed_c.utils import logger

    assert isinstance(logger, logging.Logger)
    assert deepspeed_c.utils.logger is logger


def test_compatible_ops_maps_every_op_to_a_bool():
    import deepspeed_c.ops as ops

    compat = ops.__compatible_ops__
    assert set(compat) == set(ALL_OPS)
    assert all(isinstance(v, bool) for v in compat.values())
    for name, ok in compat.items():
        assert ok == ALL_OPS[name]().is_compatible()


def test_op_builder_import_path_and_version():
    from deepspeed_c.ops import op_builder

    assert op_builder.UtilsBuilder.NAME == "utils"
    assert isinstance(deepspeed_c.__version__, str)
    assert deepspeed_c.__version_major__ == int(deepspeed_c.__version__.split(".")[0])


def test_unknown_attribute_raises_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        deepspeed_c.no_such_thing


def test_git_version_info_module():
    import torch

    from deepspeed_c import git_version_info as gvi
    from deepspeed_c.version import DEEPSPEED_API_VERSION

    assert gvi.version == DEEPSPEED_API_VERSION and gvi.git_hash == deepspeed_c.__git_hash__
    assert set(gvi.installed_ops) == set(ALL_OPS) and not any(gvi.installed_ops.values())
    major, minor = torch.__version__.split(".")[:2]
    assert gvi.torch_info["version"] == f"{major}.{minor}"
    assert {"cuda_version", "nccl_version", "hip_version", "bf16_support"} <= set(gvi.torch_info)


def test_precision_config_readers():
    import pytest

    from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
    from deepspeed_c.runtime.precision_config import get_bfloat16_config, get_float16_config

    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled is True
    assert get_bfloat16_config({"bf16": {"immediate_grad_update": True}}).immediate_grad_update is True
    assert get_bfloat16_config({}).enabled is False
    # bf16 steps skip on a non-finite gradient norm unless turned off (DeepSpeed 0.19.8's default)
    assert get_bfloat16_config({"bf16": {"enabled": True}}).check_grad_overflow is True
    assert get_bfloat16_config({"bf16": {"check_grad_overflow": False}}).check_grad_overflow is False
    fp16 = get_float16_config({"fp16": {"enabled": True, "loss_scale_window": 50}})
    assert (fp16.enabled, fp16.loss_scale, fp16.loss_scale_window, fp16.initial_scale_power) == (True, 0.0, 50, 16)
    with pytest.raises(DeepSpeedConfigError, match="fp16"):
        get_float16_config({"fp16": {"no_such_key": 1}})


def test_runtime_config_optimizer_name_constants():
    import pytest

    import deepspeed_c.runtime.config as cfg_mod
    from deepspeed_c.runtime.config import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, DEEPSPEED_OPTIMIZERS,
                                            LAMB_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER)

    names = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
    assert names == ["adagrad", "adam", "adamw", "lamb", "lion", "muon"]
    assert set(names) <= set(DEEPSPEED_OPTIMIZERS)
    with pytest.raises(AttributeError, match="NO_SUCH_OPTIMIZER"):
        cfg_mod.NO_SUCH_OPTIMIZER


def test_utils_torch_version_helpers():
    import pytest
    import torch

    from deepspeed_c.utils.torch import register_grad_hook, required_torch_version

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=f"{major}.{minor}") and required_torch_version(min_version=1.0)
    assert not required_torch_version(min_version=f"{major + 1}.0")
    assert not required_torch_version(max_version=f"{major - 1}.9") and required_torch_version(max_version=99)
    with pytest.raises(AssertionError):
        required_torch_version()
    p = torch.nn.Parameter(torch.ones(3))
    seen = []
    handle = register_grad_hook(p, lambda t: seen.append(t.grad.clone()))
    (p * 2).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    handle.remove()


def test_checkpoint_file_name_helpers():
    import deepspeed_c.checkpoint
    from deepspeed_c.checkpoint.utils import (get_layer_ckpt_name_for_rank, get_model_ckpt_name_for_rank,
                                              get_zero_ckpt_name_for_rank)

    assert deepspeed_c.checkpoint.get_zero_ckpt_name_for_rank is get_zero_ckpt_name_for_rank  # DeepSpeed exports it there

    # the file names of a DeepSpeed checkpoint folder (global_stepN/), spelled out
    assert get_model_ckpt_name_for_rank("ck/global_step3", "01") == "ck/global_step3/mp_rank_01_model_states.pt"
    assert get_zero_ckpt_name_for_rank("d", 2, 0) == "d/zero_pp_rank_2_mp_rank_00_optim_states.pt"
    assert get_layer_ckpt_name_for_rank("d", "layer_05", 1) == "d/layer_05-model_01_model_states.pt"


def test_runtime_utils_partition_helpers():
    # deepspeed.runtime.utils' layer-partition helpers: the first num_items % num_parts parts take one item more;
    # balanced parts minimise the heaviest minus the lightest
    from deepspeed_c.runtime.utils import partition_balanced, partition_uniform, prefix_sum_inc

    assert partition_uniform(5, 4) == [0, 2, 3, 4, 5] and partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    w = [1, 1, 1, 1, 0, 1]
    b = partition_balanced(w, 4)
    sums = [sum(w[i:j]) for i, j in zip(b[:-1], b[1:])]
    assert b[0] == 0 and b[-1] == len(w) and max(sums) - min(sums) == 1
    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]


def test_log_dist_rank_choice_and_utils_helpers(monkeypatch):
    import deepspeed_c
    from deepspeed_c.utils import logging as dsc_logging

    logged = []
    monkeypatch.setattr(dsc_logging.logger, "log", lambda level, msg: logged.append(msg))
    if not torch.distributed.is_initialized():
        assert dsc_logging.get_dist_msg("m") == "[Rank -1] m"  # before the group: every process, as rank -1
        deepspeed_c.init_distributed(dist_backend="gloo")
    # as DeepSpeed: with a process group, ranks=None logs nowhere; [-1] everywhere; a list on those ranks
    deepspeed_c.utils.log_dist("none")
    deepspeed_c.utils.log_dist("all", ranks=[-1])
    deepspeed_c.utils.log_dist("mine", ranks=[torch.distributed.get_rank()])
    deepspeed_c.utils.log_dist_once("once", ranks=[-1])
    deepspeed_c.utils.log_dist_once("once", ranks=[-1])
    assert [m.split("] ", 1)[1] for m in logged] == ["all", "mine", "once"]
    deepspeed_c.utils.set_log_level_from_string("Error")
    try:
        assert dsc_logging.logger.level == logging.ERROR
    finally:
        deepspeed_c.utils.set_log_level_from_string("info")
    with pytest.raises(ValueError, match="verbose"):
        deepspeed_c.utils.set_log_level_from_string("verbose")
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert deepspeed_c.utils.recursive_getattr(m, "0.weight") is m[0].weight
    deepspeed_c.utils.recursive_setattr(m, "0", torch.nn.Identity())
    assert isinstance(m[0], torch.nn.Identity)
    assert deepspeed_c.utils.instrument_w_nvtx(lambda x: x + 1)(1) == 2


def test_op_builder_installed_rocm_version():
    from deepspeed_c.ops.op_builder.builder import OpBuilder

    v = OpBuilder.installed_rocm_version()  # DeepSpeed's 1-bit tests compare it at import
    assert isinstance(v, tuple) and len(v) == 2 and (v == (0, 0)) is (getattr(torch.version, "hip", None) is None)


def test_set_autotp_mode():
    from deepspeed_c.module_inject.layers import is_autotp_training_mode
    from deepspeed_c.runtime.tensor_parallel import AUTOTP_MODE
    from deepspeed_c.runtime.tensor_parallel.mode import get_auto_tp_mode

    deepspeed_c.set_autotp_mode(training=True)
    assert is_autotp_training_mode() and get_auto_tp_mode() is AUTOTP_MODE.TRAINING
    deepspeed_c.module_inject.set_autotp_mode()  # DeepSpeed's default: inference
    assert not is_autotp_training_mode()

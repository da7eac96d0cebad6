"""The opt-in `deepspeed` distribution (compat/deepspeed): DeepSpeed's import paths resolve to the
same deepspeed_c objects, the distribution metadata passes Hugging Face's version gate, and the
`deepspeed` / `ds_report` commands exist."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.metadata, packaging.version, sys
import deepspeed, deepspeed_c
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
import deepspeed.comm as dist
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
import deepspeed_c.ops.adam, deepspeed_c.runtime.engine, deepspeed_c.comm
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
assert "deepspeed_c.moe.layer" not in sys.modules
assert deepspeed.moe.layer.MoE.__name__ == "MoE"  # a submodule reached as an attribute, never imported by name
assert deepspeed is deepspeed_c
assert DeepSpeedCPUAdam is deepspeed_c.ops.adam.DeepSpeedCPUAdam
assert deepspeed.DeepSpeedEngine is DeepSpeedEngine is deepspeed_c.runtime.engine.DeepSpeedEngine
assert dist is deepspeed_c.comm and callable(deepspeed.initialize)
assert "WarmupLR" in VALID_LR_SCHEDULES and DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
v = importlib.metadata.version("deepspeed")
assert packaging.version.parse(v) >= packaging.version.parse("0.9.3"), v
try:
    import deepspeed.no_such_module
except ImportError:
    pass
else:
    raise AssertionError("a missing submodule must raise ImportError")
print("ALIAS_OK", v)
"""


# DeepSpeed module paths that Hugging Face, Lightning, accelerate and user scripts import, whose code moved
# inside deepspeed_c (runtime/config/, runtime/engine/, runtime/checkpointing/ ...): (module, name)
KEPT_PATHS = [
    ("runtime.engine", "DeepSpeedEngine"), ("runtime.config", "DeepSpeedConfig"),
    ("runtime.config_utils", "DeepSpeedConfigModel"), ("runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    ("runtime.zero.stage3", "estimate_zero3_model_states_mem_needs_all_live"),
    ("runtime.zero.config", "ZeroStageEnum"), ("runtime.zero.offload_config", "OffloadDeviceEnum"),
    ("runtime.zero.partition_parameters", "GatheredParameters"), ("runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("runtime.activation_checkpointing.checkpointing", "configure"), ("runtime.pipe", "PipelineModule"),
    ("runtime.sequence_parallel.ulysses_sp", "UlyssesSPAttentionHF"),
    ("checkpoint.utils", "clone_tensors_for_torch_save"),
    ("utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint"),
]

PROBE_KEPT = r"""
import importlib, sys
for mod, name in %r:
    ours = getattr(importlib.import_module("deepspeed_c." + mod), name)
    theirs = getattr(importlib.import_module("deepspeed." + mod), name)
    assert theirs is ours, (mod, name)
print("KEPT_OK", len(%r))
"""


@pytest.fixture(scope="module")
def target(compat_alias):
    return compat_alias


def test_deepspeed_import_paths_are_deepspeed_c(target):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=120)
    assert out.returncode == 0 and "ALIAS_OK 0.19.8+dsc.0.1.0" in out.stdout, out.stdout


def test_deepspeed_module_paths_kept_after_the_layout_moves(target):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", PROBE_KEPT % (KEPT_PATHS, KEPT_PATHS)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0 and f"KEPT_OK {len(KEPT_PATHS)}" in out.stdout, out.stdout


def test_commands_are_installed(target):
    for name in ("deepspeed", "ds_report"):
        script = target / "bin" / name
        assert script.exists(), name
        text = script.read_text()
        assert "deepspeed_c" in text

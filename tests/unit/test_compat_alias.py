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
import importlib.metadata, packaging.version
import deepspeed, deepspeed_c
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
import deepspeed.comm as dist
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
import deepspeed_c.ops.adam, deepspeed_c.runtime.engine, deepspeed_c.comm
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


@pytest.fixture(scope="module")
def target(compat_alias):
    return compat_alias


def test_deepspeed_import_paths_are_deepspeed_c(target):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=120)
    assert out.returncode == 0 and "ALIAS_OK 0.19.8+dsc.0.1.0" in out.stdout, out.stdout


def test_commands_are_installed(target):
    for name in ("deepspeed", "ds_report"):
        script = target / "bin" / name
        assert script.exists(), name
        text = script.read_text()
        assert "deepspeed_c" in text

import os
import pathlib
import subprocess
import sys

import pytest

# Ranks spawned by tests/harness.py import test modules by their package path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# `--dist loadfile` runs the longest test files first, each whole on one worker (tests/xdist_order.py)
from tests.xdist_order import (pytest_collection_modifyitems, pytest_configure_node,  # noqa: E402,F401
                               pytest_xdist_make_scheduler)


@pytest.fixture(scope="session")
def compat_alias(tmp_path_factory) -> pathlib.Path:
    """The opt-in `deepspeed` distribution (compat/deepspeed) pip-installed into a private target
    directory: put it first on PYTHONPATH to run as a user who installed the alias."""
    tgt = tmp_path_factory.mktemp("compat")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(tgt), os.path.join(ROOT, "compat", "deepspeed")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    return tgt


@pytest.fixture(scope="module")
def world_of_one():
    """For test modules that call deepspeed_c.initialize in-process: initialize starts a process group
    of one; it is destroyed after the module so later modules see none."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_across_modules():
    """Every test module starts without a default process group: one that a module's in-process initialize
    started (world_of_one says so explicitly) is destroyed once the module ends, so the order xdist hands
    files out in (tests/xdist_order.py) cannot make one module see another's group."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_finish(session) -> None:
    """What collection loaded (torch, the test modules) lives for the whole run: out of the cyclic
    collector's reach, each full collection during a test walks only what tests made since."""
    import gc

    gc.collect()
    gc.freeze()

"""`pip install .` builds with setuptools alone, without importing torch, ships the C sources for
the JIT builder, and the installed package builds and runs an op from them."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    poison = tmp / "poison"
    (poison / "torch").mkdir(parents=True)
    (poison / "torch" / "__init__.py").write_text("raise ImportError('torch was imported during the build')\n")
    target = tmp / "site"
    env = dict(os.environ, PYTHONPATH=str(poison))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    return target


def test_wheel_contents(installed):
    pkg = installed / "deepspeed_c"
    assert list(pkg.glob("_C*.abi3.so")), "the core module is built against the limited API"
    assert (pkg / "_csrc" / "include" / "dsc" / "tensor_view.h").exists()
    assert (pkg / "_csrc" / "py" / "tensor_view.c").exists()
    assert (pkg / "ops" / "op_builder" / "builder.py").exists()
    assert not (installed / "op_builder").exists()  # builders live only under deepspeed_c.ops


def test_installed_package_jit_builds_from_shipped_sources(installed, tmp_path):
    code = (
        "import torch, deepspeed_c\n"
        "from deepspeed_c.ops.op_builder import UtilsBuilder, builder\n"
        "assert str(builder.csrc_root()).startswith(deepspeed_c.__path__[0]), builder.csrc_root()\n"
        "m = UtilsBuilder().load()\n"
        "ts = [torch.arange(3.), torch.arange(2.)]\n"
        "out = torch.empty(5); m.flatten(ts, out)\n"
        "assert out.tolist() == [0., 1., 2., 0., 1.]\n"
        "print(deepspeed_c.__file__)\n")
    env = dict(os.environ, PYTHONPATH=str(installed), DSC_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, out.stdout
    assert str(installed) in out.stdout


def test_ahead_of_time_build_is_opt_in_and_used(tmp_path):
    from deepspeed_c.ops.op_builder import ALL_OPS

    target = tmp_path / "site"
    env = dict(os.environ, DS_BUILD_OPS="1")
    env.update({f"DS_BUILD_{name.upper()}": "0" for name in ALL_OPS if name != "utils"})
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    prebuilt = list((target / "deepspeed_c" / "_prebuilt" / "utils").glob("*/*.so"))
    assert len(prebuilt) == 1
    code = ("from deepspeed_c.ops.op_builder import UtilsBuilder\n"
            "m = UtilsBuilder().load(); print(m.__file__)\n")
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(target),
                         DSC_CACHE_DIR=str(cache)), cwd=tmp_path, stdout=subprocess.PIPE, text=True, check=True)
    assert out.stdout.strip() == str(prebuilt[0])
    assert not cache.exists()  # nothing was JIT-built

"""DSC_SANITIZE=1 (scripts/sanitize_tests.sh) adds the ASan/UBSan flags to every op's C compile and link
commands and so to its build key: a sanitized op is cached apart and never replaces the plain build; the
setup.py build of `_C` goes to build/sanitize, never in place. A bad value names the variable."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_c.ops.op_builder import ALL_OPS
from deepspeed_c.ops.op_builder import toolchain

ROOT = Path(__file__).resolve().parents[2]
FLAG = "-fsanitize=address,undefined"


def test_flags_reach_compile_link_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    op = ALL_OPS["cpu_adam"](simd="scalar")
    monkeypatch.delenv("DSC_SANITIZE", raising=False)
    plain_key = op.build_key()
    assert FLAG not in op.cxx_args() and FLAG not in op.link_command([tmp_path / "a.o"], tmp_path / "m.so")
    monkeypatch.setenv("DSC_SANITIZE", "1")
    assert FLAG in op.cxx_args() and "-fno-omit-frame-pointer" in op.cxx_args()
    assert op.link_command([tmp_path / "a.o"], tmp_path / "m.so")[-len(toolchain.SANITIZE_FLAGS):] == \
        toolchain.SANITIZE_FLAGS
    assert op.build_key() != plain_key


def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSC_SANITIZE", "yes")
    with pytest.raises(ValueError, match="DSC_SANITIZE must be 0 or 1, got 'yes'"):
        toolchain.sanitize_flags()


def test_setup_py_never_builds_the_sanitized_core_in_place() -> None:
    probe = ("import sys, setuptools; sys.argv = ['setup.py', 'build_ext', '--inplace']\n"
             "from setuptools.dist import Distribution\n"
             "import runpy; captured = {}\n"
             "setuptools.setup = lambda **kw: captured.update(kw)\n"
             "runpy.run_path('setup.py')\n"
             "cmd = captured['cmdclass']['build_ext'](Distribution({'ext_modules': captured['ext_modules']}))\n"
             "cmd.inplace = True; cmd.finalize_options()\n"
             "print(cmd.inplace, cmd.build_lib, captured['ext_modules'][0].extra_link_args)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={"DSC_SANITIZE": "1", "PATH": "/usr/bin:/bin"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    inplace, build_lib, link = out.stdout.split(" ", 2)
    assert inplace == "False" and build_lib == str(ROOT / "build" / "sanitize") and FLAG in link

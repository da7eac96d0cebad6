"""Importing deepspeed_c under a torch outside the supported range raises one ImportError naming the
range (before any C code runs); inside the range, or with DSC_ALLOW_ANY_TORCH=1, it imports. Each case
is a fresh interpreter whose `torch` is a stand-in package carrying only a version file, first on the
path, so the check is exercised exactly as a user's environment would trigger it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_c._torch_range import parse_version, supported_range

ROOT = Path(__file__).resolve().parents[2]


def _import_with_torch(tmp_path: Path, version: str, **env: str) -> subprocess.CompletedProcess:
    fake = tmp_path / f"torch-{version}"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise SystemExit('the stand-in torch was imported')\n")
    (fake / "torch" / "version.py").write_text(f"__version__ = '{version}'\ngit_version = 'x'\n")
    full_env = {k: v for k, v in os.environ.items() if k != "DSC_ALLOW_ANY_TORCH"}
    full_env.update(PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]), **env)
    code = "import deepspeed_c; print('imported', deepspeed_c.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)


@pytest.mark.parametrize("version", ["2.5.1+cu124", "1.13.1", "3.0.0"])
def test_outside_the_range_is_one_import_error_naming_it(tmp_path: Path, version: str) -> None:
    run = _import_with_torch(tmp_path, version)
    assert run.returncode == 1, (run.stdout, run.stderr)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: deepspeed_c supports torch >= 2.6, < 3.0"), run.stderr
    assert f"this environment has torch {version}" in last and "DSC_ALLOW_ANY_TORCH=1" in last
    assert "imported" not in run.stdout


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.11.0", "2.15.0a0+git1234"])
def test_inside_the_range_imports_without_importing_torch(tmp_path: Path, version: str) -> None:
    run = _import_with_torch(tmp_path, version)
    assert run.returncode == 0 and run.stdout.startswith("imported"), run.stderr


def test_override_lets_an_untested_torch_import(tmp_path: Path) -> None:
    run = _import_with_torch(tmp_path, "2.4.0", DSC_ALLOW_ANY_TORCH="1")
    assert run.returncode == 0 and run.stdout.startswith("imported"), run.stderr


def test_version_parsing_and_the_range_text() -> None:
    assert parse_version("2.6.0+cu124") == (2, 6)
    assert parse_version("2.12.0a0+gitabc") == (2, 12)
    with pytest.raises(ValueError, match="cannot read a torch version from 'nightly'"):
        parse_version("nightly")
    assert supported_range() == "torch >= 2.6, < 3.0"

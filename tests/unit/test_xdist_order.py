"""tests/xdist_order.py: `--dist loadfile` hands out the listed long files first, longest first, then the others
by number of tests (most first), each file's tests in their own order."""
from __future__ import annotations

import pathlib

from tests import xdist_order
from tests.xdist_order import longest_first


def test_long_files_first_then_by_test_count(monkeypatch):
    monkeypatch.setattr(xdist_order, "FILE_SECONDS", {"t/long.py": 50, "t/longer.py": 90})
    ids = ["t/a.py::x", "t/long.py::one", "t/b.py::x", "t/b.py::y", "t/longer.py::z", "t/long.py::two", "t/b.py::w"]
    assert longest_first(ids) == ["t/longer.py::z", "t/long.py::one", "t/long.py::two", "t/b.py::x", "t/b.py::y",
                                  "t/b.py::w", "t/a.py::x"]



def test_conftest_installs_the_hooks():
    import tests.conftest as conftest

    for name in ("pytest_collection_modifyitems", "pytest_configure_node", "pytest_xdist_make_scheduler"):
        assert getattr(conftest, name) is getattr(xdist_order, name), name


def test_loadfile_runs_each_file_once_on_one_worker_longest_first(tmp_path):
    """A real `pytest -n 2 --dist loadfile` over files of different test counts with this conftest: every module
    fixture is set up once (a file is never split between workers, nor its shared launch run twice), and the
    first two files handed out are the listed long one and the one of most tests."""
    import os
    import shutil
    import subprocess
    import sys

    tests = tmp_path / "tests"
    (tests / "distributed").mkdir(parents=True)
    shutil.copy(xdist_order.__file__, tests / "xdist_order.py")
    # the hooks as tests/conftest.py installs them (its other fixtures import torch: seconds per worker)
    (tests / "conftest.py").write_text("from tests.xdist_order import (pytest_collection_modifyitems, "
                                       "pytest_configure_node, pytest_xdist_make_scheduler)\n")
    (tests / "__init__.py").touch()
    (tests / "distributed" / "__init__.py").touch()
    log = tmp_path / "setups.txt"
    body = ("import os\nimport pytest\n\n\n@pytest.fixture(scope='module')\ndef launch(request):\n"
            f"    with open({str(log)!r}, 'a') as f:\n"
            "        f.write(f'{request.module.__name__} {os.getpid()}\\n')\n\n\n"
            "@pytest.mark.parametrize('k', range(N))\ndef test_k(launch, k):\n    pass\n")
    counts = {"test_zenflow": 1, "test_a": 2, "test_b": 5, "test_c": 3, "test_d": 4}  # zenflow: a listed long file
    for name, n in counts.items():
        (tests / "distributed" / f"{name}.py").write_text(body.replace("N", str(n)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # a session of its own (none of this worker's PYTEST_* variables), with xdist alone: its workers start sooner
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "tests"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    setups = [line.split() for line in log.read_text().splitlines()]
    assert sorted(m for m, _ in setups) == sorted(f"tests.distributed.{n}" for n in counts), setups
    firsts = {}  # each worker's first module: the first two files handed out
    for module, pid in setups:
        firsts.setdefault(pid, module)
    assert sorted(firsts.values()) == ["tests.distributed.test_b", "tests.distributed.test_zenflow"], setups

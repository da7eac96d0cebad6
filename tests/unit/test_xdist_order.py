"""tests/xdist_order.py: `--dist loadfile` hands out the listed long files first, longest first, then the others
by number of tests (most first), each file's tests in their own order."""
from __future__ import annotations

from tests import xdist_order
from tests.xdist_order import longest_first


def test_long_files_first_then_by_test_count(monkeypatch):
    monkeypatch.setattr(xdist_order, "FILE_SECONDS", {"t/long.py": 50, "t/longer.py": 90})
    ids = ["t/a.py::x", "t/long.py::one", "t/b.py::x", "t/b.py::y", "t/longer.py::z", "t/long.py::two", "t/b.py::w"]
    assert longest_first(ids) == ["t/longer.py::z", "t/long.py::one", "t/long.py::two", "t/b.py::x", "t/b.py::y",
                                  "t/b.py::w", "t/a.py::x"]


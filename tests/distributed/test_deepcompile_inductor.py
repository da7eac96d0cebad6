"""DeepCompile and compiled training through inductor (C++ code generation on CPU ranks) on 2 real gloo
ranks: the same runs and checks as test_deepcompile.py's "eager"-backend ones (the eager engine is the
reference; bf16 losses within BF16_ATOL over 20 steps), with inductor's fused kernels. A file of its own
so that, under `pytest -n 2 --dist loadfile`, its minutes of compilation run beside test_deepcompile.py
on the other worker instead of after it."""
from __future__ import annotations

import pathlib

import pytest

from tests.distributed.test_deepcompile import _check_graph_ops, _check_losses, _run


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh inductor cache directory for this module's runs (both ranks, both stages): kernels and graphs
    are compiled cold once, then loaded by whichever rank or stage needs them again. The graph-op checks
    count the ops as they run, so they hold for a graph served from a warm cache too (the passes do not
    run then: the cached graph carries their placement and prefetch arguments)."""
    root: pathlib.Path = tmp_path_factory.mktemp("inductor")
    return {"TORCHINDUCTOR_CACHE_DIR": str(root)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_inductor_bf16(stage: int, kernel_cache: dict[str, str]) -> None:
    res = _run("gpt", stage, bf16=True, backend="inductor", timeout=1500, env=kernel_cache)
    _check_losses(res, bf16=True, fused=True)
    if stage == 3:
        _check_graph_ops(res)

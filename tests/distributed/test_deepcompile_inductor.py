"""DeepCompile and compiled training through inductor (C++ code generation on CPU ranks) on 2 real gloo
ranks, for the GPT and Hugging Face's LLaMA: the same runs and checks as test_deepcompile.py's
"eager"-backend ones (the eager engine is the reference; bf16 losses within BF16_ATOL over 20 steps), with
inductor's fused kernels. A file of its own so that, under `pytest -n 2 --dist loadfile`, its minutes of
compilation run beside test_deepcompile.py on the other worker instead of after it. Every case runs in one
launch (test_deepcompile.run_cases): a model's ZeRO-1 case compiles first, and its ZeRO-3 one finds the
kernels they share in inductor's caches."""
from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.distributed.test_deepcompile import Case, case_results, check_graph_ops, check_losses, run_cases

# the GPT and Hugging Face's LLaMA (gradient checkpointing, accumulation 2), as test_deepcompile.py's "eager"
# backend runs them, here through inductor's generated kernels
CASES = {**{f"inductor_z{s}": Case("gpt", s, True) for s in (1, 3)},
         **{f"inductor_llama_z{s}": Case("llama", s, True) for s in (1, 3)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """One launch for both stages, with a fresh inductor cache directory (shared by both ranks and both
    stages): kernels and graphs are compiled cold once, then loaded by whichever rank or stage needs them
    again. The graph-op checks count the ops as they run, so they hold for a graph served from a warm cache
    too (the passes do not run then: the cached graph carries their placement and prefetch arguments)."""
    root: pathlib.Path = tmp_path_factory.mktemp("inductor")
    return run_cases(CASES, str(root / "ckpt"), backend="inductor", timeout=1500,
                     env={"TORCHINDUCTOR_CACHE_DIR": str(root / "cache")})


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_inductor_bf16(runs: dict, model: str, stage: int) -> None:
    res = case_results(runs, f"inductor_{'llama_' if model == 'llama' else ''}z{stage}")
    check_losses(res, bf16=True, fused=True)
    if stage == 3:
        check_graph_ops(res)

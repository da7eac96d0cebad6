"""benchmarks/train_throughput.py --max_micro: the doubling search over a fake try (no GPU, no ranks).

The try raises torch.OutOfMemoryError above a limit, as a device that fills up does; `agree` stands
for the all-reduce of the ranks' flags (an OOM on another rank is a False with this rank's try fine)."""
from __future__ import annotations

import os
import sys
import weakref

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

from train_throughput import is_oom, search_max_micro  # noqa: E402


class _Held:
    """Stands for the activations a try holds when it runs out of memory."""


def _trial(limit: int, log: list[int]):
    def trial(micro: int) -> dict:
        log.append(micro)
        if micro > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory: micro {micro}")
        return {"micro": micro}
    return trial


def test_doubles_until_the_first_oom() -> None:
    tried: list[int] = []
    frees: list[int] = []
    fits, first_oom = search_max_micro(_trial(12, tried), lambda ok: ok, 1, 64, lambda: frees.append(1))
    assert [f["micro"] for f in fits] == [1, 2, 4, 8]
    assert first_oom == 16
    assert tried == [1, 2, 4, 8, 16]
    assert len(frees) == 5  # memory freed after every try, the failed one included


def test_cap_stops_without_an_oom_and_start_is_kept() -> None:
    tried: list[int] = []
    fits, first_oom = search_max_micro(_trial(10**6, tried), lambda ok: ok, 3, 24)
    assert [f["micro"] for f in fits] == [3, 6, 12, 24]
    assert first_oom is None


def test_oom_at_the_start_fits_nothing() -> None:
    fits, first_oom = search_max_micro(_trial(0, []), lambda ok: ok, 2, 64)
    assert fits == [] and first_oom == 2


def test_another_ranks_oom_stops_the_search() -> None:
    # this rank's try at 8 succeeded, another rank's did not: the all-reduced flag says no
    seen: list[bool] = []

    def agree(ok: bool) -> bool:
        seen.append(ok)
        return ok and len(seen) < 4

    fits, first_oom = search_max_micro(_trial(10**6, []), agree, 1, 64)
    assert [f["micro"] for f in fits] == [1, 2, 4]
    assert first_oom == 8 and seen == [True, True, True, True]


def test_failed_try_is_released_before_free() -> None:
    refs: list[weakref.ref] = []
    alive_at_free: list[bool] = []

    def trial(micro: int) -> dict:
        held = _Held()
        refs.append(weakref.ref(held))
        if micro >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"micro": micro}

    fits, _ = search_max_micro(trial, lambda ok: ok, 1, 64,
                               lambda: alive_at_free.append(refs[-1]() is not None))
    assert len(fits) == 2
    assert alive_at_free == [False, False, False]  # the failed try's frame is gone when free() runs


def test_other_errors_propagate() -> None:
    def trial(micro: int) -> dict:
        if micro == 2:
            raise ValueError("losses disagree")
        return {"micro": micro}

    with pytest.raises(ValueError, match="losses disagree"):
        search_max_micro(trial, lambda ok: ok, 1, 64)


def test_is_oom_and_bad_bounds() -> None:
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("NCCL error"))
    assert not is_oom(ValueError("out of memory"))
    with pytest.raises(ValueError, match="max_micro_cap"):
        search_max_micro(lambda m: {}, lambda ok: ok, 8, 4)
    with pytest.raises(ValueError, match="micro"):
        search_max_micro(lambda m: {}, lambda ok: ok, 0, 4)

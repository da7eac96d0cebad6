"""The numpy Philox reference behind the GPU dropout masks (ops/transformer/philox_reference.py): the Random123
known-answer vectors of Philox4x32-10, keep fractions within binomial bounds, distinct offsets and seeds giving
independent masks, and the probability checks."""
from __future__ import annotations

import numpy as np
import pytest

from deepspeed_c.ops.transformer.philox_reference import _philox4x32_10, dropout_keep, keep_threshold


def _words(c: int, k: int) -> list[int]:
    return [int(w[0]) for w in _philox4x32_10([np.array([c], dtype=np.uint64)] * 4, k, k)]


def test_known_answer_vectors():
    # Random123's published answers for Philox4x32-10 (all-zero and all-ones counter and key)
    assert _words(0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert _words(0xFFFFFFFF, 0xFFFFFFFF) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_keep_fraction_and_independence(p):
    n = 1 << 18
    a = dropout_keep(n, keep_threshold(p), 1234, 0)
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(a.mean() - (1 - p)) < 6 * sigma
    for other in (dropout_keep(n, keep_threshold(p), 1234, 4), dropout_keep(n, keep_threshold(p), 1235, 0)):
        both = (a & other).mean()  # independent masks: P(both kept) = (1 - p)^2
        assert abs(both - (1 - p) ** 2) < 6 * sigma
    assert np.array_equal(dropout_keep(1000, keep_threshold(p), 1234, 0), a[:1000])  # a prefix of the same stream


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5])
def test_probability_out_of_range_is_refused(p):
    with pytest.raises(ValueError, match="dropout probability"):
        keep_threshold(p)

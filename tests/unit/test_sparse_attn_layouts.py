"""Every SparsityConfig's make_layout equals DeepSpeed 0.19.6's, for every option at seq 128-16384
(digests pinned in tests/fixtures/sparse_attn/layouts_ds0196.json by make_fixture.py, which ran
DeepSpeed's own sparsity_config.py; random blocks use the same random.seed on both sides), and
bad options fail naming the argument."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_c.ops import sparse_attention as sa

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sparse_attn"


def test_layouts_match_deepspeed_0_19_6():
    sys.path.insert(0, str(FIXTURES))
    try:
        from cases import run
    finally:
        sys.path.remove(str(FIXTURES))
    pinned = json.loads((FIXTURES / "layouts_ds0196.json").read_text())
    ours = run(sa.sparsity_config)
    assert ours.keys() == pinned.keys()
    wrong = {k: (ours[k], pinned[k]) for k in pinned if ours[k] != pinned[k]}
    assert not wrong, wrong
    assert sum("digest" in v for v in pinned.values()) >= 70  # most cases build a layout


def test_layout_definitions():
    """A few layouts written out by their documented definitions."""
    fixed = sa.FixedSparsityConfig(num_heads=1, block=16, num_local_blocks=2, num_global_blocks=1).make_layout(96)
    expect = torch.zeros(6, 6, dtype=torch.int64)
    for w in range(0, 6, 2):
        expect[w:w + 2, w:w + 2] = 1  # local windows
        expect[:, w + 1] = 1  # the last block of each window is global (vertical, bidirectional)
    assert torch.equal(fixed[0], expect)
    local = sa.LocalSlidingWindowSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=3).make_layout(80)
    assert torch.equal(local[1], torch.tril(torch.ones(5, 5, dtype=torch.int64)) - torch.tril(torch.ones(
        5, 5, dtype=torch.int64), -2))
    dense = sa.DenseSparsityConfig(num_heads=3, block=32).make_layout(64)
    assert dense.shape == (3, 2, 2) and bool(dense.all())


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="pad_to_block_size"):
        sa.FixedSparsityConfig(num_heads=1, block=16).make_layout(100)
    with pytest.raises(ValueError, match="num_global_blocks.*num_local_blocks"):
        sa.FixedSparsityConfig(num_heads=1, num_local_blocks=2, num_global_blocks=4)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        sa.FixedSparsityConfig(num_heads=2, num_different_global_patterns=2)
    with pytest.raises(NotImplementedError, match="attention"):
        sa.BigBirdSparsityConfig(num_heads=1, attention="sideways")
    with pytest.raises(ValueError, match="global_block_end_indices"):
        sa.BSLongformerSparsityConfig(num_heads=1, global_block_indices=[0, 3], global_block_end_indices=[2])
    with pytest.raises(ValueError, match="num_heads"):
        sa.DenseSparsityConfig(num_heads=0)

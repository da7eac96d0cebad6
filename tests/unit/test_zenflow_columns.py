"""ZenFlow's C column gather/scatter (csrc/cpu/columns.c) against the torch-indexing reference, on every
SIMD path this CPU runs, over partitions that cut matrices mid-row (also single partial rows and column
counts that leave SIMD tails); bad segment tables raise naming the argument."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops.op_builder import toolchain
from deepspeed_c.ops.op_builder.builder import SIMD_LEVELS
from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.zenflow.columns import ColumnLayout, gather, gather_reference, scatter, scatter_reference

RUNNABLE = [s for s in SIMD_LEVELS if not toolchain.missing_isa(s)]
SHAPES = [(7, 37), (33, 16), (5, 3), (64, 129), (1, 50)]


def _layout(world: int, rank: int, ratio: float, seed: int) -> tuple[ColumnLayout, int]:
    gen = torch.Generator().manual_seed(seed)
    plan = PartitionPlan.build([r * c for r, c in SHAPES], world, 1000, 2, list(range(len(SHAPES))))
    cols = [c for _, c in SHAPES]
    sel = [torch.randperm(c, generator=gen)[:max(1, int(ratio * c))] for c in cols]
    sel[1] = None  # a parameter left whole
    slices = [(p, pstart, lstart, length) for p, _, pstart, lstart, length, _ in plan.slices("runtime", rank)]
    return ColumnLayout.build(slices, cols, sel), plan.partition_size("runtime")


@pytest.mark.parametrize("simd", RUNNABLE)
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1), (4, 3)])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 1.0])
def test_gather_scatter_match_reference(simd, world, rank, ratio):
    layout, size = _layout(world, rank, ratio, seed=world * 10 + rank)
    part = torch.randn(size)
    n = layout.count()
    assert n == layout.positions().numel()
    assert torch.equal(gather(part, layout, simd=simd), gather_reference(part, layout))
    vals = torch.randn(n)
    a, b = part.clone(), part.clone()
    scatter(a, layout, vals, simd=simd)
    scatter_reference(b, layout, vals)
    assert torch.equal(a, b)
    assert not torch.equal(a, part) or n == 0


def test_positions_pick_whole_columns():
    """One rank holding a whole 4 x 6 matrix: the selected columns' elements, row by row."""
    layout = ColumnLayout.build([(0, 0, 0, 24)], [6], [torch.tensor([4, 1])])
    m = torch.arange(24.0)
    assert gather_reference(m, layout).tolist() == m.view(4, 6)[:, [1, 4]].reshape(-1).tolist()
    assert gather(m, layout).tolist() == m.view(4, 6)[:, [1, 4]].reshape(-1).tolist()


def test_bad_tables_name_the_argument():
    part = torch.zeros(24)
    bad_order = ColumnLayout(torch.tensor([[0, 24, 0, 6, 0, 2]]), torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="'idx'.*ascending"):
        gather(part, bad_order, out=torch.zeros(8))
    too_long = ColumnLayout(torch.tensor([[10, 24, 0, 6, 0, 1]]), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="'segments' row 0 is out of range"):
        gather(part, too_long, out=torch.zeros(4))
    ok = ColumnLayout(torch.tensor([[0, 24, 0, 6, 0, 1]]), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="'out' has 3 elements"):
        gather(part, ok, out=torch.zeros(3))
    with pytest.raises(TypeError, match="part"):
        gather(part.double(), ok)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_every_path_compiles_without_warnings(simd, tmp_path):
    from deepspeed_c.ops.op_builder import ZenFlowColumnsBuilder

    ZenFlowColumnsBuilder(simd=simd).build_into(tmp_path)
    log = (tmp_path / "build.log").read_text()
    assert "warning:" not in log, log

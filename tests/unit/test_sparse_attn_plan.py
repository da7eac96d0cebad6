"""The balanced grid of the block-sparse kernels (work_plan.py) on CPU: every layout block is walked by
exactly one CTA item, long rows split, items longest first; and a host emulation of the kernels' split
path (per item: the partial over its block range written to the scratch slots laid out as the kernels
lay them out; then the combine kernels' merge) against an independent float64 autograd reference."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops import sparse_attention as sa
from deepspeed_c.ops.sparse_attention.kernel import BlockTables
from deepspeed_c.ops.sparse_attention.reference import dense_sparse_attention
from deepspeed_c.ops.sparse_attention.work_plan import BALANCE_ENV, WorkPlan, balance_enabled


def _layout(H: int, L: int, block: int) -> torch.Tensor:
    cfg = sa.BigBirdSparsityConfig(num_heads=H, block=block, different_layout_per_head=True, num_random_blocks=1,
                                   num_sliding_window_blocks=3, num_global_blocks=1)
    return cfg.make_layout(L)


def _check_cover(plan: WorkPlan, ptr: torch.Tensor, factor: float) -> None:
    ptr = ptr.long()
    counts = (ptr[1:] - ptr[:-1]).tolist()
    mean = sum(counts) / len(counts)
    items = plan.items.long()
    lengths = (items[:, 2] - items[:, 1]).tolist()
    assert lengths == sorted(lengths, reverse=True)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for row, lo, hi, slot in items.tolist():
        seen.setdefault(row, []).append((lo, hi, slot))
    assert sorted(seen) == list(range(len(counts)))
    merges = {m[0]: m for m in plan.merges.tolist()}
    for row, parts in seen.items():
        parts.sort()
        assert parts[0][0] == ptr[row] and parts[-1][1] == ptr[row + 1]
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no overlap
        if len(parts) == 1:
            assert parts[0][2] == -1 and row not in merges
        else:
            assert counts[row] > factor * mean
            _, first, n, _ = merges[row]
            assert n == len(parts) and [p[2] for p in parts] == list(range(first, first + n))
    assert plan.slots == sum(m[2] for m in merges.values())


def test_plan_covers_every_block_once_and_splits_long_rows():
    layout = _layout(3, 1024, 16)  # 64 block rows: the global row / column is ~10x the mean
    tables = BlockTables.from_layout(layout, torch.device("cpu"), balance=True)
    for plan, ptr in ((tables.row_plan, tables.row_ptr), (tables.col_plan, tables.col_ptr)):
        _check_cover(plan, ptr, 2.0)
        assert plan.merges.shape[0] >= 3  # each head's global row (column) split
    fine = BlockTables.from_layout(layout, torch.device("cpu"), balance=True, factor=0.5, part=2)
    _check_cover(fine.row_plan, fine.row_ptr, 0.5)
    assert BlockTables.from_layout(layout, torch.device("cpu"), balance=False).row_plan is None
    with pytest.raises(ValueError, match="factor"):
        WorkPlan.build(tables.row_ptr, factor=0)
    with pytest.raises(ValueError, match="part"):
        WorkPlan.build(tables.row_ptr, part=0)


def test_balance_switch(monkeypatch):
    monkeypatch.delenv(BALANCE_ENV, raising=False)
    assert balance_enabled()  # on by default
    assert BlockTables.from_layout(_layout(1, 256, 16), torch.device("cpu")).row_plan is not None
    monkeypatch.setenv(BALANCE_ENV, "0")
    assert not balance_enabled()
    assert BlockTables.from_layout(_layout(1, 256, 16), torch.device("cpu")).row_plan is None
    monkeypatch.setenv(BALANCE_ENV, "1")
    assert balance_enabled()
    monkeypatch.setenv(BALANCE_ENV, "yes")
    with pytest.raises(ValueError, match=BALANCE_ENV):
        balance_enabled()


def _blocks(idx: torch.Tensor, lo: int, hi: int, block: int) -> torch.Tensor:
    return torch.cat([torch.arange(c * block, (c + 1) * block) for c in idx[lo:hi].tolist()])


def _emulate(q, k, v, go, am, tables: BlockTables, block: int):
    """The kernels' work, item by item (both plans; all batches at once), in float64, the scratch laid
    out as the kernels lay it out: [B, slots, block, D] (the forward's lse parts [B, slots, block])."""
    B, H, L, D = q.shape
    nb, scale = L // block, D ** -0.5
    o, lse = torch.zeros_like(q), torch.full((B, H, L), float("inf"), dtype=q.dtype)
    rp, cp = tables.row_plan, tables.col_plan

    def scores(h, qi, kj):
        return q[:, h, qi] @ k[:, h, kj].transpose(1, 2) * scale + am[qi][:, kj]

    po, pl = torch.zeros(B, rp.slots, block, D, dtype=q.dtype), torch.zeros(B, rp.slots, block, dtype=q.dtype)
    for row, lo, hi, slot in rp.items.tolist():
        h, rb = divmod(row, nb)
        qi, kj = torch.arange(rb * block, (rb + 1) * block), _blocks(tables.cols, lo, hi, block)
        s = scores(h, qi, kj)
        m = s.max(-1, keepdim=True).values
        p = torch.where(torch.isinf(m), 0.0, torch.exp(s - m))
        ls = p.sum(-1, keepdim=True)
        out = p @ v[:, h, kj] / ls.clamp_min(1e-300)
        ls_e = torch.where(ls > 0, m + torch.log(ls), float("inf"))[..., 0]
        if slot < 0:
            o[:, h, qi], lse[:, h, qi] = out, ls_e
        else:
            po[:, slot], pl[:, slot] = out, ls_e
    for row, first, parts, _ in rp.merges.tolist():  # sa_forward_combine_kernel
        h, rb = divmod(row, nb)
        x = pl[:, first:first + parts]
        mx = torch.where(torch.isinf(x), float("-inf"), x).max(1, keepdim=True).values
        w = torch.where(torch.isinf(x), 0.0, torch.exp(x - mx))
        tot = w.sum(1)
        o[:, h, rb * block:(rb + 1) * block] = (w[..., None] * po[:, first:first + parts]).sum(1) / tot[..., None]
        lse[:, h, rb * block:(rb + 1) * block] = mx[:, 0] + torch.log(tot)

    delta = (go * o).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def grads(h, qi, kj):
        p = torch.exp(scores(h, qi, kj) - lse[:, h, qi][..., None])
        return p, p * (go[:, h, qi] @ v[:, h, kj].transpose(1, 2) - delta[:, h, qi][..., None])

    part = torch.zeros(B, max(rp.slots, 2 * cp.slots), block, D, dtype=q.dtype)
    for row, lo, hi, slot in rp.items.tolist():  # dQ
        h, rb = divmod(row, nb)
        qi, kj = torch.arange(rb * block, (rb + 1) * block), _blocks(tables.cols, lo, hi, block)
        g = scale * grads(h, qi, kj)[1] @ k[:, h, kj]
        if slot < 0:
            dq[:, h, qi] = g
        else:
            part[:, slot] = g
    for row, first, parts, _ in rp.merges.tolist():
        h, rb = divmod(row, nb)
        dq[:, h, rb * block:(rb + 1) * block] = part[:, first:first + parts].sum(1)
    part.zero_()
    pk, pv = part[:, :cp.slots], part[:, cp.slots:2 * cp.slots]  # dK parts, then dV parts
    for row, lo, hi, slot in cp.items.tolist():  # dK / dV
        h, cb = divmod(row, nb)
        kj, qi = torch.arange(cb * block, (cb + 1) * block), _blocks(tables.rows, lo, hi, block)
        p, ds = grads(h, qi, kj)
        gk, gv = scale * ds.transpose(1, 2) @ q[:, h, qi], p.transpose(1, 2) @ go[:, h, qi]
        if slot < 0:
            dk[:, h, kj], dv[:, h, kj] = gk, gv
        else:
            pk[:, slot], pv[:, slot] = gk, gv
    for row, first, parts, _ in cp.merges.tolist():
        h, cb = divmod(row, nb)
        dk[:, h, cb * block:(cb + 1) * block] = pk[:, first:first + parts].sum(1)
        dv[:, h, cb * block:(cb + 1) * block] = pv[:, first:first + parts].sum(1)
    return o, dq, dk, dv


def test_split_path_emulation_matches_float64_autograd():
    torch.manual_seed(0)
    B, H, L, D, block = 2, 2, 128, 8, 16
    layout = _layout(H, L, block)
    tables = BlockTables.from_layout(layout, torch.device("cpu"), balance=True, factor=0.5, part=2)
    assert tables.row_plan.merges.shape[0] > H and tables.col_plan.merges.shape[0] > H
    q, k, v, go = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(4))
    am = torch.zeros(L, L, dtype=torch.float64)
    am[:, 3 * block:5 * block] = float("-inf")  # some parts see no key at all: lse +inf, weight 0
    o, dq, dk, dv = _emulate(q, k, v, go, am, tables, block)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = dense_sparse_attention(qr, kr, vr, layout, block, D ** -0.5, am=am)
    ref.backward(go)
    for got, want in ((o, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-9)

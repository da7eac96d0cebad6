"""SparseSelfAttention on CPU (the dense masked path) against an independent float64 reference:
per query block row, the softmax over exactly the keys of that row's layout blocks, with
key-padding / attention masks in both modes and rpe; outputs and q/k/v gradients, every config
family, odd head counts, batch 1. Plus bad input and the `sparse_attention` config section."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.ops import sparse_attention as sa
from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError


def row_block_reference(q, k, v, layout, block, kpm=None, am=None, rpe=None):
    """float64, one layout block row at a time: gather the row's keys, softmax, weight the values.
    kpm [B, L] / am [L, L] / rpe [B|1, H|1, L, L] additive."""
    B, H, L, D = q.shape
    rows_out = []
    for b in range(B):
        heads = []
        for h in range(H):
            parts = []
            for rb in range(L // block):
                rows = torch.arange(rb * block, (rb + 1) * block)
                keys = torch.cat([torch.arange(c * block, (c + 1) * block) for c in layout[h, rb].nonzero()[:, 0]])
                s = q[b, h, rows] @ k[b, h, keys].T * D ** -0.5
                if rpe is not None:
                    s = s + rpe[min(b, rpe.shape[0] - 1), min(h, rpe.shape[1] - 1)][rows][:, keys]
                if kpm is not None:
                    s = s + kpm[b, keys]
                if am is not None:
                    s = s + am[rows][:, keys]
                parts.append(torch.softmax(s, dim=-1) @ v[b, h, keys])
            heads.append(torch.cat(parts))
        rows_out.append(torch.stack(heads))
    return torch.stack(rows_out)


CONFIGS = {
    "dense": lambda H: sa.DenseSparsityConfig(num_heads=H, block=16),
    "fixed": lambda H: sa.FixedSparsityConfig(num_heads=H, block=16, num_local_blocks=2,
                                              horizontal_global_attention=True),
    "fixed_uni_per_head": lambda H: sa.FixedSparsityConfig(num_heads=H, block=16, different_layout_per_head=True,
                                                           num_local_blocks=4, num_global_blocks=2,
                                                           num_different_global_patterns=2,
                                                           attention="unidirectional"),
    "variable": lambda H: sa.VariableSparsityConfig(num_heads=H, block=16, num_random_blocks=1,
                                                    local_window_blocks=[1, 2], global_block_indices=[3]),
    "bigbird": lambda H: sa.BigBirdSparsityConfig(num_heads=H, block=16, different_layout_per_head=True),
    "bslongformer": lambda H: sa.BSLongformerSparsityConfig(num_heads=H, block=16, global_block_indices=[1]),
    "local_window": lambda H: sa.LocalSlidingWindowSparsityConfig(num_heads=H, block=16),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_float64_reference(name):
    torch.manual_seed(1)
    B, H, L, D = (1, 3, 64, 8) if name in ("fixed", "bigbird") else (2, 3, 64, 8)
    cfg = CONFIGS[name](H)
    mod = sa.SparseSelfAttention(cfg, key_padding_mask_mode="mul", attn_mask_mode="add", max_seq_length=128)
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.ones(B, L, dtype=torch.float64)
    kpm[0, 50:] = 0  # 'mul': padded keys of sequence 0
    am = 0.3 * torch.randn(L, L, dtype=torch.float64)
    rpe = 0.2 * torch.randn(1, H, L, L, dtype=torch.float64)
    out = mod(q, k, v, rpe=rpe, key_padding_mask=kpm.view(B, 1, 1, L), attn_mask=am)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), go)
    kpm_add = torch.zeros_like(kpm).masked_fill(kpm == 0, float("-inf"))
    ref = row_block_reference(q, k, v, mod.get_layout(L), cfg.block, kpm_add, am, rpe)
    want = torch.autograd.grad(ref, (q, k, v), go)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_float32_key_transposed_and_mask_modes_agree():
    torch.manual_seed(2)
    cfg = sa.BigBirdSparsityConfig(num_heads=2, block=16)
    add = sa.SparseSelfAttention(cfg, key_padding_mask_mode="add", attn_mask_mode="add", max_seq_length=64)
    mul = sa.SparseSelfAttention(cfg, key_padding_mask_mode="mul", attn_mask_mode="mul", max_seq_length=64)
    mul.master_layout.copy_(add.master_layout)  # one random layout for both
    q, k, v = (torch.randn(2, 2, 64, 16) for _ in range(3))
    keep = torch.rand(2, 64) > 0.2
    keep[:, 0] = True
    allow = torch.rand(64, 64) > 0.3
    allow.fill_diagonal_(True)
    out_mul = mul(q, k.transpose(-1, -2), v, key_padding_mask=keep.float(), attn_mask=allow.float())
    neg = torch.tensor(float("-inf"))
    out_add = add(q, k, v, key_padding_mask=torch.where(keep, 0.0, neg), attn_mask=torch.where(allow, 0.0, neg))
    torch.testing.assert_close(out_mul, out_add)
    ref = row_block_reference(q.double(), k.double(), v.double(), add.get_layout(64), 16,
                              torch.where(keep, 0.0, neg).double(), torch.where(allow, 0.0, neg).double())
    torch.testing.assert_close(out_add.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_argument():
    mod = sa.SparseSelfAttention(sa.FixedSparsityConfig(num_heads=2, block=16), max_seq_length=64)
    x = torch.randn(1, 2, 48, 8)
    with pytest.raises(ValueError, match="pad_to_block_size"):
        mod(x[:, :, :40], x[:, :, :40], x[:, :, :40])
    with pytest.raises(ValueError, match="num_heads"):
        y = torch.randn(1, 3, 48, 8)
        mod(y, y, y)
    with pytest.raises(TypeError, match="query"):
        z = torch.zeros(1, 2, 48, 8, dtype=torch.int32)
        mod(z, z, z)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mod(x, x, x, key_padding_mask=torch.zeros(1, 47))
    with pytest.raises(ValueError, match="max_seq_length"):
        w = torch.randn(1, 2, 80, 8)
        mod(w, w, w)
    with pytest.raises(ValueError, match="attn_mask_mode"):
        sa.SparseSelfAttention(sa.DenseSparsityConfig(num_heads=1), attn_mask_mode="or")


def test_config_section_parses_like_deepspeed_0_19_6():
    base = {"train_batch_size": 1}
    assert DeepSpeedConfig(base).sparse_attention is None
    c = DeepSpeedConfig({**base, "sparse_attention": {"mode": "bslongformer", "block": 32,
                                                      "global_block_indices": [0, 4]}})
    assert c.sparse_attention == {"mode": "bslongformer", "block": 32, "different_layout_per_head": False,
                                  "num_sliding_window_blocks": 3, "global_block_indices": [0, 4],
                                  "global_block_end_indices": None}
    assert DeepSpeedConfig({**base, "sparse_attention": {}}).sparse_attention["mode"] == "fixed"
    cfg = sa.sparsity_config_from_dict(c.sparse_attention, num_heads=4)
    assert isinstance(cfg, sa.BSLongformerSparsityConfig) and cfg.block == 32 and cfg.num_heads == 4
    with pytest.raises(DeepSpeedConfigError, match="'sparse_attention.num_local_block'.*num_local_blocks"):
        DeepSpeedConfig({**base, "sparse_attention": {"num_local_block": 4}})
    with pytest.raises(DeepSpeedConfigError, match="sparse_attention.block"):
        DeepSpeedConfig({**base, "sparse_attention": {"block": "16"}})
    with pytest.raises(NotImplementedError, match="sparse_attention.mode"):
        DeepSpeedConfig({**base, "sparse_attention": {"mode": "strided"}})


def test_matmul_and_softmax_building_blocks():
    """The tutorial's MatMul (sdd, dsd, dds, with transposes) and Softmax compose to the same
    attention, and each product equals its dense form over the layout's blocks."""
    torch.manual_seed(3)
    H, L, D, blk, B = 3, 64, 8, 16, 2
    lay = sa.BigBirdSparsityConfig(num_heads=H, block=blk, different_layout_per_head=True).make_layout(L)
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(B, L, dtype=torch.float64)
    kpm[1, 50:] = -1e4
    am = torch.randn(L, L, dtype=torch.float64)
    scores = sa.MatMul(lay, blk, "sdd", trans_a=False, trans_b=True)(q, k)
    probs = sa.Softmax(lay, blk)(scores, scale=D ** -0.5, key_padding_mask=kpm, attn_mask=am)
    out = sa.MatMul(lay, blk, "dsd")(probs, v)
    ref = row_block_reference(q, k, v, lay, blk, kpm, am)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    go = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    # the sparse operand scattered to its dense [B, H, L, L] form
    p = probs.detach()
    dense_p = torch.zeros(B, H, L, L, dtype=torch.float64)
    for n, (h, r, c) in enumerate(lay.nonzero().tolist()):
        dense_p[:, h, r * blk:(r + 1) * blk, c * blk:(c + 1) * blk] = p[:, n]
    a = torch.randn(B, H, D, L, dtype=torch.float64)
    cases = [(sa.MatMul(lay, blk, "dds")(a, p), a @ dense_p),
             (sa.MatMul(lay, blk, "dds", trans_b=True)(a, p), a @ dense_p.transpose(-1, -2)),
             (sa.MatMul(lay, blk, "dds", trans_a=True)(a.transpose(-1, -2), p), a @ dense_p),
             (sa.MatMul(lay, blk, "dsd", trans_a=True)(p, v.detach()), dense_p.transpose(-1, -2) @ v.detach())]
    for got, want in cases:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="mode"):
        sa.MatMul(lay, blk, "ssd")

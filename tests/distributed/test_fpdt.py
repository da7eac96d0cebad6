"""FPDT (deepspeed_c.sequence.fpdt_layer) on real gloo ranks against a single-process float64 reference.

The reference is Megatron attention on the whole sequence: QKV projection, rotary embedding, causal GQA
softmax attention, output projection; the FFN is x @ w1^T + b1 -> tanh-GeLU -> @ w2^T + b2; the loss is
per-token cross entropy of the LM head with -100 ignored. Each rank feeds FPDT its slice in FPDT's layout
(FPDT_InputConstruct's token order) and compares its rows of the output and of the input gradient, and the
all-reduced (summed over ranks) weight gradients, with the reference's, at fp32 (1e-5). The unchunked
Ulysses layer (DistributedAttention on contiguous slices) runs on the same data and matches too, and FPDT
with one chunk, whose layout is the contiguous one, equals it directly.

One 2-rank launch covers attention with offload off and on (4 chunks, GQA), the Ulysses layer, the FFN, the
logits loss, the chunk store's residency and the bad inputs; one 4-rank launch covers the same parities
(attention with 2 chunks, offload on and off, against the reference and the Ulysses layer, FFN, loss).
Under DSC_TEST_BACKEND=nccl the ranks work on their GPUs (fp32: FPDT's exact math path with the CUDA offload streams and pinned buffers)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.harness import rank_device, run_distributed

B, HD, HIDDEN, VOCAB = 2, 8, 32, 24


def _weights(heads: int, kv_heads: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rows = HD * (heads + 2 * kv_heads)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pos = torch.arange(seq, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)[:, None, None, :]  # [S, 1, 1, HD]
    return {"x": r(seq, B, HIDDEN), "wqkv": r(rows, HIDDEN) * 0.2, "bqkv": r(rows) * 0.1,
            "wo": r(HIDDEN, heads * HD) * 0.2, "bo": r(HIDDEN), "gout": r(seq, B, HIDDEN),
            "cos": ang.cos(), "sin": ang.sin(), "w1": r(4 * HIDDEN, HIDDEN) * 0.2, "b1": r(4 * HIDDEN) * 0.1,
            "w2": r(HIDDEN, 4 * HIDDEN) * 0.2, "b2": r(HIDDEN) * 0.1, "head": r(VOCAB, HIDDEN) * 0.3,
            "labels": torch.randint(0, VOCAB, (B, seq), generator=g)}


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-b, a), dim=-1) * sin


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[b, s, h, d] causal attention, kv heads repeated per group."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.transpose(1, 2)).transpose(1, 2)


def _qkv(w: dict, x: torch.Tensor, heads: int, kv_heads: int) -> tuple:
    qkv = x @ w["wqkv"].t() + w["bqkv"]
    p, kv = heads * HD, kv_heads * HD
    split = lambda t: t.reshape(t.shape[0], t.shape[1], -1, HD).permute(1, 0, 2, 3)  # noqa: E731
    return split(qkv[..., :p]), split(qkv[..., p:p + kv]), split(qkv[..., p + kv:])


def _reference_attention(w: dict, heads: int, kv_heads: int) -> dict:
    leaves = {k: w[k].clone().requires_grad_() for k in ("x", "wqkv", "bqkv", "wo")}
    lw = dict(w, **leaves)
    q, k, v = _qkv(lw, leaves["x"], heads, kv_heads)
    cos, sin = w["cos"].permute(1, 0, 2, 3), w["sin"].permute(1, 0, 2, 3)
    o = _dense_attention(_rope(q, cos, sin), _rope(k, cos, sin), v)
    out = o.flatten(2).permute(1, 0, 2) @ leaves["wo"].t()
    (out * w["gout"]).sum().backward()
    return {"out": out.detach(), **{f"g{k}": t.grad for k, t in leaves.items()}}


def _config(heads: int, kv_heads: int) -> SimpleNamespace:
    return SimpleNamespace(kv_channels=HD, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           hidden_size=HIDDEN, attention_dropout=0.0)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    from deepspeed_c import comm as dist

    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def _fpdt_attention(w: dict, ref: dict, heads: int, kv_heads: int, chunk: int, offload: bool, group) -> dict:
    from deepspeed_c import comm as dist
    from deepspeed_c.sequence.fpdt_layer import FPDT_Attention, token_order

    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = w["x"].shape[0]
    mine = token_order(seq, chunk, sp).view(sp, -1)[rank]
    f32 = {k: w[k].float().clone().requires_grad_() for k in ("wqkv", "bqkv", "wo")}
    x = w["x"][mine].float().clone().requires_grad_()
    attn = FPDT_Attention(_config(heads, kv_heads), f32["wqkv"], f32["bqkv"], f32["wo"], w["bo"].float(), group,
                          chunk_size=chunk, enable_offloading=True)
    out, bias = attn(x, None, None, (w["cos"].float(), w["sin"].float()), cpu_offloading=offload)
    assert bias is attn.qkv_dense_bias and attn.num_chunks_attn == seq // chunk
    (out * w["gout"][mine].float()).sum().backward()
    errs = {"out": _err(out, ref["out"][mine]), "gx": _err(x.grad, ref["gx"][mine])}
    for k in ("wqkv", "bqkv", "wo"):
        errs[f"g{k}"] = _err(_summed(f32[k].grad, group), ref[f"g{k}"])
    return {"out": out.detach(), "errs": errs}


def _residency(w: dict, heads: int, kv_heads: int, chunk: int, group) -> dict:
    """What the chunk store holds on the device after FPDT's forward, and at most during it: with offloading
    only the chunk in use and the one prefetched (a bound independent of the chunk count), none after."""
    from deepspeed_c import comm as dist
    from deepspeed_c.sequence.fpdt_attention import FPDTAttentionFunction, _Plan

    sp, seq = dist.get_world_size(group), w["x"].shape[0]
    n = seq // chunk
    res = {}
    for offload in (True, False):
        x = w["x"][: seq // sp].float().clone().requires_grad_()
        plan = _Plan(group, n, seq // sp // n, heads * HD, kv_heads * HD, HD, None)
        out = FPDTAttentionFunction.apply(x, w["wqkv"].float(), None, plan, offload)
        store = out.grad_fn.store
        res[offload] = (store.resident_count(), store.peak_resident, n)
        out.sum().backward()
    return res


def _ulysses(w: dict, ref: dict, heads: int, kv_heads: int, group) -> dict:
    """The unchunked Ulysses layer on contiguous slices: DistributedAttention around dense attention."""
    from deepspeed_c import comm as dist
    from deepspeed_c.sequence.layer import DistributedAttention

    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = w["x"].shape[0]
    rows = slice(rank * seq // sp, (rank + 1) * seq // sp)
    f32 = {k: w[k].float().clone().requires_grad_() for k in ("wqkv", "bqkv", "wo")}
    x = w["x"][rows].float().clone().requires_grad_()
    q, k, v = _qkv(dict(w, **f32), x, heads, kv_heads)
    layer = DistributedAttention(lambda a, b_, c: _dense_attention(a, b_, c), group)
    o = layer(q, k, v, 0, (w["cos"].float(), w["sin"].float()))
    out = o.flatten(2).permute(1, 0, 2) @ f32["wo"].t()
    (out * w["gout"][rows].float()).sum().backward()
    errs = {"out": _err(out, ref["out"][rows]), "gx": _err(x.grad, ref["gx"][rows])}
    for key in ("wqkv", "bqkv", "wo"):
        errs[f"g{key}"] = _err(_summed(f32[key].grad, group), ref[f"g{key}"])
    return {"out": out.detach(), "errs": errs}


def _ffn_errors(w: dict) -> dict:
    from deepspeed_c.sequence.fpdt_layer import FPDT_FFN

    errs = {}
    for add_bias in (True, False):
        ref = {k: w[k].clone().requires_grad_() for k in ("x", "w1", "b1", "w2", "b2")}
        h = ref["x"] @ ref["w1"].t() + ref["b1"]
        h = 0.5 * h * (1 + torch.tanh(0.79788456 * (h + 0.044715 * h ** 3)))
        (((h @ ref["w2"].t()) + ref["b2"]) * w["gout"]).sum().backward()
        mine = {k: w[k].float().clone().requires_grad_() for k in ref}
        out, bias = FPDT_FFN.apply(mine["x"], mine["w1"], mine["b1"], mine["w2"], mine["b2"], add_bias, 8)
        assert (bias is None) == add_bias
        full = out if add_bias else out + bias
        (full * w["gout"].float()).sum().backward()
        errs[f"out{add_bias}"] = _err(full, h @ w["w2"].t() + w["b2"])
        for k in ref:
            errs[f"g{k}{add_bias}"] = _err(mine[k].grad, ref[k].grad)
    return errs


def _loss_errors(w: dict, chunk: int, group) -> dict:
    from deepspeed_c import comm as dist
    from deepspeed_c.sequence.fpdt_layer import FPDT_InputConstruct, FPDT_LogitsLoss

    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = w["x"].shape[0]
    labels = w["labels"].clone()
    labels[:, 3] = -100
    mask = (labels != -100).float()
    hid = w["x"].clone().requires_grad_()
    head = w["head"].clone().requires_grad_()
    tok = torch.nn.functional.cross_entropy((hid @ head.t()).permute(1, 2, 0), labels, ignore_index=-100,
                                            reduction="none")  # [b, S]
    (tok * mask).sum().div(mask.sum()).backward()
    args = SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=chunk)
    ids = torch.arange(seq).expand(B, seq)
    _, my_labels, my_mask, _, my_pos = FPDT_InputConstruct(ids, labels, mask, None, ids, args, sp, rank).generate()
    mine = my_pos[0]
    h = w["x"][mine].float().clone().requires_grad_()
    hw = w["head"].float().clone().requires_grad_()
    losses = FPDT_LogitsLoss.apply(h, my_labels, hw, rank, sp, group, 2)  # [S, b] in FPDT order
    (losses.t() * my_mask).sum().div(my_mask.sum()).backward()
    return {"loss": _err(losses.t(), tok.detach()[:, _full_order(seq, chunk, sp)]),
            "gh": _err(h.grad, hid.grad[mine]), "ghead": _err(_summed(hw.grad, group), head.grad)}


def _full_order(seq: int, chunk: int, sp: int) -> torch.Tensor:
    from deepspeed_c.sequence.fpdt_layer import token_order

    return token_order(seq, chunk, sp)


def _bad_inputs(w: dict, group) -> dict:
    from deepspeed_c.sequence.fpdt_layer import FPDT_Attention, FPDT_InputConstruct

    msgs = {}
    wqkv = w["wqkv"].float()
    attn = FPDT_Attention(_config(4, 2), wqkv, None, w["wo"].float(), None, group, chunk_size=8)
    for name, fn in (
            ("seq", lambda: attn(torch.zeros(10, B, HIDDEN), None, None, None)),
            ("construct", lambda: FPDT_InputConstruct(torch.zeros(1, 36, dtype=torch.long), None, None, None, None,
                                                      SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=8), 2,
                                                      0)),
            ("chunk", lambda: FPDT_Attention(_config(4, 2), wqkv, None, w["wo"].float(), None, group, chunk_size=7)),
            ("heads", lambda: FPDT_Attention(_config(3, 3), torch.zeros(9 * HD, HIDDEN), None,
                                             torch.zeros(HIDDEN, 3 * HD), None, group, chunk_size=8)),
            ("nogroup", lambda: FPDT_Attention(_config(4, 2), wqkv, None, w["wo"].float(), None, None))):
        try:
            fn()
            msgs[name] = "no error"
        except (ValueError, RuntimeError) as e:
            msgs[name] = str(e)
    return msgs


def _body(rank: int, world: int, heads: int, kv_heads: int, seq: int, chunk: int, checks: bool) -> dict:
    from deepspeed_c import comm as dist

    torch.manual_seed(0)
    group = dist.new_group(list(range(world)))
    w = _weights(heads, kv_heads, seq)
    ref = _reference_attention(w, heads, kv_heads)  # on the host, float64
    dev = rank_device()  # cuda:rank under DSC_TEST_BACKEND=nccl: then FPDT's CUDA offload path runs
    w, ref = ({k: v.to(dev) for k, v in d.items()} for d in (w, ref))
    res = {"on": _fpdt_attention(w, ref, heads, kv_heads, chunk, True, group)["errs"]}
    res["off"] = _fpdt_attention(w, ref, heads, kv_heads, chunk, False, group)["errs"]
    uly = _ulysses(w, ref, heads, kv_heads, group)
    one = _fpdt_attention(w, ref, heads, kv_heads, seq, True, group)
    res["ulysses"] = uly["errs"]
    res["one_chunk_vs_ulysses"] = float((one["out"] - uly["out"]).abs().max())
    res["ffn"] = _ffn_errors(w)
    res["loss"] = _loss_errors(w, chunk, group)
    if checks:  # the messages and residency counts asserted below are worked out for SP 2
        res["bad"] = _bad_inputs(w, group)
        res["residency"] = _residency(w, heads, kv_heads, chunk, group)
    return res


def _assert_close(errs: dict, what: str) -> None:
    bad = {k: v for k, v in errs.items() if not v <= 1e-5}
    assert not bad, f"{what}: errors above 1e-5: {bad}"


def test_fpdt_two_ranks() -> None:
    results = run_distributed(_body, world_size=2, args=(4, 2, 32, 8, True), timeout=180)
    for rank, r in enumerate(results):
        for key in ("on", "off", "ulysses", "ffn", "loss"):
            _assert_close(r[key], f"rank {rank} {key}")
        assert r["one_chunk_vs_ulysses"] <= 1e-5, r["one_chunk_vs_ulysses"]
        after, peak, n = r["residency"][True]
        assert after == 0 and peak <= 7, r["residency"]  # q/k/v in use + current and next key/value chunk
        assert r["residency"][False][0] == 6 * n, r["residency"]  # x, q, k, v, out, lse of every chunk stay
        bad = r["bad"]
        assert "nearest valid sequence lengths: 16 or 24" in bad["seq"], bad["seq"]
        assert "not a multiple of the FPDT chunk size 8" in bad["seq"], bad["seq"]
        assert "nearest valid sequence lengths: 32 or 40" in bad["construct"], bad["construct"]
        assert "chunk_size=7 is not a multiple of the sequence parallel size 2" in bad["chunk"], bad["chunk"]
        assert "num_attention_heads=3 is not divisible by the sequence parallel size 2" in bad["heads"], bad["heads"]
        assert "sequence_process_group is None" in bad["nogroup"], bad["nogroup"]


def test_fpdt_four_ranks() -> None:
    """SP 4 (2 chunks of 16 tokens, 4 tokens a rank a chunk): attention with offload on and off, the unchunked
    Ulysses layer, one-chunk FPDT against it, the FFN and the logits loss, as at SP 2."""
    results = run_distributed(_body, world_size=4, args=(8, 4, 32, 16, False), timeout=240)
    for rank, r in enumerate(results):
        for key in ("on", "off", "ulysses", "ffn", "loss"):
            assert len(r[key]) >= 3, (key, r[key])
            _assert_close(r[key], f"rank {rank} {key}")
        assert r["one_chunk_vs_ulysses"] <= 1e-5, r["one_chunk_vs_ulysses"]
    assert np.isfinite([v for r in results for v in r["on"].values()]).all()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])

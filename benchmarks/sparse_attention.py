"""Block-sparse attention (deepspeed_c.ops.sparse_attention: our fused CUDA kernels) side by side
with PyTorch's FlexAttention given the same layout as a BlockMask (torch.compile'd), dense SDPA
(flash backend: the full square, the speed a sparse kernel must beat) and dense SDPA with the
layout as a boolean mask (same math as ours, L x L memory). One GPU.

First a correctness table: our fp16/bf16 kernels against float32 dense masked math (output and the
gradients of q, k, v; relative max error) for every config family, block sizes 16-128, head dims
32/64/128, odd head counts, batch 1, key-padding / attention masks and rpe. Then forward+backward
time (median of interleaved reps), the output agreement with FlexAttention on the timed shape,
ratios against ours, and each method's forward+backward peak memory above the inputs.

    python benchmarks/sparse_attention.py                          # seq 4k-16k, block 64, 16 heads, D 64
    python benchmarks/sparse_attention.py --seqs 4096,16384 --reps 5 --no-masked   # .devrun/gpu_45.sh
    python benchmarks/sparse_attention.py --seqs 16384 --balance both   # balanced grid vs index order (ours-old)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_c.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig,  # noqa: E402
                                              DenseSparsityConfig, FixedSparsityConfig,
                                              LocalSlidingWindowSparsityConfig, SparseSelfAttention,
                                              VariableSparsityConfig)
from deepspeed_c.ops.sparse_attention.kernel import BlockTables  # noqa: E402
from deepspeed_c.ops.sparse_attention.reference import dense_sparse_attention, token_mask  # noqa: E402
from deepspeed_c.ops.sparse_attention.work_plan import BALANCE_ENV, balance_enabled  # noqa: E402


def pin_grid(mod, L: int, device: torch.device, balance: bool, **plan) -> BlockTables:
    """Fix the kernels' grid of `mod` at length L: balanced (work_plan.py; `plan`: factor, part) or one
    CTA per block row in index order, whatever DSC_SPARSE_ATTN_BALANCE says (fills the module's table cache)."""
    tables = BlockTables.from_layout(mod.get_layout(L), device, balance=balance, **plan)
    mod._tables[(L, str(device))] = tables
    return tables


def plan_summary(tables: BlockTables) -> str:
    if tables.row_plan is None:
        return "grid: index order"
    rp, cp = tables.row_plan, tables.col_plan
    return (f"grid: balanced, rows split {rp.merges.shape[0]} into {rp.slots} parts, "
            f"cols split {cp.merges.shape[0]} into {cp.slots}")


def layout_config(name: str, heads: int, block: int, seq: int):
    """The timed layouts, about 10% dense at 16k with block 64."""
    nb = seq // block
    if name == "fixed":  # 16-block local windows, one global block per window
        return FixedSparsityConfig(num_heads=heads, block=block, num_local_blocks=min(16, nb), num_global_blocks=1)
    if name == "bigbird":
        return BigBirdSparsityConfig(num_heads=heads, block=block, num_random_blocks=8, num_sliding_window_blocks=15,
                                     num_global_blocks=2)
    raise ValueError(f"--layouts: unknown layout {name!r} (fixed, bigbird)")


def check_configs(heads: int, block: int):
    yield "dense", DenseSparsityConfig(num_heads=heads, block=block)
    yield "fixed", FixedSparsityConfig(num_heads=heads, block=block, num_local_blocks=4, num_global_blocks=1)
    yield "fixed-uni-perhead", FixedSparsityConfig(num_heads=heads, block=block, different_layout_per_head=True,
                                                   attention="unidirectional", num_local_blocks=4,
                                                   num_different_global_patterns=2, num_global_blocks=2)
    yield "variable", VariableSparsityConfig(num_heads=heads, block=block, num_random_blocks=1,
                                             local_window_blocks=[2, 3], global_block_indices=[0, 5])
    yield "bigbird", BigBirdSparsityConfig(num_heads=heads, block=block, different_layout_per_head=True,
                                           num_random_blocks=2)
    yield "bslongformer", BSLongformerSparsityConfig(num_heads=heads, block=block, global_block_indices=[1])
    yield "local-window", LocalSlidingWindowSparsityConfig(num_heads=heads, block=block)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float(), ref.detach().float()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def check_one(label, cfg, B, H, L, D, dtype, masks: bool, tol: float, split: bool = False) -> bool:
    """split: every row / column of more than half the mean blocks split into one-block parts (the
    balanced grid's split path and its combine kernels on every shape)."""
    torch.manual_seed(0)
    mod = SparseSelfAttention(cfg, max_seq_length=L, key_padding_mask_mode="add", attn_mask_mode="mul").cuda()
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    if split:
        tables = pin_grid(mod, L, q.device, True, factor=0.5, part=1)
        assert tables.row_plan.slots > 0 and tables.col_plan.slots > 0, label
    kpm = am = rpe = None
    if masks:
        kpm = torch.zeros(B, L, device="cuda")
        kpm[:, -L // 8:] = -10000.0  # padded tail keys
        am = (torch.rand(L, L, device="cuda") > 0.1).float()  # 'mul': zeros masked out
        rpe = 0.5 * torch.randn(1, H, L, L, device="cuda")
    out = mod(q, k, v, rpe=rpe, key_padding_mask=kpm, attn_mask=am)
    go = torch.randn_like(out)
    out.backward(go)
    grads = [t.grad for t in (q, k, v)]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    am_add = None if am is None else torch.zeros_like(am).masked_fill(am == 0, float("-inf"))
    ref = dense_sparse_attention(q32, k32, v32, mod.get_layout(L), cfg.block, D ** -0.5, kpm, am_add, rpe)
    ref.backward(go.float())
    errs = [rel_err(out, ref)] + [rel_err(g, r.grad) for g, r in zip(grads, (q32, k32, v32))]
    ok = all(e <= tol for e in errs)
    print(f"  {label:<42} {str(dtype)[6:]:<9} " + " ".join(f"{e:9.2e}" for e in errs) + f"   {'ok' if ok else 'FAIL'}")
    return ok


def correctness(quick: bool) -> bool:
    grid = "balanced" if balance_enabled() else "index-order"
    print(f"correctness vs float32 dense masked math (relative max error: out, dq, dk, dv); {BALANCE_ENV}: "
          f"{grid} grid, 'split' rows: forced one-block parts")
    ok = True
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}
    for dtype in (torch.float16, torch.bfloat16):
        cfg = BigBirdSparsityConfig(num_heads=3, block=32, num_random_blocks=2)
        ok &= check_one("split bigbird masks+rpe B2 H3 L512 D64 b32", cfg, 2, 3, 512, 64, dtype, True, tol[dtype],
                        split=True)
    cfg = FixedSparsityConfig(num_heads=5, block=128, num_local_blocks=2)
    ok &= check_one("split fixed masks+rpe B1 H5 L1024 D128 b128", cfg, 1, 5, 1024, 128, torch.float16, True,
                    tol[torch.float16], split=True)
    cfg = FixedSparsityConfig(num_heads=3, block=16, different_layout_per_head=True, attention="unidirectional",
                              num_local_blocks=4, num_different_global_patterns=2, num_global_blocks=2)
    ok &= check_one("split fixed-uni-perhead B3 H3 L256 D32 b16", cfg, 3, 3, 256, 32, torch.bfloat16, False,
                    tol[torch.bfloat16], split=True)
    for name, cfg in check_configs(3, 64):
        ok &= check_one(f"{name} B2 H3 L512 D64 b64", cfg, 2, 3, 512, 64, torch.bfloat16, False, tol[torch.bfloat16])
    for dtype in (torch.float16, torch.bfloat16):
        cfg = BigBirdSparsityConfig(num_heads=3, block=32, num_random_blocks=2)
        ok &= check_one("bigbird masks+rpe B2 H3 L256 D64 b32", cfg, 2, 3, 256, 64, dtype, True, tol[dtype])
    for block, D in ((16, 32), (32, 128), (128, 64), (64, 128), (16, 64)) if not quick else ((16, 32), (128, 128)):
        cfg = FixedSparsityConfig(num_heads=5, block=block, num_local_blocks=2)
        ok &= check_one(f"fixed B1 H5 L{8 * block} D{D} b{block}", cfg, 1, 5, 8 * block, D, torch.float16, True,
                        tol[torch.float16])
    return ok


def flex_block_mask(layout: torch.Tensor, block: int, L: int):
    """The layout as a BlockMask whose blocks are all "full" (no mask_mod runs inside a block: the
    fastest FlexAttention can do with a block-aligned pattern)."""
    from torch.nn.attention.flex_attention import BlockMask

    lay = layout.bool().cuda().unsqueeze(0)  # [1, H, nb, nb]
    full_num = lay.sum(-1).to(torch.int32)
    full_idx = torch.argsort(lay.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    zeros_num = torch.zeros_like(full_num)
    zeros_idx = torch.zeros_like(full_idx)
    return BlockMask.from_kv_blocks(zeros_num, zeros_idx, full_num, full_idx, BLOCK_SIZE=block)


_flex_compiled = None


def coarse_block_mask(lay: torch.Tensor, block: int, mask_mod):
    """FlexAttention's default 128-token BlockMask of a finer layout, built from the layout itself (no
    L x L mask is materialised): a 128 block is full when all its layout blocks are set, partial
    (mask_mod evaluated inside) when some are."""
    from torch.nn.attention.flex_attention import BlockMask

    f = 128 // block
    H, nb, _ = lay.shape
    counts = lay.reshape(H, nb // f, f, nb // f, f).sum(dim=(2, 4))  # [H, nb/f, nb/f]
    full, partial = counts == f * f, (counts > 0) & (counts < f * f)

    def table(sel):
        sel = sel.unsqueeze(0)
        return sel.sum(-1).to(torch.int32), torch.argsort(sel.to(torch.int8), dim=-1, descending=True,
                                                          stable=True).to(torch.int32)

    (pn, pi), (fn, fi) = table(partial), table(full)
    return BlockMask.from_kv_blocks(pn, pi, fn, fi, BLOCK_SIZE=128, mask_mod=mask_mod)


def make_flex(layout, block, L, q, k, v, go):
    """The first FlexAttention form that runs here: the layout's block mask as is, then with 64 x 64
    kernel tiles, then as a 128-token mask_mod BlockMask (mask evaluated inside partial blocks)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    flex = _flex_compiled
    bm = flex_block_mask(layout, block, L)
    lay = layout.bool().cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        return lay[h, q_idx // block, kv_idx // block]

    tries = [("block mask", lambda a, b, c: flex(a, b, c, block_mask=bm)),
             ("block mask, 64x64 tiles", lambda a, b, c: flex(a, b, c, block_mask=bm, kernel_options={
                 "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32})),
             ("block mask, 64x64 forward tiles", lambda a, b, c: flex(a, b, c, block_mask=bm, kernel_options={
                 "BLOCK_M": 64, "BLOCK_N": 64}))]
    if block < 128 and 128 % block == 0:
        bm128 = coarse_block_mask(lay, block, mask_mod)
        tries.append(("mask_mod, 128 blocks", lambda a, b, c: flex(a, b, c, block_mask=bm128)))
    for label, fn in tries:
        try:
            fwd_bwd(fn, q, k, v, go)
            print(f"    flex form: {label}")
            return fn
        except Exception as e:  # noqa: BLE001 - report and try the next form
            print(f"    flex form {label!r} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    raise RuntimeError("no FlexAttention form ran")


def fwd_bwd(fn, q, k, v, go):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(go)
    return out


def time_ms(fn, q, k, v, go) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fwd_bwd(fn, q, k, v, go)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def peak_mb(fn, q, k, v, go) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(fn, q, k, v, go)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(seq: int, layout_name: str, args) -> None:
    B, H, D, block = args.batch, args.heads, args.head_dim, args.block
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cfg = layout_config(layout_name, H, block, seq)
    mod = SparseSelfAttention(cfg, max_seq_length=seq).cuda()
    layout = mod.get_layout(seq)
    density = float(layout.float().mean())
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, seq, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    balance = {"env": balance_enabled(), "on": True, "off": False, "both": True}[args.balance]
    grid = plan_summary(pin_grid(mod, seq, q.device, balance))
    methods = {"ours": mod}
    if args.balance == "both":  # the index-order grid side by side, on the same (random) layout
        methods["ours-old"] = SparseSelfAttention(cfg, max_seq_length=seq).cuda()
        methods["ours-old"].load_state_dict(mod.state_dict())
        pin_grid(methods["ours-old"], seq, q.device, False)
    if not args.no_flex:
        methods["flex"] = make_flex(layout, block, seq, q, k, v, go)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c)

    methods["sdpa-dense"] = sdpa
    if not args.no_masked and seq <= args.masked_max_seq:
        tmask = token_mask(layout, block).cuda().unsqueeze(0)

        def masked(a, b, c):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, attn_mask=tmask)

        methods["sdpa-masked"] = masked
    # agreement on this shape before timing (flex and the masked SDPA compute the same function)
    ref = fwd_bwd(methods["ours"], q, k, v, go).detach()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    agree = {}
    for name in [m for m in methods if m not in ("ours", "sdpa-dense")]:
        try:
            out = fwd_bwd(methods[name], q, k, v, go)
            agree[name] = max([rel_err(out, ref)] + [rel_err(t.grad, g) for t, g in zip((q, k, v), ref_grads)])
        except torch.OutOfMemoryError:
            agree[name] = float("nan")
            methods.pop(name)
            torch.cuda.empty_cache()
    for fn in methods.values():  # warm-up (compiles flex)
        fwd_bwd(fn, q, k, v, go)
    times = {m: [] for m in methods}
    for _ in range(args.reps):
        for m, fn in methods.items():
            times[m].append(time_ms(fn, q, k, v, go))
    med = {m: statistics.median(t) for m, t in times.items()}
    mem = {m: peak_mb(fn, q, k, v, go) for m, fn in methods.items()}
    print(f"seq {seq:>6} {layout_name:<8} density {density:5.1%}  {grid}\n    agree(max rel err vs ours) "
          + " ".join(f"{m}={e:.1e}" for m, e in agree.items()))
    for m in methods:
        ratio = med[m] / med["ours"]
        print(f"    {m:<12} {med[m]:9.3f} ms   {ratio:6.2f}x ours time   peak {mem[m]:9.1f} MB")


def bert_flow(args) -> None:
    """The tutorial flow: a BERT masked-LM whose self-attention layers SparseAttentionUtils replaced
    with BertSparseSelfAttention (Fixed layout) trains `--bert-steps` steps at `--bert-seq` under
    bf16 autocast; the same model with HF attention given the layout as a 4D additive mask (dense
    masked: the same function) trains on the same batches. Losses side by side, max difference."""
    import copy

    import transformers

    from deepspeed_c.ops.sparse_attention import SparseAttentionUtils

    L, H = args.bert_seq, 4
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=H,
                                  intermediate_size=512, max_position_embeddings=L, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    dense = transformers.BertForMaskedLM(cfg).cuda()
    sparse = copy.deepcopy(dense)
    sc = FixedSparsityConfig(num_heads=H, block=64, num_local_blocks=4, num_global_blocks=1)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(sparse, L, sc)
    layout = sparse.bert.encoder.layer[0].attention.self.sparse_self_attention.get_layout(L)
    allowed = token_mask(layout, 64).cuda()[None]
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = []
    for _ in range(args.bert_steps):
        ids = torch.randint(5, 1024, (2, L), device="cuda", generator=gen)
        keep = torch.ones(2, L, dtype=torch.bool, device="cuda")
        keep[1, L - L // 4:] = False  # a padded second sequence
        labels = torch.where(torch.rand(2, L, device="cuda", generator=gen) < 0.15, ids, -100)
        batches.append((ids, keep, labels))

    def train(model, use_4d: bool) -> tuple[list[float], float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for ids, keep, labels in batches:
            if use_4d:
                ok = allowed & keep[:, None, None, :]
                mask = torch.zeros(ok.shape, device="cuda").masked_fill(~ok, torch.finfo(torch.float32).min)
            else:
                mask = keep.long()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        end.record()
        end.synchronize()
        return losses, start.elapsed_time(end) / len(batches)

    ls, ts = train(sparse, False)
    ld, td = train(dense, True)
    diff = max(abs(a - b) for a, b in zip(ls, ld))
    rel = max(abs(a - b) / abs(b) for a, b in zip(ls, ld))
    print(f"\nBERT flow: seq {L}, {args.bert_steps} steps, Fixed layout density {float(layout.float().mean()):.1%}, "
          f"bf16 autocast, AdamW 1e-3")
    for i in sorted({0, 1, 9, 24, len(ls) - 1}):
        if i < len(ls):
            print(f"    step {i + 1:>3}: sparse {ls[i]:.5f}   dense-masked {ld[i]:.5f}")
    print(f"    max |loss diff| {diff:.2e} (relative {rel:.2e}); {'ok' if rel <= 2e-2 else 'FAIL'} at 2e-2   "
          f"step time: sparse {ts:.1f} ms, dense-masked (HF eager, 4D mask) {td:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="4096,8192,16384")
    p.add_argument("--layouts", default="fixed,bigbird")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-masked", action="store_true", help="skip dense SDPA with the L x L boolean mask")
    p.add_argument("--masked-max-seq", type=int, default=8192, help="dense masked SDPA only up to this length")
    p.add_argument("--quick-check", action="store_true")
    p.add_argument("--balance", choices=("env", "on", "off", "both"), default="env",
                   help=f"our kernels' grid: {BALANCE_ENV} (env), balanced, index order, or both side by side")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--bert-steps", type=int, default=0, help="also train the BERT flow this many steps")
    p.add_argument("--bert-seq", type=int, default=4096)
    p.add_argument("--only-bert", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sparse_attention.py needs a GPU")
    if args.only_bert:
        bert_flow(args)
        return
    if not args.skip_check and not correctness(args.quick_check):
        print("correctness FAILED: timings below are of wrong kernels")
    print(f"\nforward+backward, batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, block {args.block}, "
          f"{args.dtype}, median of {args.reps} interleaved reps (ratio > 1: slower than ours)")
    for seq in (int(s) for s in args.seqs.split(",")):
        for name in args.layouts.split(","):
            bench(seq, name, args)
            torch.cuda.empty_cache()
    if args.bert_steps:
        bert_flow(args)


if __name__ == "__main__":
    main()

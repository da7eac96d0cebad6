"""Data efficiency benchmarks: random-LTD's token gather/scatter against a plain copy of the same bytes,
and the training step of a GPT whose middle layers run random-LTD against the dense GPT.

1. gather / scatter: hidden states [batch, seq, hidden] (2^26 elements by default), half the tokens kept;
   the gather reads and writes the kept half, the scatter copies the whole tensor and writes the kept half
   back. Bandwidth = bytes moved / median time, printed as a fraction of `copy_` over the same bytes.
2. GPT step: n_layer pre-LN blocks (causal attention + 4x MLP), all but the first and last wrapped in
   RandomLayerTokenDrop, through deepspeed_c.initialize on one device; the median step time at kept lengths
   seq/4, seq/2 and seq against the dense model, as the ratio random-LTD / dense (below 1: time saved).

    python benchmarks/data_efficiency.py [--layers 24] [--seq 2048] [--d 1024] [--reps 5]
    python benchmarks/data_efficiency.py --tiny       # a CPU smoke run"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from the checkout

import deepspeed_c  # noqa: E402
from deepspeed_c.ops.random_ltd import gpt_sample_tokens, token_gather, token_scatter  # noqa: E402
from deepspeed_c.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_gather_scatter(batch: int, seq: int, hidden: int, device: torch.device, reps: int) -> None:
    x = torch.randn(batch, seq, hidden, device=device)
    keep = seq // 2
    idx = gpt_sample_tokens(keep, seq, batch, device=device)[0][0]
    part = token_gather(x, idx, True)
    half, whole = torch.empty_like(part), torch.empty_like(x)
    t_copy_half = _median(lambda: half.copy_(part), device, reps)
    t_copy_whole = _median(lambda: whole.copy_(x), device, reps)
    t_gather = _median(lambda: token_gather(x, idx, True), device, reps)
    t_scatter = _median(lambda: token_scatter(x, part, idx, True), device, reps)
    print(f"tokens [{batch}, {seq}, {hidden}] = {x.numel()} elements, keep {keep}/{seq}")
    print(f"gather : {t_gather * 1e3:8.3f} ms, {t_copy_half / t_gather:6.1%} of copy bandwidth (same bytes)")
    print(f"scatter: {t_scatter * 1e3:8.3f} ms, {(t_copy_whole + t_copy_half) / t_scatter:6.1%} of copy bandwidth "
          "(clone + kept half)")


class Block(torch.nn.Module):

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, is_causal=True, attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(
            x.shape[1], device=x.device), need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):

    def __init__(self, layers: int, d: int, vocab: int = 1024) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.cross_entropy(self.head(x[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _engine(model: torch.nn.Module, layers: int, seq: int, micro: int, ltd: bool):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    if ltd:
        cfg["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": layers, "random_ltd_layer_num": layers - 2,
            "random_ltd_layer_id": list(range(1, layers - 1)), "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": seq // 4, "max_value": seq, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 10**9, "seq_per_step": 8}}}}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    if ltd:
        engine = convert_to_random_ltd(engine, Block)
    return engine


def bench_gpt(layers: int, seq: int, d: int, micro: int, device: torch.device, reps: int) -> None:
    torch.manual_seed(0)
    base = GPT(layers, d)
    tokens = torch.randint(0, 1024, (micro, seq), device=device)
    dense = _engine(copy.deepcopy(base), layers, seq, micro, ltd=False)
    ltd = _engine(copy.deepcopy(base), layers, seq, micro, ltd=True)

    def step(engine) -> None:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()

    t_dense = _median(lambda: step(dense), device, reps)
    print(f"GPT {layers} layers, d {d}, seq {seq}, micro-batch {micro}: dense step {t_dense * 1e3:.1f} ms")
    for keep in (seq // 4, seq // 2, seq):
        ltd.random_ltd_scheduler.set_current_seq(keep)
        t = _median(lambda: step(ltd), device, reps)
        print(f"  random-LTD keeping {keep:5d}/{seq} tokens in {layers - 2} layers: {t * 1e3:.1f} ms, "
              f"ratio random-LTD / dense {t / t_dense:.3f}")
    dense.destroy()
    ltd.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.layers, args.seq, args.d, args.micro, args.reps = 4, 64, 64, 2, 3
        bench_gather_scatter(4, 256, 64, device, args.reps)
    else:
        bench_gather_scatter(32, 2048, 1024, device, args.reps)  # 2^26 elements
    bench_gpt(args.layers, args.seq, args.d, args.micro, device, args.reps)


if __name__ == "__main__":
    main()

"""AutoTP and Ulysses code paths at world size 1 (NCCL on a GPU, gloo on the host), side by side with
the plain model in one process: the overhead their wrappers add where no collective has work to do.

Variants (names in the table):
  plain-llama  a LLaMA-style transformers model (from a config, no download), forward + backward
  autotp-llama the same weights after deepspeed_c.module_inject.auto_tp.apply_autotp over a group of 1
               (LinearLayer / LinearAllreduce in place of the projections)
  plain-attn   causal scaled_dot_product_attention on [b, s, h, d], forward + backward
  ulysses-attn deepspeed_c.sequence.layer.DistributedAttention around the same attention, group of 1

Correctness first: autotp-llama's logits equal plain-llama's and ulysses-attn's output equals
plain-attn's (tolerance of the dtype); a variant that disagrees is reported and not timed. Then --reps
interleaved rounds (each variant once per round, synchronised), median ms, ratio to the plain variant.

    python benchmarks/tp_sp_overhead.py [--device cuda] [--dtype bf16] [--hidden 2048] [--layers 4]
                                        [--seq 2048] [--batch 4] [--reps 20]
--device cpu runs a small smoke test of the same code on the host."""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.device == "cpu":  # smoke test sizes
        args.hidden, args.layers, args.heads, args.seq, args.batch, args.reps, args.dtype = 64, 2, 4, 64, 2, 3, "fp32"
    return args


def init_world_of_one(device: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    args = parse()
    init_world_of_one(args.device)
    import torch.distributed as dist
    import transformers

    from deepspeed_c.module_inject.auto_tp import apply_autotp
    from deepspeed_c.sequence.layer import DistributedAttention

    transformers.logging.set_verbosity_error()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dev = torch.device(args.device)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).to(dev, dtype)
    tp = apply_autotp(copy.deepcopy(plain), dist.group.WORLD)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    hd = args.hidden // args.heads
    q, k, v = (torch.randn(args.batch, args.seq, args.heads, hd, device=dev, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    class Local(torch.nn.Module):
        def forward(self, q, k, v):
            return sdpa(q, k, v)

    ulysses = DistributedAttention(Local(), dist.group.WORLD)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    checks = {}
    with torch.no_grad():
        a, b = plain(input_ids=ids).logits.float(), tp(input_ids=ids).logits.float()
        checks["autotp-llama"] = ((a - b).abs().max() / a.abs().max()).item()
        a, b = sdpa(q, k, v).float(), ulysses(q, k, v, 0).float()
        checks["ulysses-attn"] = ((a - b).abs().max() / a.abs().max()).item()

    def train_step(model: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    def attn_step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            fn().float().sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run

    variants = {"plain-llama": train_step(plain), "autotp-llama": train_step(tp),
                "plain-attn": attn_step(lambda: sdpa(q, k, v)), "ulysses-attn": attn_step(lambda: ulysses(q, k, v, 0))}
    ok = {n: checks.get(n, 0.0) <= tol for n in variants}
    times: dict[str, list[float]] = {n: [] for n in variants}
    for n, fn in variants.items():  # warm-up
        if ok[n]:
            fn()
    for _ in range(args.reps):
        for n, fn in variants.items():
            if not ok[n]:
                continue
            sync(args.device)
            t0 = time.perf_counter()
            fn()
            sync(args.device)
            times[n].append((time.perf_counter() - t0) * 1e3)
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device={dev_name} dtype={args.dtype} hidden={args.hidden} layers={args.layers} heads={args.heads} "
          f"seq={args.seq} batch={args.batch} reps={args.reps} world=1 ({dist.get_backend()})")
    print(f"{'variant':<14} {'check (rel err)':>16} {'median ms':>10} {'vs plain':>9}")
    base = {"autotp-llama": "plain-llama", "ulysses-attn": "plain-attn"}
    for n in variants:
        med = statistics.median(times[n]) if times[n] else float("nan")
        ref = statistics.median(times[base[n]]) if n in base and times[base[n]] else med
        check = f"{checks[n]:.2e}" if n in checks else "-"
        status = "" if ok[n] else "  MISMATCH, not timed"
        print(f"{n:<14} {check:>16} {med:>10.3f} {med / ref:>8.3f}x{status}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Flops profiler: overhead on a GPT training step and FLOP count against the analytic count.

    python benchmarks/profiler_overhead.py                       # small GPT on CPU
    python benchmarks/profiler_overhead.py --device cuda --d 2048 --layers 16 --heads 16 --seq 1024 --batch 4
    PYTHONPATH=/tmp/ds_real:/tmp/ds_deps DS_ACCELERATOR=cpu python benchmarks/profiler_overhead.py   # + DeepSpeed's

Correctness first: the profiler's forward flops must equal the exact analytic forward count of
this GPT (matmuls, attention, LayerNorm and GELU under the profiler's conventions), and DeepSpeed's
profiler (when importable) must report the same; the usual estimate 6 x params x tokens +
attention (forward + backward) is printed against 3 x the counted forward flops. Then interleaved
blocks of whole training steps (forward + backward + SGD) with no profiler, with ours and with
DeepSpeed's profiling the forward, and the overhead ratios."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepspeed_c.profiling.flops_profiler import FlopsProfiler  # noqa: E402
from deepspeed_c.profiling.toy_models import GPT  # noqa: E402  (the model the profiler tests count)


def exact_forward_flops(a: argparse.Namespace) -> int:
    tokens = a.batch * a.seq
    per_layer = 2 * tokens * a.d * 12 * a.d + 4 * a.batch * a.seq * a.seq * a.d  # matmuls + QK^T, PV
    per_layer += 2 * 5 * tokens * a.d + tokens * 4 * a.d  # two LayerNorms, GELU
    return a.layers * per_layer + 5 * tokens * a.d + 2 * tokens * a.d * a.vocab


def estimate_train_flops(model: nn.Module, a: argparse.Namespace) -> int:
    """6 x (non-embedding + head) params x tokens + attention (6 x 2 x L x T x d per token: fwd + bwd)."""
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("tok.", "pos.")))
    tokens = a.batch * a.seq
    return 6 * n * tokens + 12 * a.layers * a.seq * a.d * tokens


def _deepspeed_profiler():
    try:
        from deepspeed.profiling.flops_profiler import FlopsProfiler as DSProfiler
        return DSProfiler
    except Exception:  # not on PYTHONPATH: ours alone
        return None


def step(model: nn.Module, ids: torch.Tensor, prof_cls, lr: float = 1e-4) -> int:
    prof = prof_cls(model) if prof_cls is not None else None
    if prof is not None:
        prof.start_profile()
    logits = model(ids)
    flops = prof.get_total_flops() if prof is not None else 0
    if prof is not None:
        prof.end_profile()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
            p.grad = None
    return flops


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("d", 256), ("layers", 4), ("heads", 4), ("vocab", 4096), ("seq", 256), ("batch", 4),
                          ("blocks", 5), ("steps", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    model = GPT(a.vocab, a.seq, a.d, a.layers, a.heads).to(dev, dtype)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    ds_cls = _deepspeed_profiler()

    ours = step(model, ids, FlopsProfiler)
    exact = exact_forward_flops(a)
    assert ours == exact, f"profiler counted {ours} forward flops, the exact count is {exact}"
    if ds_cls is not None:
        theirs = step(model, ids, ds_cls)
        assert theirs == ours, f"DeepSpeed's profiler counted {theirs}, ours {ours}"
    estimate = estimate_train_flops(model, a)
    print(f"GPT d={a.d} layers={a.layers} heads={a.heads} vocab={a.vocab} seq={a.seq} batch={a.batch} "
          f"{a.dtype} on {a.device}; params {sum(p.numel() for p in model.parameters()):,}")
    print(f"forward flops counted = exact analytic = {ours:,}" + (" = DeepSpeed's" if ds_cls else ""))
    print(f"3 x counted / (6 x params x tokens + attention) = {3 * ours / estimate:.4f}")

    sides = [("no profiler", None), ("deepspeed_c profiler", FlopsProfiler)]
    if ds_cls is not None:
        sides.append(("DeepSpeed profiler", ds_cls))
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    for name, cls in sides:  # warm-up
        step(model, ids, cls)
    for _ in range(a.blocks):
        for name, cls in sides:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(model, ids, cls)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / a.steps * 1e3)
    base = statistics.median(times["no profiler"])
    print(f"\n| side | ms/step (median of {a.blocks} blocks) | vs no profiler | blocks |\n| --- | ---: | ---: | --- |")
    for name, _ in sides:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.2f} | {med / base:.3f}x | {', '.join(f'{t:.1f}' for t in times[name])} |")


if __name__ == "__main__":
    main()

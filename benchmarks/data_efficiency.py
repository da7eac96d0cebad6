"""Data efficiency benchmarks, each correctness first, then timings side by side (interleaved reps), ratios printed.

1. kernels (GPU): random-LTD's token gather / scatter (csrc/cuda/random_ltd.cu) on hidden states
   [batch, seq, hidden] of 2^26 elements with half the tokens kept, bit for bit against the C reference
   (csrc/cpu/random_ltd.c, on the host copy) and torch.gather/scatter; then the time of ours, torch's and
   `copy_` over the same bytes. Bandwidth fraction = copy time / our time: gather moves the kept half
   (read + write, as copying the half does), the one-pass scatter reads and writes the whole tensor (as
   copying the whole does).
2. train (GPU; CPU with a tiny model): random-LTD against dense training of the same GPT, interleaved steps,
   per-phase ms/step and ratio after the correctness and loss checks (benchmarks/random_ltd_train.py).
3. merge (CPU): the DataAnalyzer reduce of a 1M-sample corpus mapped by 2 workers, C merge over the
   memory-mapped map files against the one-process Python sort (see bench_merge).

    python benchmarks/data_efficiency.py kernels [--tiny]
    python benchmarks/data_efficiency.py train --layers 24 --seq 2048 --d 1024 --steps 60 [--sdpa flash]
    python benchmarks/data_efficiency.py merge --samples 1000000"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from the checkout

from deepspeed_c.ops.random_ltd import gpt_sample_tokens, token_ops  # noqa: E402

import random_ltd_train  # noqa: E402  (benchmarks/, the script's own folder)


# ---- 1. kernels ------------------------------------------------------------------------------------------
def _event_ms(fn, inner: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / inner


def _check_small_cases(device: torch.device) -> None:
    """Every layout and dtype (and add, zero, mask slicing) against the C reference on a small shape."""
    cpu = token_ops._op("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for bf in (True, False):
            B, S, H, K = 3, 37, 24 if dtype != torch.float16 else 7, 19
            x = torch.randn((B, S, H) if bf else (S, B, H), dtype=torch.float64).to(dtype)
            idx = torch.stack([torch.randperm(S)[:K] for _ in range(B)]).to(torch.int32)
            part = torch.randn((B, K, H) if bf else (K, B, H), dtype=torch.float64).to(dtype)
            xd, idd, pd = x.to(device), idx.to(device), part.to(device)
            got = [token_ops.gather(xd, idd, bf), token_ops.scatter(xd, pd, idd, bf),
                   token_ops.scatter(xd, pd, idd, bf, accumulate=True), token_ops.scatter(xd, None, idd, bf),
                   token_ops.scatter(None, pd, idd, bf, accumulate=True, like=xd)]
            assert cpu is not None
            want = [token_ops.gather(x, idx, bf), token_ops.scatter(x, part, idx, bf),
                    token_ops.scatter(x, part, idx, bf, accumulate=True), token_ops.scatter(x, None, idx, bf),
                    token_ops.scatter(None, part, idx, bf, accumulate=True, like=x)]
            for name, g, w in zip(("gather", "scatter", "scatter-add", "scatter-zero", "zeros-add"), got, want):
                if not torch.equal(g.cpu(), w):
                    raise AssertionError(f"{name} {dtype} batch_first={bf}: CUDA kernel != C reference")
    mask = torch.rand(1, 2, 37, 37) > 0.5
    idx = torch.stack([torch.randperm(37)[:19] for _ in range(3)]).to(torch.int32)
    if not torch.equal(token_ops.mask_gather(mask.to(device), idx.to(device)).cpu(), token_ops.mask_gather(mask, idx)):
        raise AssertionError("mask_gather: CUDA kernel != C reference")


def bench_kernels(batch: int, seq: int, hidden: int, reps: int, inner: int) -> None:
    device = torch.device("cuda")
    if token_ops._op("cuda") is None or token_ops._op("cpu") is None:
        raise SystemExit("the random_ltd_cuda / random_ltd ops did not build: nothing of ours to measure")
    _check_small_cases(device)
    x = torch.randn(batch, seq, hidden, device=device)
    keep = seq // 2
    idx = gpt_sample_tokens(keep, seq, batch, device=device)[0][0]
    pos = idx.long().unsqueeze(-1).expand(-1, -1, hidden)
    ours_g = token_ops.gather(x, idx, True)
    part = torch.randn_like(ours_g)
    ours_s = token_ops.scatter(x, part, idx, True)
    torch_g, torch_s = torch.gather(x, 1, pos), x.scatter(1, pos, part)
    xc, idc = x.cpu(), idx.cpu()
    ref_g, ref_s = token_ops.gather(xc, idc, True), token_ops.scatter(xc, part.cpu(), idc, True)
    ok = {"gather": torch.equal(ours_g.cpu(), ref_g) and torch.equal(ours_g, torch_g),
          "scatter": torch.equal(ours_s.cpu(), ref_s) and torch.equal(ours_s, torch_s)}
    print(f"# random-LTD token kernels, hidden [{batch}, {seq}, {hidden}] fp32 = {x.numel()} elements, keep {keep}")
    print(f"correctness (bit-equal to the C reference and torch; all dtypes/layouts/add/zero/mask on a small case): "
          f"gather {'OK' if ok['gather'] else 'MISMATCH'}, scatter {'OK' if ok['scatter'] else 'MISMATCH'}")
    del ours_g, ours_s, torch_g, torch_s, xc, ref_g, ref_s
    half, whole = torch.empty_like(part), torch.empty_like(x)
    fns = {"copy half": lambda: half.copy_(part), "ours gather": lambda: token_ops.gather(x, idx, True),
           "torch gather": lambda: torch.gather(x, 1, pos), "copy whole": lambda: whole.copy_(x),
           "ours scatter": lambda: token_ops.scatter(x, part, idx, True),
           "torch scatter": lambda: x.scatter(1, pos, part)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):  # interleaved: each rep times every op once
        for k, fn in fns.items():
            times[k].append(_event_ms(fn, inner))
    t = {k: statistics.median(v) for k, v in times.items()}
    gb = x.numel() * x.element_size() / 1e9
    print(f"{'op':8s} {'ours ms':>8s} {'torch ms':>9s} {'copy ms':>8s} {'ours %copy':>10s} {'torch %copy':>11s} "
          f"{'ours GB/s':>9s}")
    for op, copy_key, moved in (("gather", "copy half", gb), ("scatter", "copy whole", 2 * gb)):
        o, tt, c = t[f"ours {op}"], t[f"torch {op}"], t[copy_key]
        print(f"{op:8s} {o:8.3f} {tt:9.3f} {c:8.3f} {c / o:10.1%} {c / tt:11.1%} {moved / o * 1e3:9.0f}")


# ---- 3. merge -------------------------------------------------------------------------------------------
class _IndexCorpus(torch.utils.data.Dataset):
    """Sample i is its index; metrics read a precomputed table (the map is not what is measured)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _files(root: str, names: list[str]) -> dict[str, bytes]:
    out = {}
    for name in names:
        d = os.path.join(root, name)
        for f in sorted(os.listdir(d)):
            if os.path.isfile(os.path.join(d, f)):
                with open(os.path.join(d, f), "rb") as fh:
                    out[f] = fh.read()
    return out


def bench_merge(samples: int, reps: int) -> None:
    """DataAnalyzer's reduce of a `samples`-sample corpus mapped by 2 workers (2 map processes each, 2 reduce
    threads' document layout) for two single-value metrics: a sequence length (1..2048, many ties) and a
    vocabulary-rarity-like 40-bit score. The C merge (memory-mapped map files, radix sort, C writer) against the
    one-process Python sort (numpy stable argsort, the Python index-file writer) on the same map files: bytes
    compared first, then the reduce timed alternately. Also the bare sort: C radix (from the mapped files) vs
    numpy's stable argsort of the in-memory values."""
    import tempfile

    import numpy as np

    from deepspeed_c import _C
    from deepspeed_c.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    rng = np.random.default_rng(0)
    table = {"seqlen": rng.integers(1, 2049, samples), "rarity": rng.integers(0, 1 << 40, samples)}
    names = sorted(table)

    def analyzer(root: str, worker: int) -> DataAnalyzer:
        return DataAnalyzer(_IndexCorpus(samples), num_workers=2, worker_id=worker, num_threads=2,
                            num_threads_reduce=2, batch_size=8192, metric_names=names,
                            metric_functions=[(lambda b, n=n: torch.from_numpy(table[n][np.asarray(b)])) for n in names],
                            metric_types=["single_value_per_sample"] * 2, metric_dtypes=[torch.int64] * 2,
                            save_path=root, collate_fn=lambda xs: np.asarray(xs))

    with tempfile.TemporaryDirectory() as root:
        t = time.perf_counter()
        for w in range(2):
            analyzer(root, w).run_map()
        t_map = time.perf_counter() - t
        reducer = analyzer(root, 0)
        reducer.reduce_backend = "c"
        reducer.run_reduce()
        c_files = _files(root, names)
        reducer.reduce_backend = "python"
        reducer.run_reduce()
        same = _files(root, names) == c_files
        print(f"# DataAnalyzer reduce, {samples} samples, 2 workers x 2 map processes (map {t_map:.1f} s), metrics "
              f"{names}")
        print(f"correctness: C merge files == one-process Python sort files, byte for byte: {'OK' if same else 'MISMATCH'}")
        times: dict[str, list[float]] = {"c": [], "python": []}
        for _ in range(reps):
            for backend in ("python", "c"):
                reducer.reduce_backend = backend
                t = time.perf_counter()
                reducer.run_reduce()
                times[backend].append(time.perf_counter() - t)
        tc, tp = statistics.median(times["c"]), statistics.median(times["python"])
        print(f"{'reduce (both metrics)':24s} {'C merge s':>10s} {'Python s':>10s} {'speed-up':>9s}")
        print(f"{'whole reduce':24s} {tc:10.3f} {tp:10.3f} {tp / tc:8.1f}x")
        # the bare sort of one metric: C (map files -> sorted) vs numpy's stable argsort of the in-memory array
        parts = [os.path.join(root, "rarity", d) for d in sorted(os.listdir(os.path.join(root, "rarity")))
                 if d.startswith("worker")]
        vals = [(os.path.join(p, "rarity_sample_to_metric.bin"), 5,
                 os.path.getsize(os.path.join(p, "rarity_sample_to_metric.bin")) // 8) for p in parts]
        ids = [(os.path.join(p, "rarity_sample_ids.bin"), 5, n) for p, (_, _, n) in zip(parts, vals)]
        flat = np.concatenate([np.fromfile(v[0], dtype=np.int64) for v in vals])
        sc, sn = [], []
        for _ in range(reps):
            t = time.perf_counter()
            _C.index_merge_sort(vals, ids)
            sc.append(time.perf_counter() - t)
            t = time.perf_counter()
            np.argsort(flat, kind="stable")
            sn.append(time.perf_counter() - t)
        print(f"{'sort only (rarity, 40b)':24s} {statistics.median(sc):10.3f} {statistics.median(sn):10.3f} "
              f"{statistics.median(sn) / statistics.median(sc):8.1f}x   (numpy: argsort only, in memory)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("kernels", "train", "merge"))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--vocab", type=int, default=1024)
    random_ltd_train.add_schedule_args(ap)
    args = ap.parse_args()
    if args.what == "kernels":
        if args.tiny:
            bench_kernels(4, 256, 64, 3, 2)
        else:
            bench_kernels(32, 2048, 1024, args.reps, 10)  # 2^26 elements
    elif args.what == "train":
        random_ltd_train.bench_train(args.layers, args.seq, args.d, args.micro, args.steps, args.warmup, args.vocab,
                                     args.seq_per_step, args.ramp_frac, args.min_frac, args.sdpa, args.profile)
    else:
        bench_merge(args.samples, 3)


if __name__ == "__main__":
    main()

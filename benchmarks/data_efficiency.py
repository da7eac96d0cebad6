"""Data efficiency benchmarks, each correctness first, then timings side by side (interleaved reps), ratios printed.

1. kernels (GPU): random-LTD's token gather / scatter (csrc/cuda/random_ltd.cu) on hidden states
   [batch, seq, hidden] of 2^26 elements with half the tokens kept, bit for bit against the C reference
   (csrc/cpu/random_ltd.c, on the host copy) and torch.gather/scatter; then the time of ours, torch's and
   `copy_` over the same bytes. Bandwidth fraction = copy time / our time: gather moves the kept half
   (read + write, as copying the half does), the one-pass scatter reads and writes the whole tensor (as
   copying the whole does).
2. train (GPU): a GPT of n_layer pre-LN blocks (causal SDPA + 4x MLP, bf16), all but the first and last
   wrapped in RandomLayerTokenDrop, against the dense GPT from the same weights, on the same batches of a
   learnable synthetic sequence task; random-LTD's kept length ramps from seq/4 to seq over the run. Steps
   alternate between the two; printed: wall time of the steps after warm-up (ratio random-LTD / dense, below
   1 is time saved), the mean training loss of the last steps and a held-out eval loss (dense forward) each.
3. merge (CPU): the DataAnalyzer reduce of a 1M-sample corpus mapped by 2 workers, C merge over the
   memory-mapped map files against the one-process Python sort (see bench_merge).

    python benchmarks/data_efficiency.py kernels [--tiny]
    python benchmarks/data_efficiency.py train --layers 24 --seq 2048 --d 512 --steps 40
    python benchmarks/data_efficiency.py merge --samples 1000000"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from the checkout

import deepspeed_c  # noqa: E402
from deepspeed_c.ops.random_ltd import gpt_sample_tokens, token_ops  # noqa: E402
from deepspeed_c.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd  # noqa: E402


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


# ---- 2. train --------------------------------------------------------------------------------------------
class Block(torch.nn.Module):

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # random-LTD keeps tokens in order, so causal attention over the kept ones is their causal attention
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):

    def __init__(self, layers: int, d: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[:tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x[:, :-1])).float()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _batch(micro: int, seq: int, vocab: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Arithmetic sequences mod vocab (a start and a stride per sample) with 10% of tokens replaced by noise:
    the stride is inferred from the context, so the loss falls well below log(vocab)."""
    start = torch.randint(0, vocab, (micro, 1), generator=gen)
    stride = torch.randint(1, 16, (micro, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq)) % vocab
    noise = torch.rand(micro, seq, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, (micro, seq), generator=gen), tokens)
    return tokens.to(device)


def _engine(model: torch.nn.Module, layers: int, seq: int, micro: int, steps: int, ltd: bool, seq_per_step: int = 16):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}}
    if ltd:
        cfg["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": layers, "random_ltd_layer_num": layers - 2,
            "random_ltd_layer_id": list(range(1, layers - 1)), "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": seq // 4, "max_value": seq, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": steps, "seq_per_step": seq_per_step}}}}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    if ltd:
        engine = convert_to_random_ltd(engine, Block)
    return engine


def _profile_step(name: str, engine: Any, tokens: torch.Tensor) -> None:
    """Top ops of one training step by device and host time (where a slow step spends it)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tokens.is_cuda else [])
    with profile(activities=acts) as prof:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        loss.item()
    key = "self_cuda_time_total" if tokens.is_cuda else "self_cpu_time_total"
    print(f"## profile of one step: {name} (sorted by {key})")
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=48))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=48))


def bench_train(layers: int, seq: int, d: int, micro: int, steps: int, warmup: int, vocab: int = 1024,
                profile: bool = False, seq_per_step: int = 16) -> None:
    """Each new kept length is a new attention shape: cuDNN's SDPA (torch's choice on sm_90) builds a plan per
    shape (~0.1 s). DeepSpeed's seq_per_step of 16 over a schedule of tens of thousands of steps makes that a
    step in thousands; over a ramp of tens of steps it is every step, so short runs take a coarser
    --seq_per_step to keep the ratio of new shapes to steps near a real run's."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    base = GPT(layers, d, seq, vocab)
    engines = {"dense": _engine(copy.deepcopy(base), layers, seq, micro, steps, False),
               "random-LTD": _engine(copy.deepcopy(base), layers, seq, micro, steps, True, seq_per_step)}
    gen = torch.Generator().manual_seed(1)
    batches = [_batch(micro, seq, vocab, gen, device) for _ in range(steps)]
    held_out = [_batch(micro, seq, vocab, gen, device) for _ in range(4)]
    wall = {k: 0.0 for k in engines}
    step_ms: dict[str, list[float]] = {k: [] for k in engines}
    losses: dict[str, list[float]] = {k: [] for k in engines}
    for i, tokens in enumerate(batches):
        for name, engine in engines.items():  # interleaved: both systems see step i before either sees i + 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())  # syncs
            if i >= warmup:
                wall[name] += time.perf_counter() - t
                step_ms[name].append((time.perf_counter() - t) * 1e3)
    evals = {}
    for name, engine in engines.items():
        engine.eval()
        with torch.no_grad():
            evals[name] = statistics.mean(engine(t).item() for t in held_out)
    last = max(1, steps // 8)
    print(f"# GPT {layers} layers, d {d}, seq {seq}, micro-batch {micro}, bf16, {steps} steps (timed after {warmup}); "
          f"random-LTD on {layers - 2} layers, kept length {seq // 4} -> {seq} in steps of {seq_per_step}")
    print(f"{'system':11s} {'wall s':>8s} {'ms/step':>8s} {'median':>8s} {'max':>8s} "
          f"{'train loss (last ' + str(last) + ')':>22s} {'eval loss':>10s}")
    for name in engines:
        print(f"{name:11s} {wall[name]:8.2f} {wall[name] / (steps - warmup) * 1e3:8.1f} "
              f"{statistics.median(step_ms[name]):8.1f} {max(step_ms[name]):8.1f} "
              f"{statistics.mean(losses[name][-last:]):22.4f} {evals[name]:10.4f}")
    print(f"wall-time ratio random-LTD / dense: {wall['random-LTD'] / wall['dense']:.3f}; eval loss difference "
          f"{(evals['random-LTD'] - evals['dense']) / evals['dense']:+.2%} (log(vocab) = {math.log(vocab):.2f})")
    if profile:
        for name, engine in engines.items():
            engine.train()
            _profile_step(name, engine, batches[warmup])
    for e in engines.values():
        e.destroy()


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
    ap.add_argument("--seq_per_step", type=int, default=16, help="train: random-LTD's kept-length granularity")
    ap.add_argument("--profile", action="store_true", help="train: print a profile of one step of each system")
    args = ap.parse_args()
    if args.what == "kernels":
        if args.tiny:
            bench_kernels(4, 256, 64, 3, 2)
        else:
            bench_kernels(32, 2048, 1024, args.reps, 10)  # 2^26 elements
    elif args.what == "train":
        bench_train(args.layers, args.seq, args.d, args.micro, args.steps, args.warmup, profile=args.profile,
                    seq_per_step=args.seq_per_step)
    else:
        bench_merge(args.samples, 3)


if __name__ == "__main__":
    main()

"""Issue 52: the host side of one optimizer step, plain ZeRO-Offload against SuperOffload's worker, on the CPU.

plain: CPUOffload's step: the C CPU Adam in place, sub-chunk by sub-chunk, on the training thread (which waits).
spec: SpeculativeOffload's speculative step: the same Adam written out of place into the spare buffers (the
rollback snapshot), in the worker thread, while the training thread runs (here: a Python loop standing for
backward's kernel launches, holding the GIL). before: sub-chunk calls, the process's OpenMP default, CPython's 5 ms
GIL switch interval; after: one call per bucket, worker_threads, WORKER_SWITCH_INTERVAL; the modes between
take the changes one at a time. On a 2-core box OMP_NUM_THREADS=1 keeps every mode single-threaded (the
spinning training thread takes the other core). Both start from the same state; the results are compared bit for bit first.

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/superoffload_host.py --numel 8000000 --reps 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from deepspeed_c.ops.adam import DeepSpeedCPUAdam  # noqa: E402
from deepspeed_c.runtime.superoffload.superoffload_utils import WORKER_SWITCH_INTERVAL, worker_threads  # noqa: E402


def make_state(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(n, generator=gen), "exp_avg": torch.randn(n, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(n, generator=gen) * 1e-6,
            "grad": (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16), "lp": torch.empty(n, dtype=torch.bfloat16)}


def plain_step(opt: DeepSpeedCPUAdam, s: dict[str, torch.Tensor], buckets: list[tuple[int, int]], sub: int,
               step: int) -> None:
    group = opt.param_groups[0]
    for start, end in buckets:
        for lo in range(start, end, sub):
            hi = min(end, lo + sub)
            opt.step_tensors(group, [s["master"][lo:hi]], [s["grad"][lo:hi]],
                             [[s["exp_avg"][lo:hi]], [s["exp_avg_sq"][lo:hi]]], [s["lp"][lo:hi]], step)


def spec_step(opt: DeepSpeedCPUAdam, s: dict[str, torch.Tensor], out: dict[str, torch.Tensor],
              buckets: list[tuple[int, int]], sub: int, step: int) -> None:
    """sub: elements per C call (before the fix: the sub-chunk; after: the whole bucket, sub >= bucket)."""
    group = opt.param_groups[0]
    for start, end in buckets:
        for lo in range(start, end, sub):
            hi = min(end, lo + sub)
            opt.step_tensors_into(group, [s["master"][lo:hi]], [s["grad"][lo:hi]],
                                  [[s["exp_avg"][lo:hi]], [s["exp_avg_sq"][lo:hi]]], [s["lp"][lo:hi]],
                                  [out["master"][lo:hi]], [[out["exp_avg"][lo:hi]], [out["exp_avg_sq"][lo:hi]]],
                                  step, grad_scale=1.0)


def in_worker(fn, threads: int | None, busy: bool, switch: float = 0.005) -> float:
    """fn in a fresh thread (as SpeculativeOffload's worker sets its OpenMP count: worker_threads), the calling
    thread spinning meanwhile when busy (holding the GIL but for `switch`, sys.setswitchinterval, when the worker
    asks for it); the worker's seconds."""
    took = [0.0]
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(switch)

    def run() -> None:
        if threads is not None:
            opt_op.num_threads(threads)
        t0 = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - t0

    th = threading.Thread(target=run)
    th.start()
    x = 0
    while busy and th.is_alive():
        x += 1  # the training thread's Python work (it holds a core)
    th.join()
    sys.setswitchinterval(before)
    return took[0]


def main() -> None:
    global opt_op
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--bucket", type=int, default=1_000_003)  # odd: buckets start at unaligned offsets as real ones do
    # real run: 1.42B parameters in 4M-element sub-chunks, ~350 C calls a step; the same count here
    ap.add_argument("--sub", type=int, default=1 << 15)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n = a.numel
    buckets = [(lo, min(n, lo + a.bucket)) for lo in range(0, n, a.bucket)]
    ref = make_state(n)
    opt = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, weight_decay=0.01)
    opt_op = opt.ds_opt_op
    main_threads = opt_op.num_threads()

    # correctness: the out-of-place step in the worker equals the in-place step bit for bit
    a_s = {k: v.clone() for k, v in ref.items()}
    b_s = {k: v.clone() for k, v in ref.items()}
    out = {k: torch.empty_like(ref[k]) for k in ("master", "exp_avg", "exp_avg_sq")}
    plain_step(opt, a_s, buckets, a.sub, 3)
    same = True
    for sub in (a.sub, n):  # before (sub-chunk calls) and after (one call per bucket)
        b_s = {k: v.clone() for k, v in ref.items()}
        out = {k: torch.empty_like(ref[k]) for k in ("master", "exp_avg", "exp_avg_sq")}
        in_worker(lambda: spec_step(opt, b_s, out, buckets, sub, 3), worker_threads(opt_op, None, main_threads),
                  False)
        same = same and all(torch.equal(a_s[k], out[k]) for k in out) and torch.equal(a_s["lp"], b_s["lp"])
    print(f"correctness: spec (worker, out of place, both call sizes) == plain (in place) bit for bit: {same}")
    if not same:
        raise SystemExit(1)

    fixed = worker_threads(opt_op, None, main_threads)
    modes = {
        "plain (training thread, in place)": lambda: _timed(lambda: plain_step(opt, a_s, buckets, a.sub, 4)),
        "spec worker, sub-chunk calls (before)": lambda: in_worker(
            lambda: spec_step(opt, b_s, out, buckets, a.sub, 4), None, True),
        f"spec worker, 1 call/bucket, {fixed} thr, 5 ms GIL": lambda: in_worker(
            lambda: spec_step(opt, b_s, out, buckets, n, 4), fixed, True),
        f"spec worker, 1 call/bucket, {fixed} thr (after)": lambda: in_worker(
            lambda: spec_step(opt, b_s, out, buckets, n, 4), fixed, True, WORKER_SWITCH_INTERVAL),
        "spec worker, 1 call/bucket, omp default thr": lambda: in_worker(
            lambda: spec_step(opt, b_s, out, buckets, n, 4), None, True),
        "spec worker, 1 call/bucket, training idle": lambda: in_worker(
            lambda: spec_step(opt, b_s, out, buckets, n, 4), fixed, False, WORKER_SWITCH_INTERVAL),
    }
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(a.reps):  # interleaved: the 2 shared cores' noise hits every mode alike
        for k, f in modes.items():
            times[k].append(f())
    base = statistics.median(times["plain (training thread, in place)"])
    print(f"numel {n}, {len(buckets)} buckets, {-(-a.bucket // a.sub) * len(buckets)} sub-chunk calls before, "
          f"training-thread OpenMP threads {main_threads}, worker's after {fixed}")
    print(f"{'mode':<46} {'median ms':>10} {'ns/param':>9} {'vs plain':>9}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:<46} {m * 1e3:10.1f} {m / n * 1e9:9.2f} {m / base:8.2f}x")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


opt_op = None

if __name__ == "__main__":
    main()

"""The cost of a crash-safe checkpoint file over a plain torch.save: deepspeed_c's store.save_file (fsync,
the file's sha256 taken as it is written, per-tensor sha256 on threads) against torch.save of the same state
to the same disk, and against the serial hashing save_file did before (a second read of the file for its
sha256, tensors hashed one after another on the saving thread). Interleaved repetitions; every saved file
is loaded back and compared with the state first.

    python benchmarks/checkpoint_save.py [--gb 1.5] [--reps 3] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepspeed_c.checkpoint import digests, store  # noqa: E402


def plain(state: dict, path: str) -> None:
    torch.save(state, path)


def serial(state: dict, path: str) -> None:
    """save_file as it was: write + fsync, then read the file back for its sha256, then each tensor's."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    named: list = []
    digests._walk(state, "", named)
    [digests.tensor_digest(t) for _, t in named]


def ours(state: dict, path: str) -> None:
    store.save_file(state, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n = int(args.gb * 2 ** 30 / 4)
    g = torch.Generator().manual_seed(0)
    # a ZeRO optimizer file's shape: a few large flat partitions and many small tensors
    state = {"optimizer_state_dict": {"fp32_flat": torch.randn(n // 3, generator=g),
                                      "exp_avg": torch.randn(n // 3, generator=g),
                                      "exp_avg_sq": torch.rand(n // 3, generator=g)},
             "module": {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(200)}}
    root = tempfile.mkdtemp(prefix="dsc_save_bench_", dir=args.dir)
    systems = {"torch.save": plain, "serial hashing": serial, "save_file": ours}
    try:
        for name, fn in systems.items():  # correctness first
            path = os.path.join(root, "check.pt")
            fn(state, path)
            back = torch.load(path, weights_only=True)
            for k in state["optimizer_state_dict"]:
                assert torch.equal(back["optimizer_state_dict"][k], state["optimizer_state_dict"][k]), (name, k)
            os.remove(path)
        times: dict[str, list[float]] = {k: [] for k in systems}
        for rep in range(args.reps):
            for name, fn in systems.items():
                path = os.path.join(root, f"{rep}.pt")
                t0 = time.perf_counter()
                fn(state, path)
                times[name].append(time.perf_counter() - t0)
                os.remove(path)
        base = statistics.median(times["torch.save"])
        print(f"{args.gb:.2f} GB state, {args.reps} interleaved reps, cpus {os.cpu_count()}, dir {root}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:15s} {med:7.2f} s  {args.gb / med:6.2f} GB/s  {med / base:5.2f}x torch.save")
        print(f"  save_file vs serial hashing: {statistics.median(times['serial hashing']) / statistics.median(times['save_file']):.2f}x faster")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

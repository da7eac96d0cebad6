"""DeepNVMe's aio_handle against fio, torch.save/torch.load and plain file reads on the same disk.

For one file size (default 1 GiB) in --dir, in one process, repetitions interleaved:
- the handle (O_DIRECT, page-aligned locked buffer) over block sizes x thread counts x engines
  (io_uring: each worker thread keeps --queue_depth requests in flight; pread: one each), writes in
  place (atomic_writes=False, as the swappers write) and atomic (temporary + rename, the default);
- fio on the same file path and size, direct=1, 1 MiB blocks: libaio and io_uring at iodepth 32,
  psync (one request at a time);
- torch.save / torch.load of the same bytes as a uint8 tensor (fsync'ed; the page cache dropped for
  the file before every read), and a plain buffered `readinto` of the file.
Correctness first: the handle's round trip, and a file written by torch.save read back, are compared
bit for bit. Then the medians, the best handle configuration (printed as an `aio` section like
dsc_nvme_tune), and the ratio handle/fio-best for reads and writes.

    python benchmarks/aio.py --dir /path/on/nvme [--size 1G] [--reps 3] [--block_sizes 256K,1M,8M]
                             [--threads 1,2,4,8] [--engines io_uring,pread] [--queue_depth 32] [--swap_size 64M]

--swap_size adds the same comparison for a typical swap file (one sub-group's fp32 tensor)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from typing import Any, Callable

import torch

from deepspeed_c.nvme.tune import parse_size
from deepspeed_c.ops.op_builder import AsyncIOBuilder

aio = AsyncIOBuilder().load()


def drop_cache(path: str) -> None:
    """The file's clean pages leave the page cache, so buffered reads come from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def handle_run(bs: int, threads: int, buf: torch.Tensor, path: str, atomic: bool, engine: str,
               depth: int) -> dict[str, float]:
    os.environ["DSC_AIO_ENGINE"] = engine
    h = aio.aio_handle(block_size=bs, queue_depth=depth, intra_op_parallelism=threads, atomic_writes=atomic)
    n = buf.numel()
    t = time.perf_counter()
    h.sync_pwrite(buf, path)
    w = time.perf_counter() - t
    drop_cache(path)
    t = time.perf_counter()
    h.sync_pread(buf, path)
    r = time.perf_counter() - t
    return {"write": gbps(n, w), "read": gbps(n, r)}


def fio_engines() -> set[str]:
    """The I/O engines this fio binary was built with (a static build may lack libaio)."""
    out = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout
    engines = {w.strip() for w in out.split()[3:]}
    missing = {"libaio", "io_uring", "psync"} - engines
    if missing:
        print(f"fio lacks engine(s) {sorted(missing)}: compared without them")
    return engines


def fio_run(engine: str, rw: str, path: str, size: int, depth: int) -> float:
    cmd = ["fio", "--name=dsc", f"--filename={path}", f"--size={size}", f"--rw={rw}", "--bs=1M", f"--iodepth={depth}",
           f"--ioengine={engine}", "--direct=1", "--numjobs=1", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def torch_run(buf: torch.Tensor, path: str) -> dict[str, float]:
    n = buf.numel()
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(buf, f)
        f.flush()
        os.fsync(f.fileno())
    w = time.perf_counter() - t
    drop_cache(path)
    t = time.perf_counter()
    back = torch.load(path, weights_only=True)
    r = time.perf_counter() - t
    assert torch.equal(back[:4096], buf[:4096]) and back.numel() == n
    return {"write": gbps(n, w), "read": gbps(n, r)}


def plain_read(buf: torch.Tensor, path: str) -> float:
    drop_cache(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(memoryview(buf.numpy()))
    r = time.perf_counter() - t
    assert got == buf.numel()
    return gbps(got, r)


def check_correct(buf: torch.Tensor, path: str) -> None:
    ref = buf.clone()
    h = aio.aio_handle(block_size=1 << 20, intra_op_parallelism=2)
    h.sync_pwrite(buf, path)
    buf.zero_()
    h.sync_pread(buf, path)
    assert torch.equal(buf, ref), "handle round trip differs"
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    assert head == ref[:1 << 20].numpy().tobytes(), "file bytes differ from the buffer"
    torch.save(ref, path + ".pt")
    back = torch.empty_like(ref)
    back.copy_(torch.load(path + ".pt", weights_only=True))
    assert torch.equal(back, ref)
    os.unlink(path + ".pt")
    print("correctness: handle round trip and torch.save/load bit-exact")


def bench(args: argparse.Namespace, size: int, label: str) -> None:
    path = os.path.join(args.dir, f"dsc_aio_bench_{os.getpid()}.dat")
    h0 = aio.aio_handle()
    buf = h0.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    check_correct(buf, path)
    configs = [(parse_size(b), int(t), e) for b in args.block_sizes.split(",") for t in args.threads.split(",")
               for e in args.engines.split(",")]
    fio_jobs = [] if args.no_fio or not shutil.which("fio") else \
        [(e, d) for e, d in (("libaio", 32), ("io_uring", 32), ("psync", 1)) if e in fio_engines()]
    rec: dict[str, dict[str, list[float]]] = {}

    def add(name: str, kind: str, v: float) -> None:
        rec.setdefault(name, {}).setdefault(kind, []).append(v)

    runs: list[tuple[str, Callable[[], None]]] = []
    for bs, th, eng in configs:
        for atomic in (False, True):
            name = f"handle {eng} bs={bs >> 10}K threads={th}" + (" atomic" if atomic else "")
            runs.append((name, lambda bs=bs, th=th, name=name, atomic=atomic, eng=eng: [
                add(name, k, v) for k, v in handle_run(bs, th, buf, path, atomic, eng, args.queue_depth).items()]))
    for eng, depth in fio_jobs:
        name = f"fio {eng} iodepth={depth}"
        runs.append((name, lambda eng=eng, depth=depth, name=name: [
            add(name, rw, fio_run(eng, rw, path, size, depth)) for rw in ("write", "read")]))
    runs.append(("torch.save/load", lambda: [add("torch.save/load", k, v) for k, v in torch_run(buf, path).items()]))
    runs.append(("plain readinto", lambda: add("plain readinto", "read", plain_read(buf, path))))
    for rep in range(args.reps):
        for _, run in runs:
            run()
    os.unlink(path)
    h0.free_cpu_locked_tensor(buf)

    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in rec.items()}
    print(f"\n== {label}: {size / 2**20:.0f} MiB in {args.dir}, median of {args.reps} interleaved reps (GB/s) ==")
    print(f"{'':44s} {'write':>8s} {'read':>8s}")
    for n, d in med.items():
        print(f"{n:44s} {d.get('write', float('nan')):8.3f} {d.get('read', float('nan')):8.3f}")
    handles = {n: d for n, d in med.items() if n.startswith("handle")}
    best_r = max(handles, key=lambda n: handles[n]["read"])
    best_w = max(handles, key=lambda n: handles[n]["write"])
    fios = {n: d for n, d in med.items() if n.startswith("fio")}
    print(f"best handle read: {best_r} {handles[best_r]['read']:.3f}; best handle write: {best_w} "
          f"{handles[best_w]['write']:.3f}")
    if fios:
        fr = max(d["read"] for d in fios.values())
        fw = max(d["write"] for d in fios.values())
        print(f"handle/fio-best: read {handles[best_r]['read'] / fr:.2f}x, write {handles[best_w]['write'] / fw:.2f}x")
    t = med["torch.save/load"]
    print(f"handle/torch: read {handles[best_r]['read'] / t['read']:.2f}x, write {handles[best_w]['write'] / t['write']:.2f}x")
    bs, th = best_r.split("bs=")[1].split(" atomic")[0].split("K threads=")
    print(json.dumps({"aio": {"block_size": int(bs) << 10, "queue_depth": args.queue_depth,
                              "intra_op_parallelism": int(th),
                              "single_submit": False, "overlap_events": True, "use_gds": False}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--swap_size", default="", help="also measure this size (a typical swap file), e.g. 64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block_sizes", default="256K,1M,8M")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--engines", default="io_uring,pread", help="the handle's engines (DSC_AIO_ENGINE)")
    ap.add_argument("--queue_depth", type=int, default=32, help="the handle's queue_depth (io_uring per thread)")
    ap.add_argument("--no_fio", action="store_true")
    args = ap.parse_args()
    print(f"engine: {aio.backend()}; fio: {shutil.which('fio') or 'not installed'}")
    bench(args, parse_size(args.size), "whole file")
    if args.swap_size:
        bench(args, parse_size(args.swap_size), "swap-file size")


if __name__ == "__main__":
    main()

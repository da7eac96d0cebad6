"""`dsc_nvme_tune` (DeepSpeed's `ds_nvme_tune`): sweeps the aio handle's settings on the disk under
--nvme_dir, reports read and write GB/s for each, and writes the best `aio` config section.

DeepSpeed's flags: --nvme_dir (one or more), --sweep_config (JSON of lists per key), --no_read,
--no_write, --io_size (e.g. 400M, 1G), --loops, --log_dir, --verbose; --gds is refused (no GPUDirect
Storage here), --gpu and --flush_page_cache are accepted (the handle always reads with O_DIRECT, so
the page cache never inflates its reads)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

DEFAULT_SWEEP_CONFIG: dict[str, list[Any]] = {
    "block_size": ["256K", "1M", "8M"],
    "queue_depth": [32],
    "io_parallel": [1, 2, 4, 8],
    "single_submit": [False],
    "overlap_events": [True],
}
BENCH_LOG_DIR = "_aio_bench_logs"


def parse_size(text: Any) -> int:
    """'400M', '1G', '64K', '4096' -> bytes."""
    s = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] == "B":
        s = s[:-1]
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def parse_sweep_arguments(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsc_nvme_tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme_dir", nargs="+", required=True, help="writable directories on the NVMe device(s)")
    p.add_argument("--sweep_config", type=str, default=None, help="JSON file: lists of values per aio key")
    p.add_argument("--no_read", action="store_true", help="do not measure reads")
    p.add_argument("--no_write", action="store_true", help="do not measure writes")
    p.add_argument("--io_size", type=str, default="400M", help="bytes per read/write (e.g. 400M, 1G)")
    p.add_argument("--gpu", action="store_true", help="accepted; transfers are measured from host memory")
    p.add_argument("--gds", action="store_true", help="GPUDirect Storage (not available: refused)")
    p.add_argument("--flush_page_cache", action="store_true", help="accepted; reads use O_DIRECT")
    p.add_argument("--log_dir", type=str, default=BENCH_LOG_DIR, help="where the results and best config go")
    p.add_argument("--loops", type=int, default=1, help="repetitions of each measurement (the median is kept)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.gds:
        p.error("--gds: GPUDirect Storage is not provided by deepspeed_c (GDSBuilder is incompatible)")
    if args.no_read and args.no_write:
        p.error("--no_read and --no_write leave nothing to measure")
    if args.loops < 1:
        p.error("--loops must be >= 1")
    return args


def sweep_configs(path: Optional[str]) -> list[dict[str, Any]]:
    space = dict(DEFAULT_SWEEP_CONFIG)
    if path:
        with open(path) as f:
            user = json.load(f)
        unknown = set(user) - set(space)
        if unknown:
            raise ValueError(f"--sweep_config {path}: unknown keys {sorted(unknown)}; valid: {sorted(space)}")
        space.update({k: v if isinstance(v, list) else [v] for k, v in user.items()})
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def aio_section(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"block_size": parse_size(cfg["block_size"]), "queue_depth": int(cfg["queue_depth"]),
            "intra_op_parallelism": int(cfg["io_parallel"]), "single_submit": bool(cfg["single_submit"]),
            "overlap_events": bool(cfg["overlap_events"]), "use_gds": False}


def measure(cfg: dict[str, Any], dirs: list[str], io_size: int, loops: int, do_read: bool,
            do_write: bool) -> dict[str, float]:
    """Median GB/s (1e9 bytes/s) of whole-buffer writes and reads, all dirs at once."""
    import torch

    from deepspeed_c.ops.op_builder import AsyncIOBuilder

    sec = aio_section(cfg)
    del sec["use_gds"]
    h = AsyncIOBuilder().load().aio_handle(**sec)
    bufs = [h.new_cpu_locked_tensor(io_size, torch.empty(0, dtype=torch.uint8)) for _ in dirs]
    for b in bufs:
        b.fill_(0x5A)
    files = [os.path.join(d, f"dsc_nvme_tune_{os.getpid()}.swp") for d in dirs]
    out: dict[str, list[float]] = {"write": [], "read": []}
    try:
        for _ in range(loops):
            t = time.perf_counter()
            for b, f in zip(bufs, files):
                h.async_pwrite(b, f)
            h.wait()
            if do_write:
                out["write"].append(io_size * len(dirs) / (time.perf_counter() - t) / 1e9)
            if do_read:
                t = time.perf_counter()
                for b, f in zip(bufs, files):
                    h.async_pread(b, f)
                h.wait()
                out["read"].append(io_size * len(dirs) / (time.perf_counter() - t) / 1e9)
    finally:
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
        for b in bufs:
            h.free_cpu_locked_tensor(b)
    return {k: statistics.median(v) for k, v in out.items() if v}


def sweep_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    io_size = parse_size(args.io_size)
    results = []
    for cfg in sweep_configs(args.sweep_config):
        r = measure(cfg, args.nvme_dir, io_size, args.loops, not args.no_read, not args.no_write)
        results.append({"config": cfg, **r})
        if args.verbose:
            print(f"[dsc_nvme_tune] {cfg} -> " + ", ".join(f"{k} {v:.3f} GB/s" for k, v in r.items()))
    os.makedirs(args.log_dir, exist_ok=True)
    with open(os.path.join(args.log_dir, "sweep_results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def best(results: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, float]]:
    """The configuration with the best read GB/s (write when reads were not measured), as DeepSpeed's."""
    key = "read" if "read" in results[0] else "write"
    top = max(results, key=lambda r: r[key])
    return aio_section(top["config"]), {k: top[k] for k in ("read", "write") if k in top}


def generate_main(results: list[dict[str, Any]], log_dir: str) -> dict[str, Any]:
    section, speeds = best(results)
    text = json.dumps({"aio": section}, indent=2)
    with open(os.path.join(log_dir, "aio_config.json"), "w") as f:
        f.write(text + "\n")
    print(", ".join(f"best {k} {v:.3f} GB/s" for k, v in speeds.items()))
    print(text)
    return section


def cli_main(argv: Optional[list[str]] = None) -> None:
    args = parse_sweep_arguments(argv)
    print(f"Running deepspeed_c NVMe tuning on {args.nvme_dir}", file=sys.stderr)
    generate_main(sweep_main(args), args.log_dir)


if __name__ == "__main__":
    cli_main()

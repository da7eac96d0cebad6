"""Training throughput of a GPT-style decoder across data-parallel ranks: deepspeed_c (ZeRO stages
0-3, stage 2/3 with the optimizer offloaded to the CPU), torch DDP, torch FSDP2 (`fully_shard`) and
the real DeepSpeed with the same JSON config, in one script on the same ranks (see
throughput_systems.py for what each system is).

Every system starts from the same initial weights and sees the same batches. Correctness first: the
first `--check` losses of each system against the first system's (bf16 tolerance); a system that
disagrees is reported and not timed. One step per system then runs with torch.distributed's
collectives wrapped to count the bytes each rank hands to them ("ring bytes": (W-1)/W x the tensor
for a reduce-scatter or all-gather, 2(W-1)/W x for an all-reduce). DDP's reducer calls NCCL from C++,
so its bytes are computed (2(W-1)/W x its fp32 gradient buckets). The systems cannot all be resident
at once (a 1.3B model holds ~21 GiB of states per system), so each is built, checked, timed and
freed in turn, and `--rounds` repeats the whole sequence (interleaved repetitions; the median block
counts). Prints tokens/s, MFU ((6 x params + 12 x layers x width x sequence) x tokens / time /
peak bf16 dense), peak allocated memory per rank (the largest rank's), and writes one JSON line per
system to `--out`; `--report FILE` prints the ratios against DDP, FSDP2, DeepSpeed at the same
stage and per-GPU against deepspeed_c stage 0 on one GPU. A system named `dsc3@KEY=VALUE+KEY=VALUE` is
dsc3 built with those environment variables set (an A/B of a runtime switch, interleaved in one run).

    torchrun --nproc_per_node 2 benchmarks/train_throughput.py --model 1.3B --micro 4 \
        --systems ddp,fsdp2,dsc1,ds1,dsc2,ds2,dsc3,ds3 --out /tmp/tp.jsonl
    torchrun --nproc_per_node 1 benchmarks/train_throughput.py --model 1.3B --systems dsc0 --out /tmp/tp.jsonl
    python benchmarks/train_throughput.py --report /tmp/tp.jsonl

Models are built lean (throughput_systems.build_lean): declared on the meta device, each system
materialising only what it keeps, so 6.7B and 13B build on every rank without a whole fp32 copy.
`--nprocs N` launches its own N ranks (torch.distributed.run --standalone) when not under a launcher.

`--max_micro`: per system, one build, then the micro-batch doubles from `--micro` (up to
`--max_micro_cap`) while a try (the check at the first size, then the timed blocks) runs without
running out of device memory on every rank (torch.OutOfMemoryError caught, the ranks agree through an
all-reduce, memory freed before the next try); prints the largest micro that fits, its tokens/s and MFU
(the superlinear effect: sharding frees memory for larger micro-batches). The ranks run the same shapes,
so they run out together; a rank that ran out inside a collective the others wait in cannot be
answered: `--pg_timeout` then ends the run (the rows printed so far stand).

    python benchmarks/train_throughput.py --nprocs 8 --model 13B --micro 1 --max_micro \
        --systems fsdp2,dsc1,ds1,dsc2,ds2,dsc3,ds3 --out /tmp/maxmicro.jsonl
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throughput_systems import MODELS, build_lean, build_model, zero_stage  # noqa: E402

# ProcessGroup method -> (index of the argument whose size is the volume, ring factor kind). The
# patch sits on the ProcessGroup class because DeepSpeed and deepspeed_c both bind
# torch.distributed's functions at initialisation, so wrapping those functions sees nothing.
COUNTED = {
    "allreduce": (0, "allreduce"), "allreduce_coalesced": (0, "allreduce"),
    "_reduce_scatter_base": (1, "ring"), "reduce_scatter": (1, "ring"), "reduce_scatter_tensor_coalesced": (1, "ring"),
    "_allgather_base": (0, "ring"), "allgather": (0, "ring"), "allgather_into_tensor_coalesced": (0, "ring"),
    "allgather_coalesced": (0, "ring"), "alltoall_base": (1, "ring"), "alltoall": (1, "ring"),
    "broadcast": (0, "whole"), "reduce": (0, "whole"),
}
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return 0


class ByteCounter:
    """Wraps torch.distributed's collectives while on; ring bytes per rank, by collective name."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes: dict[str, float] = {}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "ByteCounter":
        from torch._C._distributed_c10d import ProcessGroup

        f = (self.world - 1) / self.world
        for name, (idx, kind) in COUNTED.items():
            orig = getattr(ProcessGroup, name, None)
            if orig is None:
                continue
            self._saved[name] = orig
            factor = {"allreduce": 2 * f, "ring": f, "whole": 1.0}[kind]

            def wrapped(*a: Any, _orig: Any = orig, _name: str = name, _idx: int = idx, _k: float = factor,
                        **kw: Any) -> Any:
                if len(a) > _idx + 1:  # a[0] is the process group itself
                    self.bytes[_name] = self.bytes.get(_name, 0.0) + _k * _nbytes(a[_idx + 1])
                return _orig(*a, **kw)

            setattr(ProcessGroup, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._C._distributed_c10d import ProcessGroup

        for name, orig in self._saved.items():
            setattr(ProcessGroup, name, orig)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_flops(arg: float) -> float:
    if arg > 0:
        return arg * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, val in PEAK_BF16.items():
            if key in name:
                return val
    return float("nan")


_VARIANT_ENV: set[str] = set()


def _with_env(system: str) -> str:
    """`name@KEY=VALUE+KEY=VALUE`: the system `name` built with those environment variables (A/B of a
    runtime switch inside one process; the keys a previous variant set are cleared first)."""
    for key in _VARIANT_ENV:
        os.environ.pop(key, None)
    _VARIANT_ENV.clear()
    name, _, env = system.partition("@")
    for item in filter(None, env.split("+")):
        key, _, value = item.partition("=")
        os.environ[key] = value
        _VARIANT_ENV.add(key)
    return name


def _free() -> None:
    """What a finished or failed try held goes back (cyclic engine garbage, torch's cached blocks)."""
    gc.collect()
    _sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _build(system: str, args: argparse.Namespace, micro: int) -> tuple[Any, dict[str, Any]]:
    # the previous system's engine is cyclic garbage once its last loss (whose graph reaches the parameters
    # and, through their hooks, the engine) went out of scope: collected here, not counted as resident
    _free()
    resident = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    t_build = time.perf_counter()
    sysm = build_lean(_with_env(system), args.model, args.vocab, args.seq, micro)
    return sysm, {"system": system, "build_s": time.perf_counter() - t_build, "resident_before": resident}


def run_system(system: str, batches: list, args: argparse.Namespace, world: int,
               reference: list[float] | None, counted: bool) -> dict[str, Any]:
    sysm, out = _build(system, args, args.micro)
    try:
        _measure(sysm, system, batches, args, world, reference, counted, out)
    finally:
        sysm.close()
        del sysm
    return out


def _measure(sysm: Any, system: str, batches: list, args: argparse.Namespace, world: int,
             reference: list[float] | None, counted: bool, out: dict[str, Any], check: int | None = None) -> None:
    """The first `check` (default args.check) losses against `reference`, one step counting the bytes
    (when `counted`), the timed blocks, then phases / profiles when asked: into `out`."""
    import torch.distributed as dist

    dev = batches[0][0].device
    check = args.check if check is None else check
    losses = [sysm.step(*batches[k % len(batches)]).float().item() for k in range(check)]
    if check:
        out["losses"] = losses
    if reference is not None and check:
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        out["check_rel"] = rel
        flag = torch.tensor([1.0 if rel <= args.tol else 0.0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() < 1.0:
            out["failed"] = f"losses {losses} vs reference {reference}: rel {rel:.2e} > {args.tol}"
            return
    if counted:
        with ByteCounter(world) as bc:
            sysm.step(*batches[check % len(batches)])
            _sync()
        out["bytes"] = bc.bytes
    blocks = []
    k = check + 1
    for _ in range(args.blocks):
        _sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            sysm.step(*batches[k % len(batches)])
            k += 1
        _sync()
        blocks.append((time.perf_counter() - t0) / args.steps)
    if args.phases:  # one extra block, synchronised between phases: where the time goes
        ph = {"forward": 0.0, "backward": 0.0, "step": 0.0}

        def timed(name: str, fn: Any, *fa: Any) -> Any:
            _sync()
            t0 = time.perf_counter()
            r = fn(*fa)
            _sync()
            ph[name] += (time.perf_counter() - t0) * 1e3 / args.steps
            return r

        for _ in range(args.steps):
            loss = timed("forward", sysm.fwd, *batches[k % len(batches)])
            timed("backward", sysm.bwd, loss)
            timed("step", sysm.opt)
            k += 1
        del loss  # its graph holds the parameters (and the engine through their hooks) past close()
        out["phases_ms"] = {n: round(v, 2) for n, v in ph.items()}
    if args.profile:
        from throughput_profile import profile_system

        profile_system(sysm, batches, k, args.steps, dist.get_rank(), f"{system} x {world}")
        k += args.steps
    if args.profile_unphased:
        from throughput_profile import profile_unphased

        profile_unphased(lambda i: sysm.step(*batches[i % len(batches)]), k, args.steps, dist.get_rank(), f"{system} x {world}")
        k += args.steps + 1
    # the slowest rank sets the pace
    t = torch.tensor(blocks, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["step_s"] = t.tolist()
    peak = torch.tensor([torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0], device=dev,
                        dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out["peak_bytes"] = peak.item()


# -- --max_micro: the largest micro-batch each system fits ------------------------------------------
class CheckFailed(RuntimeError):
    """A try's losses disagree with the reference (every rank raises it: the flag was all-reduced)."""


def is_oom(exc: BaseException) -> bool:
    """Out of device memory, as torch raises it (or a library re-raises it as a RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def search_max_micro(trial: Callable[[int], dict[str, Any]], agree: Callable[[bool], bool], start: int, cap: int,
                     free: Callable[[], None] = lambda: None) -> tuple[list[dict[str, Any]], int | None]:
    """Doubles the micro-batch from `start` (at most `cap`) while `trial(micro)` runs out of memory on no
    rank. Every rank calls `agree(ok)` once per try (True when every rank's ok), after `free()` (the
    failed try's tensors, held by the exception's frames until then, are released first). Returns the
    tries that fit, smallest first, and the first micro that did not (None when `cap` stopped it).
    Anything but running out of memory propagates."""
    if start < 1 or cap < start:
        raise ValueError(f"--micro {start} / --max_micro_cap {cap}: need 1 <= micro <= cap")
    fits: list[dict[str, Any]] = []
    micro = start
    while micro <= cap:
        res: dict[str, Any] | None = None
        try:
            res = trial(micro)
        except Exception as exc:  # noqa: BLE001 - only an OOM is an answer; the rest is re-raised
            if not is_oom(exc):
                raise
        free()
        if not agree(res is not None):
            return fits, micro
        assert res is not None
        fits.append(res)
        micro *= 2
    return fits, None


def make_batches(args: argparse.Namespace, micro: int, rank: int, dev: torch.device) -> list:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(0, args.vocab, (micro, args.seq), generator=g).to(dev),
             torch.randint(0, args.vocab, (micro, args.seq), generator=g).to(dev)) for _ in range(4)]


def run_max_micro(system: str, args: argparse.Namespace, world: int, reference: list[float] | None) -> dict[str, Any]:
    """One build of `system`, then search_max_micro over it (the check at the first micro only)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sysm, out = _build(system, args, args.micro)

    def trial(micro: int) -> dict[str, Any]:
        res: dict[str, Any] = {"micro": micro}
        first = micro == args.micro
        if args.simulate_oom_above and micro > args.simulate_oom_above:  # CPU smoke of the OOM path
            batch = make_batches(args, micro, rank, dev)[0]
            loss = sysm.fwd(*batch)  # a real forward (ZeRO-3 gathers, a live graph), then the "OOM"
            raise torch.OutOfMemoryError(f"simulated: micro {micro} > --simulate_oom_above; loss {loss.item():.3f}")
        _measure(sysm, system, make_batches(args, micro, rank, dev), args, world, reference if first else None,
                 False, res, check=args.check if first else 0)
        if "failed" in res:
            raise CheckFailed(res["failed"])
        if rank == 0:
            print(f"  {system:9s} micro {micro:4d} fits: step {statistics.median(res['step_s']) * 1e3:.1f} ms, "
                  f"peak {res['peak_bytes'] / 2**30:.2f} GiB", flush=True)
        return res

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1.0 if ok else 0.0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return flag.item() == 1.0

    try:
        fits, first_oom = search_max_micro(trial, agree, args.micro, args.max_micro_cap, _free)
    finally:
        try:
            sysm.close()
        except Exception as exc:  # noqa: BLE001 - an engine left mid-step by the OOM: its tries stand
            out["close_error"] = f"{type(exc).__name__}: {exc}"[:200]
        del sysm
        _free()
    out.update(tries=fits, first_oom=first_oom)
    if fits and "losses" in fits[0]:
        out["losses"] = fits[0]["losses"]
    if not fits:
        out["failed"] = f"out of memory already at micro {args.micro}"
    return out


def _summary(system: str, runs: list[dict[str, Any]], micro: int, args: argparse.Namespace, world: int,
             nparams: int, flops_per_token: float, peak_flops: float) -> dict[str, Any]:
    """One row: median step of `runs` at `micro` -> tokens/s, per GPU, MFU, peak memory."""
    cuda = torch.cuda.is_available()
    step = statistics.median([b for r in runs for b in r["step_s"]])
    tps = world * micro * args.seq / step
    ring = sum(runs[0].get("bytes", {}).values())
    if system == "ddp" and "bytes" in runs[0]:  # computed: fp32 gradient buckets all-reduced
        ring = 2 * (world - 1) / world * 4 * nparams
    return {"model": args.model, "params": nparams, "world": world, "system": system,
            "stage": zero_stage(system.partition("@")[0]), "tokens_per_s": tps, "tokens_per_s_gpu": tps / world,
            "mfu": flops_per_token * tps / (world * peak_flops), "peak_gib": max(r["peak_bytes"] for r in runs) / 2**30,
            "ring_bytes": ring, "bytes": runs[0].get("bytes", {}), "step_ms": step * 1e3, "seq": args.seq,
            "micro": micro, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def _launch_self(nprocs: int) -> int:
    """This script again under torch.distributed.run with `nprocs` ranks on this host."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
           os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd)


def _max_micro_main(systems: list[str], args: argparse.Namespace, world: int, nparams: int,
                    flops_per_token: float, peak: float) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    reference: list[float] | None = None
    rows: list[tuple[str, dict[str, Any] | None, dict[str, Any]]] = []
    for system in systems:
        try:
            res = run_max_micro(system, args, world, reference)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next system
            res = {"system": system, "failed": f"{type(exc).__name__}: {exc}"[:400]}
            _free()
        if reference is None and "losses" in res:
            reference = res["losses"]
        row = None
        if res.get("tries"):
            best = res["tries"][-1]
            row = _summary(system, [best], best["micro"], args, world, nparams, flops_per_token, peak)
            row.update(max_micro=True, first_oom=res["first_oom"], build_s=res.get("build_s"),
                       check_rel=res["tries"][0].get("check_rel"), close_error=res.get("close_error"),
                       tries=[{"micro": t["micro"], "step_ms": statistics.median(t["step_s"]) * 1e3,
                               "peak_gib": t["peak_bytes"] / 2**30} for t in res["tries"]])
            if args.out and rank == 0:  # written as each system ends: a later crash keeps it
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
        rows.append((system, row, res))
        if rank == 0 and row is None:
            print(f"  {system:9s} FAILED: {res.get('failed')}", flush=True)
    if rank != 0:
        return
    print(f"\n{'system':10s}{'stage':>6s}{'max micro':>10s}{'tokens/s':>11s}{'/GPU':>9s}{'MFU':>7s}{'peak GiB':>10s}"
          f"{'OOM at':>8s}", flush=True)
    for system, row, res in rows:
        if row is None:
            print(f"{system:10s} FAILED: {res.get('failed')}")
            continue
        stage = "-" if row["stage"] is None else str(row["stage"])
        oom = "-" if row["first_oom"] is None else str(row["first_oom"])  # "-": --max_micro_cap reached
        print(f"{system:10s}{stage:>6s}{row['micro']:10d}{row['tokens_per_s']:11.0f}{row['tokens_per_s_gpu']:9.0f}"
              f"{row['mfu']:7.1%}{row['peak_gib']:10.2f}{oom:>8s}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.3B", choices=sorted(MODELS))
    ap.add_argument("--systems", default="ddp,fsdp2,dsc1,ds1,dsc2,ds2,dsc3,ds3")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--check", type=int, default=3, help="steps whose losses are compared first")
    ap.add_argument("--tol", type=float, default=2e-2, help="relative loss tolerance of the check")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=2, help="timed blocks per system and round")
    ap.add_argument("--rounds", type=int, default=2, help="times the whole sequence of systems is repeated")
    ap.add_argument("--peak_tflops", type=float, default=0.0, help="peak bf16 dense TFLOPS (default: by GPU)")
    ap.add_argument("--phases", action="store_true", help="also time forward / backward / step apart")
    ap.add_argument("--zero_extra", default="", help="JSON merged into zero_optimization of stages >= 1 (variants)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler of --steps steps per system (rank 0 prints)")
    ap.add_argument("--profile_unphased", action="store_true",
                    help="torch.profiler of --steps whole steps without phase syncs: device idle time and gaps")
    ap.add_argument("--out", default="", help="append one JSON line per system here (rank 0)")
    ap.add_argument("--report", default="", help="print the ratio tables of a --out file and exit")
    ap.add_argument("--nprocs", type=int, default=0, help="launch this many ranks here (without torchrun)")
    ap.add_argument("--max_micro", action="store_true",
                    help="per system, double the micro-batch from --micro until out of memory (one search per system)")
    ap.add_argument("--max_micro_cap", type=int, default=64, help="largest micro-batch --max_micro tries")
    ap.add_argument("--simulate_oom_above", type=int, default=0,
                    help="--max_micro smoke test without a GPU: a try above this micro raises OutOfMemoryError "
                         "after its forward")
    ap.add_argument("--pg_timeout", type=float, default=600.0,
                    help="seconds a collective may wait before the process group aborts the run")
    args = ap.parse_args()
    if args.report:
        from throughput_report import report

        report(args.report)
        return
    if args.nprocs and "RANK" not in os.environ:
        if args.nprocs < 1:
            ap.error(f"--nprocs must be >= 1, got {args.nprocs}")
        sys.exit(_launch_self(args.nprocs))
    import torch.distributed as dist

    if args.zero_extra:
        import throughput_systems

        throughput_systems.ZERO_EXTRA.update(json.loads(args.zero_extra))
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise SystemExit(f"local rank {local} needs GPU {local}; {torch.cuda.device_count()} visible "
                             f"(one rank per GPU: --nprocs / --nproc_per_node at most the GPU count)")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    nparams = sum(p.numel() for p in build_model(args.model, args.vocab, args.seq, "meta").parameters())
    shape = MODELS[args.model]
    flops_per_token = 6 * nparams + 12 * shape["n_layer"] * shape["n_embd"] * args.seq
    batches = make_batches(args, args.micro, rank, dev)
    peak = _peak_flops(args.peak_tflops)
    if rank == 0:
        import torch.cuda.nccl as nccl

        print(f"{torch.cuda.get_device_name() if cuda else 'CPU'} x {world}  torch {torch.__version__}  "
              f"NCCL {'.'.join(map(str, nccl.version())) if cuda else '-'}  GPT {args.model} "
              f"{nparams / 1e6:.0f}M params, seq {args.seq}, micro {args.micro}, bf16"
              + (f", max micro search up to {args.max_micro_cap}" if args.max_micro else ""), flush=True)
    systems = [s for s in args.systems.split(",") if s]
    if args.max_micro:
        _max_micro_main(systems, args, world, nparams, flops_per_token, peak)
        dist.barrier()
        dist.destroy_process_group()
        return
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    reference: list[float] | None = None
    for rnd in range(args.rounds):
        for system in systems:
            try:
                res = run_system(system, batches, args, world, reference, counted=rnd == 0)
            except Exception as exc:  # noqa: BLE001 - report and go on to the next system
                res = {"system": system, "failed": f"{type(exc).__name__}: {exc}"[:400]}
                if cuda:
                    torch.cuda.empty_cache()
            if reference is None and "losses" in res and "failed" not in res:
                reference = res["losses"]
            results[system].append(res)
            if rank == 0:
                msg = res.get("failed") or (f"step {statistics.median(res['step_s']) * 1e3:.1f} ms, "
                                            f"peak {res['peak_bytes'] / 2**30:.2f} GiB, build {res['build_s']:.1f} s, "
                                            f"check rel {res.get('check_rel', 0.0):.1e}, resident before "
                                            f"{res['resident_before'] / 2**30:.2f} GiB"
                                            + (f", phases {res['phases_ms']}" if "phases_ms" in res else ""))
                print(f"round {rnd} {system:9s} {msg}", flush=True)
    if rank == 0:
        print(f"\n{'system':10s}{'stage':>6s}{'tokens/s':>11s}{'/GPU':>9s}{'MFU':>7s}{'peak GiB':>10s}"
              f"{'ring MiB':>10s}", flush=True)
        for system, runs in results.items():
            ok = [r for r in runs if "failed" not in r]
            if not ok:
                print(f"{system:10s} FAILED: {runs[0].get('failed')}")
                continue
            row = _summary(system, ok, args.micro, args, world, nparams, flops_per_token, peak)
            stage = "-" if row["stage"] is None else str(row["stage"])
            print(f"{system:10s}{stage:>6s}{row['tokens_per_s']:11.0f}{row['tokens_per_s_gpu']:9.0f}{row['mfu']:7.1%}"
                  f"{row['peak_gib']:10.2f}{row['ring_bytes'] / 2**20:10.1f}", flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

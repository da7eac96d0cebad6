"""Model-parallel training throughput on the GPT family of benchmarks/train_throughput.py: pipeline
schedules (1F1B, interleaved, zero-bubble ZB-H1), MoE expert parallelism, AutoTP tensor parallelism
and Ulysses sequence parallelism, deepspeed_c side by side with the real DeepSpeed where it has the
feature (see parallel_systems.py for what each system is), in one script on the same ranks.

    torchrun --nproc_per_node 2 benchmarks/parallel_throughput.py --mode pipe|moe|tp|sp [sizes]
    for m in pipe moe tp sp; do torchrun --nproc_per_node 2 benchmarks/parallel_throughput.py --mode $m \
        --out /tmp/parallel.jsonl; done
    # CPU smoke run (gloo; the real DeepSpeed from a plain directory):
    PYTHONPATH=/tmp/ds_real:/tmp/ds_deps DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 \
        benchmarks/parallel_throughput.py --mode pipe --tiny

NCCL when CUDA is available (one GPU a rank), gloo on CPU. The real DeepSpeed is imported as
`deepspeed`; when it is missing (or `deepspeed` is deepspeed_c's alias) the script says why and runs
ours alone. Conventions as train_throughput.py: every system starts from the same weights and sees the
same batches; correctness first (the first `--check` losses -- sp: outputs -- of each system against
the first system's, bf16 tolerance; a system that disagrees is reported and not timed); each system
is built, checked, timed and freed in turn and `--rounds` repeats the sequence (interleaved
repetitions; the median block counts). Prints tokens/s, per GPU, MFU ((6 x params + 12 x layers x
width x sequence) x tokens / time / peak bf16 dense; MoE: active parameters), the largest rank's peak
allocated memory and the ratios against DeepSpeed's and the mode's first system; `--out` appends one
JSON line per system.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throughput_systems import MODELS  # noqa: E402
from train_throughput import _peak_flops, _sync  # noqa: E402

# sized for 2 x H100 80GB, about a minute a mode (DeepSpeed's JIT builds aside); --model picks a shape
# of train_throughput's GPT table (n_embd, n_layer, n_head), --width/--layers/--heads override it
DEFAULTS = {
    "pipe": dict(model="1.3B", seq=2048, micro=2, gas=4),
    "moe": dict(model="350M", seq=2048, micro=4),
    "tp": dict(model="1.3B", seq=2048, micro=4),
    "sp": dict(model="1.3B", layers=8, seq=16384, micro=1),
}
TINY = dict(model="tiny", layers=4, seq=32, micro=2, gas=4)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", required=True, choices=sorted(DEFAULTS))
    ap.add_argument("--systems", default="", help="comma list (default: every system of the mode)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU smoke run)")
    ap.add_argument("--model", default="", choices=[""] + sorted(MODELS), help="GPT shape (default: by mode)")
    for key in ("width", "layers", "heads", "seq", "micro"):
        ap.add_argument(f"--{key}", type=int, default=0, help="default: by mode (see DEFAULTS)")
    ap.add_argument("--gas", type=int, default=0, help="pipe: micro-batches per train_batch")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--kv_heads", type=int, default=0, help="tp: key/value heads (default: heads)")
    ap.add_argument("--experts", type=int, default=0, help="moe: experts (default 2 x world)")
    ap.add_argument("--k", type=int, default=1, choices=[1, 2], help="moe: experts a token goes to")
    ap.add_argument("--capacity_factor", type=float, default=1.25)
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="ZeRO stage of the engines")
    ap.add_argument("--dtype", default="", choices=["", "bf16", "fp32"], help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--check", type=int, default=2, help="steps whose losses are compared first")
    ap.add_argument("--tol", type=float, default=0.0, help="relative tolerance (default 3e-2 bf16, 1e-3 fp32)")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=2, help="timed blocks per system and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peak_tflops", type=float, default=0.0, help="peak bf16 dense TFLOPS (default: by GPU)")
    ap.add_argument("--out", default="", help="append one JSON line per system here (rank 0)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after timing, this many steps of each system under torch.profiler (see throughput_profile)")
    ap.add_argument("--profile_ranks", default="", help="comma list of ranks that print profiles (default: first, last)")
    args = ap.parse_args()
    sizes = {"gas": 1, **DEFAULTS[args.mode], **(TINY if args.tiny else {})}
    args.model = args.model or sizes.pop("model")
    sizes.pop("model", None)
    shape = MODELS[args.model]
    sizes.update({"width": shape["n_embd"], "heads": shape["n_head"], "layers": sizes.get("layers", shape["n_layer"])})
    if args.tiny:
        args.vocab = 512
    for key, val in sizes.items():
        if not getattr(args, key):
            setattr(args, key, val)
    args.kv_heads = args.kv_heads or args.heads
    args.dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    args.tol = args.tol or (3e-2 if args.dtype == "bf16" else 1e-3)
    return args


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float().cpu(), ref.float().cpu()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def run_system(name: str, mode: Any, args: argparse.Namespace, reference: list | None) -> dict[str, Any]:
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    runner = mode.build(name)
    out: dict[str, Any] = {"system": name, "build_s": time.perf_counter() - t0}
    try:
        results = [runner.step(k) for k in range(args.check)]
        out["losses"] = [r.float().item() if r.numel() == 1 else float("nan") for r in results]
        out["results"] = [r.detach().cpu() for r in results]
        if reference is not None:
            rel = max(_rel(a, b) for a, b in zip(results, reference))
            flag = torch.tensor([rel], dtype=torch.float64, device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the worst rank decides
            out["check_rel"] = flag.item()
            if flag.item() > args.tol:
                out["failed"] = f"check: rel {flag.item():.2e} > {args.tol} (losses {out['losses']})"
                return out
        blocks, k = [], args.check
        for _ in range(args.blocks):
            _sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner.step(k)
                k += 1
            _sync()
            blocks.append((time.perf_counter() - t0) / args.steps)
        t = torch.tensor(blocks, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        out["step_s"] = t.tolist()
        peak = torch.tensor([torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0], dtype=torch.float64,
                            device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out["peak_bytes"] = peak.item()
        if args.profile:
            from throughput_profile import profile_steps

            world = dist.get_world_size()
            printing = ([int(r) for r in args.profile_ranks.split(",")] if args.profile_ranks
                        else sorted({0, world - 1}))
            profile_steps(runner.step, k, args.profile, dist.get_rank(), name, dist.get_rank() in printing)
    finally:
        runner.close()
        del runner
    return out


def main() -> None:
    args = parse()
    import torch.distributed as dist

    from parallel_systems import MODES, real_deepspeed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True
    mode = MODES[args.mode](args, world)
    systems = [s for s in (args.systems.split(",") if args.systems else mode.systems) if s]
    unknown = [s for s in systems if s not in mode.systems]
    if unknown:
        raise ValueError(f"--systems {unknown}: mode {args.mode} has {mode.systems}")
    ds, why = real_deepspeed()
    if ds is None:
        systems = [s for s in systems if not s.startswith("ds-")]
    peak = _peak_flops(args.peak_tflops)
    if rank == 0:
        import torch.cuda.nccl as nccl

        print(f"{torch.cuda.get_device_name() if cuda else 'CPU'} x {world}  torch {torch.__version__}  NCCL "
              f"{'.'.join(map(str, nccl.version())) if cuda else '- (gloo)'}  DeepSpeed "
              f"{ds.__version__ if ds is not None else 'absent: ' + why}\nmode {args.mode} ({args.model} shape): "
              f"{mode.describe}, "
              f"{args.dtype}", flush=True)
        for note in mode.notes:
            print(f"  note: {note}")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    reference: list | None = None
    for rnd in range(args.rounds):
        for name in systems:
            try:
                res = run_system(name, mode, args, reference)
            except Exception as exc:  # noqa: BLE001 - report and go on to the next system
                res = {"system": name, "failed": f"{type(exc).__name__}: {exc}"[:600]}
                if cuda:
                    torch.cuda.empty_cache()
            if reference is None and "results" in res and "failed" not in res:
                reference = res["results"]
            res.pop("results", None)
            results[name].append(res)
            if rank == 0:
                msg = res.get("failed") or (f"step {statistics.median(res['step_s']) * 1e3:.1f} ms, peak "
                                            f"{res['peak_bytes'] / 2**30:.2f} GiB, build {res['build_s']:.1f} s, "
                                            f"check rel {res.get('check_rel', 0.0):.1e}"
                                            + "".join(f", loss {x:.5f}" for x in res["losses"] if x == x))
                print(f"round {rnd} {name:16s} {msg}", flush=True)
    if rank == 0:
        report(args, mode, results, world, peak, cuda)
    dist.barrier()
    dist.destroy_process_group()


def report(args: argparse.Namespace, mode: Any, results: dict, world: int, peak: float, cuda: bool) -> None:
    rows = {}
    for name, runs in results.items():
        ok = [r for r in runs if "failed" not in r]
        if ok:
            step = statistics.median([b for r in ok for b in r["step_s"]])
            gpus = mode.gpus.get(name, world)
            tps = mode.tokens_per_step / step
            rows[name] = {"mode": args.mode, "system": name, "world": world, "gpus": gpus, "tokens_per_s": tps,
                          "tokens_per_s_gpu": tps / gpus, "mfu": mode.flops_per_token * tps / (gpus * peak),
                          "peak_gib": max(r["peak_bytes"] for r in ok) / 2**30, "step_ms": step * 1e3,
                          "check_rel": ok[0].get("check_rel", 0.0), "dtype": args.dtype,
                          "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    first = next(iter(results))
    ds_name = next((n for n in results if n.startswith("ds-")), None)
    print(f"\n{'system':18s}{'tokens/s':>11s}{'/GPU':>9s}{'MFU':>7s}{'peak GiB':>10s}{'step ms':>10s}"
          f"{'vs ' + first:>22s}{'vs DeepSpeed':>14s}")
    for name, runs in results.items():
        if name not in rows:
            print(f"{name:18s} FAILED: {runs[0].get('failed')}")
            continue
        r = rows[name]
        vs_first = f"{r['tokens_per_s'] / rows[first]['tokens_per_s']:.2f}x" if first in rows else "-"
        vs_ds = f"{r['tokens_per_s'] / rows[ds_name]['tokens_per_s']:.2f}x" if ds_name in rows else "-"
        print(f"{name:18s}{r['tokens_per_s']:11.0f}{r['tokens_per_s_gpu']:9.0f}{r['mfu']:7.1%}{r['peak_gib']:10.2f}"
              f"{r['step_ms']:10.1f}{vs_first:>22s}{vs_ds:>14s}", flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(r) + "\n")
    if not cuda:
        print("(CPU/gloo: a proof that the modes run, not a timing)")


if __name__ == "__main__":
    main()

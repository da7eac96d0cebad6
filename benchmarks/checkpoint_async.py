"""Asynchronous checkpoint writers (issue 51) on one GPU: how long save_checkpoint blocks training with
`checkpoint.writer` python / fast against the synchronous save of the same engine, how much the steps that
run while the background write is going slow down, and the real DeepSpeed 0.19.8 with its own writer
(`checkpoint.writer: {type: fast}`) on the same model and config, side by side in one process.

Systems (`--systems`, comma separated):
- ``sync``: deepspeed_c without a writer (save_checkpoint writes, fsyncs and commits before returning).
- ``python`` / ``fast`` / ``mock``: deepspeed_c with `checkpoint.writer.type` set: save_checkpoint stages the
  tensors into host memory and returns; training steps run while the writer thread is alive (at most
  `--max_write_steps`), then engine.checkpoint_commit() waits for the write and commits it.
- ``ds_sync``, ``ds_fast``, ``ds_python``, ``ds_fast_decoupled``...: the real DeepSpeed with no writer / that
  writer type (`_decoupled`: DeepSpeed's background writer process, committed inside the next step). Needs
  the real DeepSpeed importable as `deepspeed` (PYTHONPATH=/tmp/ds_real, see scripts/device_deepspeed.sh);
  with deepspeed_c's compat alias or none, the ds systems are skipped with the reason printed.

Correctness first: for every system with a writer, a save is taken, two training steps change the live
tensors while it is written, the save is committed, and a fresh engine (same config, no writer) loads it:
its bf16 weights, fp32 masters and Adam moments must equal, bit for bit, the saved engine's at save time
(snapshotted on the host before the save). A mismatch is reported and that system is not timed.

Then `--reps` interleaved repetitions over the systems, each: `--steps` steps without a write (baseline),
the save (blocked = save_checkpoint's wall time, device synchronised), the steps during the background
write (ours: while the writer thread is alive; DeepSpeed: the next `--steps` steps), the commit. Every step
is synchronised and timed alone. Prints a table of medians and the ratios against the synchronous save of
the same library (blocked / sync save) and the step slowdown (median step during the write / median
baseline step; also mean and the first step after the save); one JSON line per system and rep plus one
summary line per system to `--out`. Each committed checkpoint is deleted before the next save (a 1.3B
ZeRO checkpoint is ~18 GB), and `--dir` (default a fresh directory under /tmp) is removed at the end.

    PYTHONPATH=/tmp/ds_real python benchmarks/checkpoint_async.py --model 1.3B --reps 3 --out /tmp/ckpt.jsonl
    python benchmarks/checkpoint_async.py --tiny          # CPU smoke run (tiny GPT, 2 reps)
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throughput_systems import MODELS, build_model, ds_config  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def real_deepspeed() -> tuple[Optional[Any], str]:
    """The real DeepSpeed module, or None and why not."""
    try:
        import deepspeed
    except ImportError as e:
        return None, f"`import deepspeed` fails ({e}); run with PYTHONPATH=/tmp/ds_real"
    init_mod = getattr(getattr(deepspeed, "initialize", None), "__module__", "") or ""
    if init_mod.startswith("deepspeed_c") or "deepspeed_c" in (getattr(deepspeed, "__file__", "") or "") \
            or "dsc" in str(getattr(deepspeed, "__version__", "")):
        return None, f"`import deepspeed` is deepspeed_c's compat alias ({getattr(deepspeed, '__version__', '?')}), " \
                     "not the real DeepSpeed; run with PYTHONPATH=/tmp/ds_real"
    return deepspeed, ""


class Bench:
    """One system: an engine of `lib` with `writer` (None: synchronous saves) and its measurements."""

    def __init__(self, name: str, lib: Any, writer: Optional[dict], base: torch.nn.Module,
                 args: argparse.Namespace, root: str) -> None:
        self.name, self.lib, self.writer, self.args = name, lib, writer, args
        self.ours = name.split("_")[0] != "ds"
        self.decoupled = bool(writer and writer.get("decoupled"))
        self.dir = os.path.join(root, name)
        self.engine = self._engine(base, writer)
        self.k = 0

    def config(self, writer: Optional[dict]) -> dict:
        cfg = ds_config(f"dsc{self.args.stage}", self.args.micro)
        if writer is not None:
            cfg["checkpoint"] = {"writer": dict(writer)}
        return cfg

    def _engine(self, base: torch.nn.Module, writer: Optional[dict]) -> Any:
        model = copy.deepcopy(base)
        engine, *_ = self.lib.initialize(model=model, model_parameters=model.parameters(), config=self.config(writer))
        return engine

    def step(self, batches: list) -> float:
        x, y = batches[self.k % len(batches)]
        self.k += 1
        _sync()
        t0 = time.perf_counter()
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        _sync()
        return time.perf_counter() - t0

    def writing(self) -> bool:
        """Our writer thread is still writing the last save."""
        thread = getattr(getattr(self.engine.checkpointer, "writer", None), "_thread", None)
        return thread is not None and thread.is_alive()

    def commit(self) -> None:
        if self.ours:
            self.engine.checkpoint_commit()

    def state(self) -> dict[str, list[torch.Tensor]]:
        """Every parameter's bf16 weight, fp32 master and Adam moments, copied to the host."""
        utils = self.lib.utils
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if callable(link) and not self.ours:
            # DeepSpeed links each parameter to its Adam moments lazily, at its first step: a freshly loaded
            # engine (no step yet) is linked here so its loaded moments can be read
            link()
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        out: dict[str, list[torch.Tensor]] = {"weight": [p.detach().to("cpu", copy=True) for p in params],
                                              "fp32": [utils.safe_get_full_fp32_param(p).to("cpu", copy=True)
                                                       for p in params]}
        for key in MOMENTS:
            out[key] = [utils.safe_get_full_optimizer_state(p, key).to("cpu", copy=True) for p in params]
        return out

    def check(self, base: torch.nn.Module, batches: list) -> Optional[str]:
        """Save with the writer while two steps change the live tensors, commit, load into a fresh engine:
        None when every tensor is bitwise the saved engine's at save time, else what differs."""
        for _ in range(2):
            self.step(batches)
        want = self.state()
        self.engine.save_checkpoint(self.dir, tag="check")
        for _ in range(2):
            self.step(batches)
        self.commit()
        fresh = Bench.__new__(Bench)
        fresh.lib, fresh.args, fresh.ours = self.lib, self.args, self.ours
        fresh.engine = fresh._engine(base, None)
        try:
            path, _ = fresh.engine.load_checkpoint(self.dir, tag="check")
            if path is None:
                return f"load_checkpoint({self.dir!r}, 'check') found no checkpoint"
            got = fresh.state()
        finally:
            _close(fresh.engine)
            fresh.engine = None
        shutil.rmtree(os.path.join(self.dir, "check"), ignore_errors=True)
        bad = [f"{key}[{i}]" for key in want for i, (a, b) in enumerate(zip(want[key], got[key]))
               if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)]
        if bad:
            return f"{len(bad)} tensors differ from the saved engine's, first {bad[:5]}"
        return None

    def rep(self, rep: int, batches: list) -> dict[str, Any]:
        args = self.args
        base = [self.step(batches) for _ in range(args.steps)]
        tag = f"rep{rep}"
        _sync()
        t0 = time.perf_counter()
        self.engine.save_checkpoint(self.dir, tag=tag)
        _sync()
        blocked = time.perf_counter() - t0
        during: list[float] = []
        if self.ours and self.writer is not None:
            while (not during or self.writing()) and len(during) < args.max_write_steps:
                during.append(self.step(batches))
            still = self.writing()
        else:  # DeepSpeed: no handle on its writer; the next steps (a decoupled save commits in the first)
            during = [self.step(batches) for _ in range(args.steps)]
            still = False
        t1 = time.perf_counter()
        self.commit()
        commit_call = time.perf_counter() - t1
        done = time.perf_counter() - t0
        shutil.rmtree(os.path.join(self.dir, tag), ignore_errors=True)
        med_base = statistics.median(base)
        return {"system": self.name, "rep": rep, "blocked_s": blocked, "commit_call_s": commit_call,
                "save_to_commit_s": done if self.writer is not None and self.ours else blocked,
                "baseline_steps_s": base, "during_steps_s": during, "write_outlasted_steps": still,
                "baseline_median_s": med_base, "during_median_s": statistics.median(during),
                "slowdown_median": statistics.median(during) / med_base,
                "slowdown_mean": statistics.fmean(during) / statistics.fmean(base),
                "first_step_ratio": during[0] / med_base}


def _close(engine: Any) -> None:
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def parse_system(name: str, real: Optional[Any]) -> tuple[Any, Optional[dict], str]:
    """(library, writer section or None, reason to skip or "")."""
    ds = name.startswith("ds_")
    kind = name[3:] if ds else name
    decoupled = kind.endswith("_decoupled")
    kind = kind.removesuffix("_decoupled")
    if kind not in ("sync", "python", "fast", "mock"):
        raise ValueError(f"--systems: unknown system {name!r} (sync, python, fast, mock, ds_<one of those>, "
                         "ds_<writer>_decoupled)")
    # data_parallel "replica" on both: DeepSpeed 0.19.8 without it and without an mpu reads
    # UniversalParallelInfo.dp_rank, which does not exist (AttributeError at initialize)
    writer = None if kind == "sync" else {"type": kind, "data_parallel": "replica",
                                          **({"decoupled": True} if decoupled else {})}
    if ds:
        return real, writer, "" if real is not None else "no real DeepSpeed"
    import deepspeed_c
    return deepspeed_c, writer, ""


def summarise(name: str, rows: list[dict]) -> dict[str, Any]:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"system": name, "summary": True, "reps": len(rows), "blocked_s": med("blocked_s"),
            "save_to_commit_s": med("save_to_commit_s"), "commit_call_s": med("commit_call_s"),
            "baseline_median_s": med("baseline_median_s"), "during_median_s": med("during_median_s"),
            "slowdown_median": med("slowdown_median"), "slowdown_mean": med("slowdown_mean"),
            "first_step_ratio": med("first_step_ratio"),
            "steps_during_write": statistics.median(len(r["during_steps_s"]) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.3B", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--stage", type=int, default=1, choices=(1, 2))
    ap.add_argument("--systems", default="sync,python,fast,ds_fast",
                    help="also ds_sync, ds_python, mock, ds_<writer>_decoupled (every engine stays resident)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="baseline steps per rep (and DeepSpeed's steps after a save)")
    ap.add_argument("--max_write_steps", type=int, default=400, help="steps at most while one background write runs")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a fresh one under /tmp); removed")
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument("--check", default="all", choices=("all", "ours"),
                    help="which systems' saves are reloaded bit for bit before timing (ours: not DeepSpeed's)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny GPT, seq 64, 2 reps, 3 steps")
    args = ap.parse_args()
    if args.tiny:
        args.model, args.seq, args.vocab, args.reps, args.steps = "tiny", 64, 256, 2, 3
        args.max_write_steps = min(args.max_write_steps, 20)
    if args.reps < 1 or args.steps < 1:
        raise ValueError("--reps and --steps must be at least 1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    # CROSS_*/LOCAL_SIZE: what DeepSpeed's launcher sets; its checkpoint writers read them (one machine here)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                       ("CROSS_RANK", "0"), ("CROSS_SIZE", "1")):
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        sys.exit("needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    real, why = real_deepspeed()
    import deepspeed_c

    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}  torch {torch.__version__}  deepspeed_c "
          f"{deepspeed_c.__version__}  DeepSpeed {real.__version__ if real is not None else '-- (' + why + ')'}",
          flush=True)
    torch.manual_seed(0)
    base = build_model(args.model, args.vocab, args.seq)
    nparams = sum(p.numel() for p in base.parameters())
    print(f"GPT {args.model} {nparams / 1e6:.1f}M params, seq {args.seq}, micro {args.micro}, bf16, ZeRO stage "
          f"{args.stage}, AdamW, world 1", flush=True)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).to(dev),
                torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).to(dev)) for _ in range(4)]
    root = args.dir or tempfile.mkdtemp(prefix="dsc_ckpt_async_", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    out = open(args.out, "a") if args.out else None
    benches: list[Bench] = []
    try:
        # correctness first, one system at a time (its engine and the fresh one that loads its save are the only
        # ones resident: a 1.3B engine holds ~21 GB), then the systems that passed are rebuilt side by side
        passed: list[tuple[str, Any, Optional[dict]]] = []
        for name in [s.strip() for s in args.systems.split(",") if s.strip()]:
            lib, writer, skip = parse_system(name, real)
            if skip:
                print(f"{name:18s} skipped: {why}", flush=True)
                continue
            try:
                bench = Bench(name, lib, writer, base, args, root)
            except Exception as e:  # noqa: BLE001 (DeepSpeed's fast writer needs its async_io op built)
                print(f"{name:18s} skipped: the engine did not build: {type(e).__name__}: {e}", flush=True)
                continue
            err = None
            if writer is not None and name.startswith("ds_") and args.check == "ours":
                print(f"{name:18s} correctness: not checked (--check ours: the competitor's own writer)", flush=True)
            elif writer is not None and writer["type"] != "mock":
                t0 = time.perf_counter()
                try:
                    err = bench.check(base, batches)
                except Exception as e:  # noqa: BLE001 (DeepSpeed's decoupled writer cannot queue its ZeRO files)
                    err = f"the save/commit/load raised {type(e).__name__}: {e}"
                if err is None:
                    print(f"{name:18s} correctness: the committed background save loads bit-identical (weights, "
                          f"fp32 masters, Adam moments) in a fresh engine ({time.perf_counter() - t0:.1f}s)",
                          flush=True)
                else:
                    print(f"{name:18s} FAILED the correctness check, not timed: {err}", flush=True)
                    if out:
                        out.write(json.dumps({"system": name, "failed": err}) + "\n")
            _close(bench.engine)
            del bench
            if err is None:
                passed.append((name, lib, writer))
        for name, lib, writer in passed:
            benches.append(Bench(name, lib, writer, base, args, root))
            for _ in range(2):  # warm-up (kernels, allocator) outside the timed reps
                benches[-1].step(batches)
        rows: dict[str, list[dict]] = {b.name: [] for b in benches}
        for rep in range(args.reps):
            for b in list(benches):
                try:
                    row = b.rep(rep, batches)
                except Exception as e:  # noqa: BLE001 (reported, the others go on)
                    print(f"rep {rep} {b.name:18s} raised {type(e).__name__}: {e}; dropped", flush=True)
                    benches.remove(b)
                    _close(b.engine)
                    continue
                rows[b.name].append(row)
                if out:
                    out.write(json.dumps({**row, "model": args.model, "params": nparams}) + "\n")
                print(f"rep {rep} {b.name:18s} blocked {row['blocked_s']:8.3f}s  save->commit "
                      f"{row['save_to_commit_s']:8.3f}s  steps during write/after save {len(row['during_steps_s']):3d} "
                      f"x {row['during_median_s'] * 1e3:8.1f} ms vs {row['baseline_median_s'] * 1e3:8.1f} ms",
                      flush=True)
        report(rows, args, nparams, out)
    finally:
        for b in benches:
            _close(b.engine)
        if out:
            out.close()
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


def report(rows: dict[str, list[dict]], args: argparse.Namespace, nparams: int, out: Any) -> None:
    sums = {name: summarise(name, r) for name, r in rows.items() if r}
    print(f"\nmedians over {args.reps} reps ({args.model}, {nparams / 1e6:.0f}M params)")
    print(f"{'system':18s} {'blocked s':>10s} {'save->commit s':>15s} {'step ms':>9s} {'during ms':>10s} "
          f"{'steps':>6s} {'blocked/sync':>13s} {'slowdown med':>13s} {'mean':>7s} {'1st step':>9s}")
    for name, s in sums.items():
        sync = sums.get("ds_sync" if name.startswith("ds_") else "sync")
        ratio = s["blocked_s"] / sync["blocked_s"] if sync else float("nan")
        s["blocked_over_sync"] = ratio
        print(f"{name:18s} {s['blocked_s']:10.3f} {s['save_to_commit_s']:15.3f} {s['baseline_median_s'] * 1e3:9.1f} "
              f"{s['during_median_s'] * 1e3:10.1f} {s['steps_during_write']:6.0f} {ratio:13.3f} "
              f"{s['slowdown_median']:13.3f} {s['slowdown_mean']:7.3f} {s['first_step_ratio']:9.3f}")
        if out:
            out.write(json.dumps({**s, "model": args.model, "params": nparams, "seq": args.seq, "micro": args.micro,
                                  "stage": args.stage}) + "\n")
    if "sync" in sums:
        print("\nbar (issue 51): blocked <= 0.10 x our synchronous save; median step during the write <= 1.05 x")
        for name in ("python", "fast"):
            if name in sums:
                s = sums[name]
                ok = s["blocked_over_sync"] <= 0.10 and s["slowdown_median"] <= 1.05
                print(f"  {name:8s} blocked/sync {s['blocked_over_sync']:.3f}  slowdown {s['slowdown_median']:.3f}  "
                      f"{'meets' if ok else 'misses'} the bar")
        for name in ("ds_fast", "ds_fast_decoupled"):
            if name in sums:
                print(f"  {name} blocked {sums[name]['blocked_s']:.3f}s = {sums[name]['blocked_s'] / sums['sync']['blocked_s']:.3f} x our "
                      f"synchronous save")


if __name__ == "__main__":
    main()

"""The seeds' one-GPU records with CPU offload, ours (deepspeed_c) against the real DeepSpeed 0.19.8 on the
identical JSON: a GPT of a given size trained on one GPU with ZeRO-Offload (`--mode zero2`: stage 2 +
offload_optimizer cpu), ZeRO-3 offload (`--mode zero3`: stage 3 + offload_param and offload_optimizer cpu) or
ZeRO-Infinity (`--mode zero3nvme`: both offloaded to NVMe swap files under --nvme_path/<system>, every parameter
on the disk (max_in_cpu 0), swap buffers as large as the largest weight, the `aio` section from --aio; the folder
is emptied after each run), bf16, AdamW (each system's CPU Adam), gradient clipping 1.0, micro-batch --micro x --seq random tokens.

1. Correctness first (`--check`, one process, both systems): a small GPT built once, each engine given a deep copy
   of the same weights and the same batches (two, alternating, lr 1e-3); their losses over --check_steps steps must
   agree within bf16 tolerance (2e-2 relative; fp32 on a CPU-only run: 1e-4) and the first batch's loss must fall by
   more than that tolerance (an optimizer that did not step fails), else this exits 1 and nothing is timed.
2. Then each system trains the given size in its own process (their host memory must not add up): the model built
   lean (zero2: straight on the GPU in bf16; zero3: under each system's zero.Init, never whole anywhere), then
   initialize (where the pinned host buffers are made: the slow part of init), --warmup untimed steps, --steps
   timed ones (synchronised each). One JSON line per run (also appended to --out), then a table: build and init
   seconds, first-step seconds (the optimizer state's host memory is first touched there), s/step (median),
   tokens/s, peak host RSS and its bytes per parameter, peak GPU memory (allocated / reserved), the first loss
   (both systems build from the same seed), the largest size each mode trained (ours; both), and per size
   ours/DeepSpeed's tokens/s. A run past its limit (--budget, --timeout) is killed with its
   process group and reported as such; a SIGTERM to this script (an outer `timeout`) kills the running child
   first, so no orphan keeps tens of GiB of pinned host memory.

The host memory our ZeRO-Offload (zero2) needs is printed before the runs: fp32 masters (pinned), bf16 gradient
staging (pinned), bf16 step results for the copy back (pinned), each one flat tensor page-locked at exactly its size
(deepspeed_c/accelerator/host_memory.py), plus two fp32 Adam moments (pageable, made at the first step): 16 bytes a
parameter (6.86B: 102 GiB; 13.1B: 195 GiB). With torch's pinned allocator (DSC_EXACT_PINNED=0), which rounds each
block up to a power of two, 18.0 / 18.5 bytes (115 / 226 GiB).

    python benchmarks/offload_largest.py --check --mode zero2,zero3 --impls dsc,ds     # correctness, small GPT
    python benchmarks/offload_largest.py --size 6.7B --mode zero2 --impls dsc,ds --out /tmp/ol.jsonl
    python benchmarks/offload_largest.py --report /tmp/ol.jsonl                          # one table of every run
    python benchmarks/offload_largest.py --tiny --check --size tiny --impls dsc,ds       # CPU smoke (gloo, fp32)

The real DeepSpeed must be importable as `deepspeed` (scripts/device_deepspeed.sh puts it in /tmp/ds_real; on a
CPU-only host also DS_ACCELERATOR=cpu and its dependencies on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "[offload_largest]"
# GPT-3's shapes (n_embd, n_layer, n_head); with vocab 50304 and seq 1024: 6.86B and 13.1B parameters
SIZES = {"tiny": (64, 2, 2), "small": (256, 4, 4), "350M": (1024, 24, 16), "760M": (1536, 24, 16), "1.3B": (2048, 24, 16), "2.7B": (2560, 32, 32),
         "6.7B": (4096, 32, 32), "13B": (5120, 40, 40), "20B": (6144, 44, 48)}
NAMES = {"dsc": "deepspeed_c", "ds": "DeepSpeed"}


def nparams(n_embd: int, n_layer: int, vocab: int, seq: int) -> int:
    """examples/train_gpt's GPT: token and position embeddings, an untied head, per block 12 d^2 + 13 d."""
    return (2 * vocab + seq) * n_embd + n_layer * (12 * n_embd ** 2 + 13 * n_embd) + 2 * n_embd


def pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def host_plan(params: int) -> dict[str, float]:
    """GiB of host memory our ZeRO-Offload (stage 2, one param group, bf16) allocates: offload.CPUOffload's
    buffers and the CPU Adam's moments: exact (our page-locked buffers), and with torch's pinned allocator's
    power-of-two rounding (what they took before, and again with DSC_EXACT_PINNED=0)."""
    g = 2.0 ** 30
    pinned = {"fp32 masters": 4 * params, "bf16 grad staging": 2 * params, "bf16 step results": 2 * params}
    exact = sum(pinned.values()) + 8 * params
    rounded = sum(pow2(b) for b in pinned.values()) + 8 * params
    return {"exact_gib": exact / g, "rounded_gib": rounded / g, "bytes_per_param_rounded": rounded / params}


def meminfo() -> dict[str, float]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) / 2**20
    except OSError:
        pass
    return out


MODES = ("zero2", "zero3", "zero3nvme")


def swap_dir(args: argparse.Namespace, impl: str) -> str:
    return os.path.join(args.nvme_path, impl)


def config(args: argparse.Namespace, mode: str, cuda: bool, impl: str = "dsc") -> dict:
    offload: dict[str, Any] = {"device": "cpu", "pin_memory": cuda}
    if mode == "zero3nvme":
        offload = {"device": "nvme", "pin_memory": cuda, "nvme_path": swap_dir(args, impl)}
    zero: dict[str, Any] = {"stage": 2 if mode == "zero2" else 3, "offload_optimizer": dict(offload)}
    if mode == "zero2":
        zero.update(reduce_bucket_size=int(args.bucket), allgather_bucket_size=int(args.bucket), overlap_comm=True,
                    contiguous_gradients=True)
    else:
        zero["offload_param"] = dict(offload)
    if mode == "zero3nvme":  # every parameter on the disk; a swap buffer holds the largest weight (the embedding);
        # 16 buffers: with DeepSpeed's default 5 its prefetch runs out of them in the second step ("Not enough
        # buffers 0 for swapping 1"), as DeepSpeed users then tune it
        zero["offload_param"].update(max_in_cpu=0, buffer_size=max(int(1e8), args.vocab * args.n_embd),
                                     buffer_count=16)
    if args.prefetch_bucket >= 0:  # DeepSpeed's stage3_prefetch_bucket_size (its default 5e7 when unset)
        zero["stage3_prefetch_bucket_size"] = int(args.prefetch_bucket)
    if args.reuse_distance >= 0:  # stage3_max_reuse_distance: 0 releases (and unswaps) every weight after its use;
        # DeepSpeed's default 1e9 keeps weights the trace says come back, each holding an NVMe swap buffer
        zero["stage3_max_reuse_distance"] = int(args.reuse_distance)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
           "zero_optimization": zero}
    if cuda:
        cfg["bf16"] = {"enabled": True}
    if mode == "zero3nvme":
        cfg["aio"] = json.loads(args.aio)
    return cfg


def say(msg: str, t0: float) -> None:
    """A progress line: UTC clock and seconds since `t0` (time.time() of the parent's start)."""
    print(f"{TAG} {time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - t0:6.1f}s {msg}", flush=True)


# -- child side: one process ------------------------------------------------------------------------------
def load_lib(impl: str) -> Any:
    if impl == "dsc":
        import deepspeed_c

        return deepspeed_c
    import deepspeed  # the competitor: must not be deepspeed_c's compat alias

    where = str(getattr(deepspeed, "__path__", ""))
    if "dsc" in str(getattr(deepspeed, "__version__", "dsc")) or "deepspeed_c" in where:
        raise RuntimeError(f"`deepspeed` is {where}, not the real DeepSpeed (source "
                           "scripts/device_deepspeed.sh)")
    return deepspeed


def setup(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))
    cuda = torch.cuda.is_available() and not args.tiny
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(args.port)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    return torch, torch.device("cuda" if cuda else "cpu")


def batches(args: argparse.Namespace, n: int, dev: Any) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous().to(dev), idx[:, 1:].contiguous().to(dev)))
    return out


def train_step(engine: Any, x: Any, y: Any) -> float:
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def check_child(args: argparse.Namespace) -> None:
    """Both systems in this process, the same weights (deep copies of one model) and batches, per mode. Two
    batches alternate at lr 1e-3 (vocab at most 1024) so the loss on the first batch falls by more than the
    tolerance: an optimizer that did not step would not pass."""
    t0 = args.t0
    args.lr, args.vocab = 1e-3, min(args.vocab, 1024)
    torch, dev = setup(args)
    from model import GPT, GPTConfig

    cuda = dev.type == "cuda"
    impls = args.impls.split(",")
    libs = {i: load_lib(i) for i in impls}
    torch.manual_seed(0)
    with torch.device(dev):
        base = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                             n_embd=args.n_embd))
    data = batches(args, 2, dev)
    data = [data[i % 2] for i in range(args.check_steps)]
    tol = 2e-2 if cuda else 1e-4
    for mode in args.mode.split(","):
        losses = {}
        for impl in impls:
            model = copy.deepcopy(base)
            engine, *_ = libs[impl].initialize(model=model, model_parameters=model.parameters(),
                                               config=config(args, mode, cuda, impl))
            losses[impl] = [train_step(engine, x, y) for x, y in data]
            if hasattr(engine, "destroy"):
                engine.destroy()
            del engine, model
        ref = losses[impls[0]]
        rel = max((abs(a - b) / abs(b) for i in impls[1:] for a, b in zip(losses[i], ref)), default=0.0)
        k = (len(data) - 1) // 2 * 2  # the last step on the first batch
        drop = min((ls[0] - ls[k]) / ls[0] for ls in losses.values())
        ok = all(v == v for ls in losses.values() for v in ls) and rel <= tol and drop > tol
        print("CHECK " + json.dumps({"mode": mode, "losses": losses, "max_rel": rel, "tol": tol, "drop": drop,
                                     "ok": ok,
                                     "dtype": "bf16" if cuda else "fp32"}), flush=True)
        say(f"check {mode}: " + "; ".join(f"{NAMES[i]} {', '.join(f'{v:.5f}' for v in ls)}"
                                          for i, ls in losses.items()) + f"  max rel {rel:.2e} (tol {tol:g}), "
            f"loss fell {100 * drop:.1f}%", t0)
    dist_destroy()


def dist_destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_child(args: argparse.Namespace) -> None:
    """One system, one size: lean build, initialize, warm-up and timed steps; prints RESULT <json>."""
    t0 = args.t0
    torch, dev = setup(args)
    from model import GPT, GPTConfig

    cuda = dev.type == "cuda"
    lib = load_lib(args.impl)
    avail0 = meminfo().get("MemAvailable", 0.0)  # the host's, before this run's model states exist
    avail_min = [avail0]

    def avail() -> float:
        avail_min[0] = min(avail_min[0], meminfo().get("MemAvailable", avail0))
        return avail_min[0]

    cfg = config(args, args.mode, cuda, args.impl)
    mcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)
    say(f"{NAMES[args.impl]} {getattr(lib, '__version__', '?')}: building the model ({args.mode}, "
        f"torch threads {torch.get_num_threads()})", t0)
    torch.manual_seed(0)
    t = time.perf_counter()
    if args.mode == "zero2":  # straight on the GPU in the training dtype: no host copy, no cast pass
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
        try:
            with torch.device(dev):
                model = GPT(mcfg)
        finally:
            torch.set_default_dtype(prev)
    else:  # partitioned (to pinned host memory: offload_param) as each module is made
        with lib.zero.Init(config_dict_or_path=cfg):
            model = GPT(mcfg)
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    say(f"built in {build_s:.1f}s; initialize", t0)
    t = time.perf_counter()
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if cuda:
        torch.cuda.synchronize()
    init_s = time.perf_counter() - t
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # noqa: E731 (GiB)
    say(f"initialized in {init_s:.1f}s (peak host RSS {rss():.1f} GiB, host MemAvailable "
        f"{avail():.1f} GiB, GPU {torch.cuda.memory_allocated() / 2**30 if cuda else 0:.1f} "
        "GiB allocated)", t0)
    data = batches(args, 4, dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        x, y = data[i % len(data)]
        sync()
        t = time.perf_counter()
        losses.append(train_step(engine, x, y))
        sync()
        times.append(time.perf_counter() - t)
        avail()
        say(f"step {i} {'(warm-up) ' if i < args.warmup else ''}{times[-1]:.2f}s loss {losses[-1]:.4f}", t0)
    step_s = statistics.median(times[args.warmup:] or times)
    res = {"impl": args.impl, "mode": args.mode, "size": args.size, "n_embd": args.n_embd, "n_layer": args.n_layer,
           "params": nparams(args.n_embd, args.n_layer, args.vocab, args.seq), "micro": args.micro, "seq": args.seq,
           "build_s": build_s, "init_s": init_s, "first_step_s": times[0], "step_s": step_s, "steps": times,
           "tokens_per_s": args.micro * args.seq / step_s, "losses": losses,
           "ok": all(v == v and abs(v) < 1e4 for v in losses), "peak_host_rss_gib": rss(),
           "host_used_gib": avail0 - avail(),  # MemAvailable's largest drop (sampled after init and each step)
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
           "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
           "threads": torch.get_num_threads(), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    print("RESULT " + json.dumps(res), flush=True)
    if hasattr(engine, "destroy"):
        engine.destroy()
    dist_destroy()


# -- parent side: one child process per run --------------------------------------------------------------
_CHILD: list[subprocess.Popen] = []


def _on_term(signum: int, frame: Any) -> None:
    for p in _CHILD:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    sys.exit(128 + signum)


def spawn(args: argparse.Namespace, extra: list[str], limit: float, log: str) -> tuple[Optional[dict], list[dict], str]:
    """Runs this file as a child in its own process group, killed after `limit` seconds; echoes its progress
    lines, keeps the rest in `log`. Returns (its RESULT, its CHECK lines, why it failed)."""
    cmd = [sys.executable, "-u", os.path.abspath(__file__), *extra, "--vocab", str(args.vocab), "--seq",
           str(args.seq), "--micro", str(args.micro), "--bucket", str(args.bucket), "--port", str(args.port),
           "--prefetch_bucket", repr(args.prefetch_bucket), "--reuse_distance", repr(args.reuse_distance),
           "--t0", repr(args.t0), "--lr", repr(args.lr), "--nvme_path", args.nvme_path, "--aio", args.aio]
    if args.tiny:
        cmd.append("--tiny")
    result, checks, tail = None, [], []
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        _CHILD.append(proc)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(max(1.0, limit), kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                if line.startswith("RESULT "):
                    result = json.loads(line[7:])
                elif line.startswith("CHECK "):
                    checks.append(json.loads(line[6:]))
                elif line.startswith(TAG):
                    print(line.rstrip(), flush=True)
                elif line.strip():
                    tail = (tail + [line.rstrip()])[-4:]
            proc.wait()
        finally:
            timer.cancel()
            _CHILD.remove(proc)
            for impl in NAMES:  # the swap files of a zero3nvme run (tens of GB): only the folders this script made
                shutil.rmtree(swap_dir(args, impl), ignore_errors=True)
    why = ""
    if killed.is_set():
        why = f"killed at its limit ({limit:.0f}s)"
    elif proc.returncode != 0:
        why = f"rc {proc.returncode}: " + " | ".join(x[:160] for x in tail[-2:])
    return result, checks, why


def row(r: dict) -> str:
    if not r.get("ok"):
        return (f"| {r['size']} | {r['mode']} | {NAMES[r['impl']]} | {r['params'] / 1e9:.2f}B | did not train: "
                f"{r.get('error', '?')} |")
    return (f"| {r['size']} | {r['mode']} | {NAMES[r['impl']]} | {r['params'] / 1e9:.2f}B | {r['build_s']:.1f} | "
            f"{r['init_s']:.1f} | {r['first_step_s']:.1f} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['peak_host_rss_gib']:.1f} | {r['peak_host_rss_gib'] * 2**30 / r['params']:.1f} | "
            f"{r.get('host_used_gib', 0.0):.1f} | "
            f"{r['peak_gpu_gib']:.1f} / {r['peak_gpu_reserved_gib']:.1f} | {r['losses'][0]:.4f} |")


def report(rows: list[dict]) -> None:
    print("| size | mode | system | params | build s | init s | 1st step s | s/step | tokens/s | peak host RSS GiB "
          "| host B/param | host used GiB | peak GPU GiB alloc / reserved | loss 0 |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(row(r))
    by = {(r["size"], r["mode"], r["impl"]): r for r in rows if r.get("ok")}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        ours = [r for (_, m, i), r in by.items() if m == mode and i == "dsc"]
        both = [r for r in ours if (r["size"], mode, "ds") in by]
        if ours:
            big = max(ours, key=lambda r: r["params"])
            plan = host_plan(big["params"])
            print(f"largest {mode} ours trained: {big['params'] / 1e9:.2f}B at {big['tokens_per_s']:,.0f} tokens/s, "
                  f"peak host RSS {big['peak_host_rss_gib']:.1f} GiB" + (
                      f" (zero2 host buffers planned: {plan['exact_gib']:.1f} GiB exact, {plan['rounded_gib']:.1f} "
                      "with torch's power-of-two pinned blocks, DSC_EXACT_PINNED=0)" if mode == "zero2" else ""))
        if both:
            big = max(both, key=lambda r: r["params"])
            print(f"largest {mode} both trained: {big['params'] / 1e9:.2f}B")
    for (size, mode, impl), r in by.items():
        ds = by.get((size, mode, "ds"))
        if impl == "dsc" and ds is not None:
            ratio = r["tokens_per_s"] / ds["tokens_per_s"]
            print(f"ratio {size} {mode}: deepspeed_c / DeepSpeed tokens/s {ratio:.2f}x,"
                  f" peak host RSS {r['peak_host_rss_gib'] / ds['peak_host_rss_gib']:.2f}x, init "
                  f"{r['init_s']:.0f}s vs {ds['init_s']:.0f}s, first loss rel diff "
                  f"{abs(r['losses'][0] - ds['losses'][0]) / abs(ds['losses'][0]):.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="", help=f"one of {', '.join(SIZES)} (n_embd, n_layer, n_head); '' with "
                                                "--check: the correctness check alone")
    ap.add_argument("--mode", default="zero2", help="zero2 (stage 2 + offload_optimizer cpu), zero3 (stage 3 + "
                                                    "offload_param and offload_optimizer cpu), zero3nvme (both on "
                                                    "NVMe); a comma list")
    ap.add_argument("--nvme_path", default="/tmp/offload_largest_swap", help="zero3nvme: its dsc/ and ds/ "
                    "subfolders hold the swap files (made by each run and removed after it; they must not exist)")
    ap.add_argument("--aio", default='{"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 8}',
                    help="zero3nvme: the aio section")
    ap.add_argument("--impls", default="dsc,ds", help="dsc (deepspeed_c), ds (the real DeepSpeed), run in this order")
    ap.add_argument("--check", action="store_true", help="correctness first, on the small GPT (tiny with --tiny)")
    ap.add_argument("--check_steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket", type=float, default=5e8, help="zero2's reduce/allgather bucket (DeepSpeed's default)")
    ap.add_argument("--prefetch_bucket", type=float, default=-1.0, help="stage 3's stage3_prefetch_bucket_size "
                    "for both systems (-1: leave it out of the JSON, the default)")
    ap.add_argument("--reuse_distance", type=float, default=-1.0, help="stage3_max_reuse_distance for both "
                    "systems (-1: leave it out of the JSON)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for this whole invocation (0: none); each "
                                                              "child gets what is left of it")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    ap.add_argument("--out", default="", help="append each run's JSON line here")
    ap.add_argument("--log", default="/tmp/offload_largest.log", help="the children's full output")
    ap.add_argument("--report", default="", help="print the table of a --out file and exit")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: gloo, fp32, tiny shapes")
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW lr of the timed runs (the check: 1e-3)")
    ap.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="dsc", help=argparse.SUPPRESS)
    ap.add_argument("--n_embd", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n_layer", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n_head", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.vocab, args.seq, args.micro, args.bucket = 128, 32, 2, 2e4
    if args.child == "check":
        check_child(args)
        return
    if args.child == "run":
        run_child(args)
        return
    if args.report:
        with open(args.report) as f:
            report([json.loads(line) for line in f if line.strip()])
        return
    signal.signal(signal.SIGTERM, _on_term)
    t0 = args.t0 = time.time()
    def left() -> float:
        """Seconds the next child may run: --timeout, cut to what is left of --budget."""
        return min(args.timeout, args.budget - (time.time() - t0)) if args.budget else args.timeout

    mem = meminfo()
    say(f"host MemTotal {mem.get('MemTotal', 0):.1f} GiB, MemAvailable {mem.get('MemAvailable', 0):.1f} GiB, "
        f"{os.cpu_count()} CPUs", t0)
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in NAMES:
            sys.exit(f"--impls: unknown {i!r} (dsc, ds)")
    for m in args.mode.split(","):
        if m not in MODES:
            sys.exit(f"--mode: unknown {m!r} ({', '.join(MODES)})")
    if "zero3nvme" in args.mode.split(","):
        taken = [swap_dir(args, i) for i in NAMES if os.path.exists(swap_dir(args, i))]
        if taken:
            sys.exit(f"--nvme_path: {', '.join(taken)} exist; this script removes its swap folders after each run, so "
                     "it will not use folders it did not make")
    if args.size and args.size not in SIZES:
        sys.exit(f"--size: unknown {args.size!r} ({', '.join(SIZES)})")
    if args.check:
        d, nl, nh = SIZES["tiny" if args.tiny else "small"]
        _, checks, why = spawn(args, ["--child", "check", "--mode", args.mode, "--impls", ",".join(impls),
                                      "--n_embd", str(d), "--n_layer", str(nl), "--n_head", str(nh),
                                      "--check_steps", str(args.check_steps)], left(), args.log)
        bad = [c["mode"] for c in checks if not c["ok"]]
        if why or bad or len(checks) != len(args.mode.split(",")):
            why = why or "losses disagree: " + ",".join(bad)
            say(f"CHECK FAILED ({why}; full output in {args.log}): not timing", t0)
            sys.exit(1)
        for c in checks:
            say(f"check {c['mode']} passed: {' vs '.join(NAMES[i] for i in c['losses'])} losses over "
                f"{args.check_steps} steps, max rel diff {c['max_rel']:.2e} <= {c['tol']:g} ({c['dtype']})", t0)
    if not args.size:
        return
    d, nl, nh = SIZES[args.size]
    n = nparams(d, nl, args.vocab, args.seq)
    plan = host_plan(n)
    say(f"GPT {args.size}: {n / 1e9:.2f}B params (d {d}, {nl} layers, {nh} heads, vocab {args.vocab}), seq {args.seq}"
        f", micro {args.micro}; our zero2 host buffers: {plan['exact_gib']:.1f} GiB exact, {plan['rounded_gib']:.1f} "
        f"GiB in torch's power-of-two pinned blocks (DSC_EXACT_PINNED=0: {plan['bytes_per_param_rounded']:.1f} B/param)", t0)
    rows = []
    for mode in args.mode.split(","):
        for impl in impls:
            limit = left()
            if limit < min(20.0, args.timeout):
                say(f"{NAMES[impl]} {mode} skipped: {limit:.0f}s left of --budget", t0)
                continue
            say(f"{NAMES[impl]} {mode} {args.size}: own process, limit {limit:.0f}s", t0)
            res, _, why = spawn(args, ["--child", "run", "--impl", impl, "--mode", mode, "--size", args.size,
                                       "--n_embd", str(d), "--n_layer", str(nl), "--n_head", str(nh), "--warmup",
                                       str(args.warmup), "--steps", str(args.steps)], limit, args.log)
            if res is None:
                res = {"impl": impl, "mode": mode, "size": args.size, "params": n, "ok": False,
                       "error": why or "no result"}
            rows.append(res)
            say(f"{NAMES[impl]} {mode} {args.size}: " + (f"{res['tokens_per_s']:,.0f} tokens/s, {res['step_s']:.2f} "
                f"s/step, init {res['init_s']:.1f}s, host RSS {res['peak_host_rss_gib']:.1f} GiB" if res.get("ok")
                else f"did not train ({res.get('error')})"), t0)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(res) + "\n")
    report(rows)


if __name__ == "__main__":
    main()

"""Long-sequence training: the largest sequence a LLaMA-shaped model (random init, bf16) trains one step at,
with ALST (ZeRO-3 + optimizer offload, HF activation checkpointing with the checkpoints in host memory,
TiledMLP, TiledFusedLogitsLoss; Ulysses SP over the ranks when launched on several GPUs) or with FPDT
(deepspeed_c.sequence.fpdt_layer: chunked Ulysses attention with KV offload, FPDT_LogitsLoss).

    python benchmarks/long_context.py --mode alst [--impls dsc,ds] [--layers 32] [--start-seq 65536]
                                      [--max-seq 4194304] [--time-limit 900]
    torchrun --nproc_per_node 4 benchmarks/long_context.py --mode alst|fpdt ...
    python benchmarks/long_context.py --mode parity        # FPDT layer bf16 vs the unchunked Ulysses layer

The search doubles the sequence from --start-seq until a step fails with out-of-memory, --max-seq is
passed, or the next step would not fit in --time-limit seconds (estimated from the last step, x3); it
reports per length: the forward+backward and optimizer-step times, tokens/s of the whole step, MFU
(model FLOPs of the step, no recompute, over the ranks' --peak-tflops; "MFU f+b" over the forward+backward
time alone, the host optimizer step excluded) and the peak device memory.
Each implementation in --impls (dsc: deepspeed_c, ds: the real DeepSpeed 0.19.8 importable as
`deepspeed`) runs the same search in this process, dsc first; a first step's loss at --start-seq is
compared between them (same model and data) before any timing is reported. The 8B shape is the default
(hidden 4096, 32 layers, 32 heads, 8 kv heads, MLP 14336, vocab 128256); a full 8B step at 500K tokens
takes minutes, so --layers N gives the same per-layer shape with fewer layers. --optimizer torch makes both
implementations use a client torch AdamW (no DeepSpeed CPU-Adam JIT build); `own` uses each one's CPU Adam.
FPDT mode (deepspeed_c only: DeepSpeed's FPDT needs flash-attn and a Megatron model) also runs on one GPU.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import long_context_models as lcm  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="alst", choices=["alst", "fpdt", "parity"])
    ap.add_argument("--impls", default="dsc,ds", help="comma list: dsc (deepspeed_c), ds (real DeepSpeed)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--start-seq", type=int, default=65536)
    ap.add_argument("--max-seq", type=int, default=1 << 22)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per implementation's search")
    ap.add_argument("--tile", type=int, default=16384, help="tokens per MLP / loss tile")
    ap.add_argument("--chunk", type=int, default=65536, help="FPDT chunk size (global tokens)")
    ap.add_argument("--no-offload", dest="offload", action="store_false", help="FPDT: keep chunks on device")
    ap.add_argument("--optimizer", default="own", choices=["own", "torch"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 SXM)")
    ap.add_argument("--parity-seq", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="smoke run on the host (gloo, fp32, tiny shapes)")
    a = ap.parse_args()
    a.device = torch.device("cpu") if a.cpu or not torch.cuda.is_available() else torch.device("cuda")
    a.dtype = torch.float32 if a.device.type == "cpu" else torch.bfloat16
    return a


def init_dist(a: argparse.Namespace) -> tuple:
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29553"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        a.device = torch.device("cuda", torch.cuda.current_device())
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if a.device.type == "cuda" else "gloo", rank=rank,
                                             world_size=world)
    return rank, world


def say(*msg: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*msg, flush=True)


def real_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError:
        return None
    if "deepspeed_c" in str(getattr(deepspeed, "__path__", "")) or "dsc" in str(getattr(deepspeed, "__version__", "")):
        return None
    return deepspeed


def sync(a: argparse.Namespace) -> None:
    if a.device.type == "cuda":
        torch.cuda.synchronize()


def engine_config(a: argparse.Namespace, world: int, sp: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 1.0, "sequence_parallel_size": sp,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "overlap_comm": False, "contiguous_gradients": True}}
    if a.dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    if a.optimizer == "own":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}
    else:
        cfg["zero_force_ds_cpu_optimizer"] = False
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def batch(a: argparse.Namespace, seq: int) -> tuple:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, a.vocab, (1, seq), generator=g)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    return ids, torch.arange(seq)[None], labels


def search(a: argparse.Namespace, name: str, step: Callable[[int], dict]) -> list:
    rows: list = []
    t0, seq, last = time.perf_counter(), a.start_seq, 0.0
    while seq <= a.max_seq:
        left = a.time_limit - (time.perf_counter() - t0)
        if rows and last * 3 > left:
            rows.append({"seq": seq, "note": f"not tried: ~{last * 3:.0f}s > {left:.0f}s left of --time-limit"})
            break
        try:
            r = step(seq)
        except torch.OutOfMemoryError as e:
            rows.append({"seq": seq, "note": f"out of memory ({str(e).splitlines()[0][:60]})"})
            break
        finally:
            gc.collect()
            if a.device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(r)
        last = r["fb_s"] + r["step_s"]
        say(f"[{name}] seq {seq}: fwd+bwd {r['fb_s']:.2f}s step {r['step_s']:.2f}s loss {r['loss']:.4f} "
            f"peak {r['peak_gb']:.1f} GB")
        seq *= 2
    return rows


def timed_step(a: argparse.Namespace, world: int, seq: int, fwd_bwd: Callable[[], torch.Tensor],
               engine: Any, partial_loss: bool = False) -> dict:
    """One training step, timed: fwd_bwd() runs forward and engine.backward and returns the loss; partial_loss:
    each rank's loss is its share (ALST), summed for the report."""
    if a.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(a)
    t = time.perf_counter()
    loss = fwd_bwd()
    sync(a)
    t_fb = time.perf_counter()
    engine.step()
    sync(a)
    t_step = time.perf_counter()
    total = t_step - t
    shown = loss.detach().float().clone()
    if partial_loss and world > 1:
        torch.distributed.all_reduce(shown)
    flops = lcm.flops_per_token(a, seq) * seq
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if a.device.type == "cuda" else 0.0
    peak_flops = a.peak_tflops * 1e12 * world
    return {"seq": seq, "fb_s": t_fb - t, "step_s": t_step - t_fb, "tok_s": seq / total, "loss": float(shown),
            "mfu": flops / total / peak_flops, "mfu_fb": flops / (t_fb - t) / peak_flops, "peak_gb": peak}


def run_alst(a: argparse.Namespace, ds: Any, name: str, rank: int, world: int) -> list:
    model = lcm.hf_llama(a, a.device)
    lcm.tile_mlps(ds, model, a.tile)
    usp = lcm.submodule(ds, "runtime.sequence_parallel.ulysses_sp")
    mpu = usp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1) if world > 1 else None
    cfg = engine_config(a, world, world)
    opt = None if a.optimizer == "own" else torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = ds.initialize(model=model, config=cfg, optimizer=opt, mpu=mpu,
                               model_parameters=None if opt is not None else model.parameters())
    sp_group = mpu.get_sequence_parallel_group() if mpu is not None else None

    def step(seq: int) -> dict:
        ids, pos, labels = batch(a, seq)
        part = slice(rank * seq // world, (rank + 1) * seq // world)  # the adapter's contiguous slice
        ids, pos, labels = (t[:, part].to(a.device) for t in (ids, pos, labels))
        return timed_step(a, world, seq, lambda: lcm.alst_fwd_bwd(ds, engine, ids, pos, labels, a.tile, sp_group),
                          engine, partial_loss=True)

    try:
        return search(a, name, step)
    finally:
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine, model
        gc.collect()


def run_fpdt(a: argparse.Namespace, ds: Any, rank: int, world: int) -> list:
    from deepspeed_c.sequence.fpdt_layer import FPDT_InputConstruct

    spg = torch.distributed.new_group(list(range(world)))
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(a.dtype)
    try:
        with torch.device(a.device):
            model = lcm.FPDTLlama(a, spg)
    finally:
        torch.set_default_dtype(prev)
    opt = None if a.optimizer == "own" else torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = ds.initialize(model=model, config=engine_config(a, world, 1), optimizer=opt,
                               model_parameters=None if opt is not None else model.parameters())
    args = argparse.Namespace(ds_sequence_parallel_fpdt_chunk_size=a.chunk)

    def step(seq: int) -> dict:
        ids, _, labels = batch(a, seq)
        mask = (labels != -100).float()
        ids, labels, mask = (t.to(a.device) for t in (ids, labels.clamp(min=0), mask))
        tok, lab, lmask, _, _ = FPDT_InputConstruct(ids, labels, mask, None, None, args, world, rank).generate()
        def fwd_bwd() -> torch.Tensor:
            loss = engine(tok, lab, lmask, seq)
            engine.backward(loss)
            return loss

        return timed_step(a, world, seq, fwd_bwd, engine)

    try:
        return search(a, "dsc-fpdt", step)
    finally:
        del engine, model
        gc.collect()


def header(a: argparse.Namespace, world: int) -> None:
    say(f"\n{a.mode} | {a.layers} layers x hidden {a.hidden} ({a.heads} heads, {a.kv_heads} kv, MLP {a.inter}, "
        f"vocab {a.vocab}) | {world} GPU(s) | {a.dtype} | optimizer {a.optimizer}")


def rows_table(name: str, rows: list) -> None:
    """One implementation's rows, printed as soon as its search ends (a cut-off run keeps what it has)."""
    say(f"{'impl':10s} {'seq':>9s} {'fwd+bwd s':>10s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} "
        f"{'MFU f+b':>8s} {'peak GB':>8s}")
    for r in rows:
        if "note" in r:
            say(f"{name:10s} {r['seq']:9d}  {r['note']}")
        else:
            say(f"{name:10s} {r['seq']:9d} {r['fb_s']:10.2f} {r['step_s']:8.2f} {r['tok_s']:10.0f} "
                f"{100 * r['mfu']:5.1f}% {100 * r['mfu_fb']:7.1f}% {r['peak_gb']:8.1f}")


def summary(a: argparse.Namespace, results: dict) -> None:
    first = {n: r[0]["loss"] for n, r in results.items() if r and "loss" in r[0]}
    if len(first) > 1:
        vals = list(first.values())
        say("correctness: first-step loss at seq {}: {} (|diff| {:.2e})".format(
            a.start_seq, ", ".join(f"{n} {v:.5f}" for n, v in first.items()), abs(vals[0] - vals[1])))
    best = {n: max([r["seq"] for r in rows if "note" not in r], default=0) for n, rows in results.items()}
    say("largest sequence trained one step: " + ", ".join(f"{n} {s}" for n, s in best.items()))
    if len(best) == 2 and min(best.values()) > 0:
        names = list(best)
        say(f"ratio {names[0]}/{names[1]} largest: {best[names[0]] / best[names[1]]:.2f}x")


def main() -> None:
    a = parse()
    if a.cpu:
        a.layers, a.hidden, a.heads, a.kv_heads, a.inter, a.vocab = min(a.layers, 2), 64, 4, 2, 128, 256
        a.start_seq, a.max_seq, a.tile, a.chunk = min(a.start_seq, 64), min(a.max_seq, 128), 32, min(a.chunk, 32)
    rank, world = init_dist(a)
    if a.mode == "parity":
        from long_context_parity import run_parity

        run_parity(a, rank, world)
        return
    import deepspeed_c

    impls = [s for s in a.impls.split(",") if s]
    results: dict = {}
    header(a, world)
    for name in impls:
        ds = deepspeed_c if name == "dsc" else real_deepspeed() if name == "ds" else None
        if ds is None:
            say(f"{name}: not importable here (the real DeepSpeed comes from scripts/device_deepspeed.sh); skipped")
            continue
        if a.mode == "fpdt" and name != "dsc":
            say("ds: FPDT in DeepSpeed needs flash-attn and a Megatron model; not run")
            continue
        key = "dsc-fpdt" if a.mode == "fpdt" else name
        t = time.perf_counter()
        try:
            results[key] = run_fpdt(a, ds, rank, world) if a.mode == "fpdt" else run_alst(a, ds, name, rank, world)
        except Exception as e:  # one implementation failing must not hide the other's figures
            results[key] = [{"seq": a.start_seq, "note": f"failed: {type(e).__name__}: {str(e)[:200]}"}]
        rows_table(key, results[key])
        say(f"({key}: {time.perf_counter() - t:.0f}s including engine setup)")
    summary(a, results)


if __name__ == "__main__":
    main()

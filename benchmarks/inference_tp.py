"""Issue 39: kernel injection at tensor_parallel.tp_size 2 against tp_size 1, batch-1 decode, one process a GPU
(2 GPUs, NCCL; on the host a smoke run: 2 gloo ranks, fp32, tiny model, no graphs).

Per model (LLaMA shape, random weights, bf16; `--layers 32,4`: the 7B shape first, hidden 4096 x 32 layers):
  correctness  the greedy tokens of TP1 (8 new) are the test sequence; every system's logits at the prompt's last
               position (prefill) and at the 8 positions after it (teacher-forced one-token decode steps, replayed
               graphs where enabled) against HF eager run in fp32 with the same (bf16-rounded) weights.
               bf16 tolerance: a system's max-abs error / max-abs logit vs fp32 within 3x HF bf16 eager's own
               error (same weights, same tokens); above it the row says WRONG. TP2 vs TP1 directly is printed too.
  timings      decode ms/token ((generate(new) - generate(1)) / (new - 1), medians of --reps interleaved rounds)
               of tp1 (CUDA graphs, the reference), tp1-eager, tp2-eager, tp2 (CUDA graphs: the decode step and
               its 2 all-reduces per block captured and replayed), with the ratio to tp1. The eager rows are
               the graph engines with their graphs switched off (same weights).
  breakdown    one decode step (engine forward, 1 token, LM head included): host time to enqueue it and its
               wall time; and one all-reduce of [1, hidden] (what each block reduces twice) eager and replayed
               in a CUDA graph, us per call: where TP2-eager's extra time per block goes.
  tp2-symm     experimental (GPU; --no-symm skips it): TP2 with graphs whose decode all-reduces run as one-shot
               all-reduces over torch symmetric memory (hybrid_tp.use_symmetric_allreduce) instead of NCCL: its
               logits vs fp32, decode ms/token (timed after the main rounds) and the one-shot's us per call.

    python benchmarks/inference_tp.py [--hidden 4096 --layers 32,4 --new 32 --reps 3] [--device cpu]"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from inference_rest import decode_ms, llama, rel  # noqa: E402

CHECK_NEW = 8  # teacher-forced decode positions checked against fp32


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", default="32,4", help="comma-separated layer counts, one model each")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-symm", dest="symm", action="store_false",
                    help="skip the experimental tp2-symm row (symmetric-memory one-shot all-reduce)")
    args = ap.parse_args(argv)
    args.layers = [int(x) for x in str(args.layers).split(",") if x.strip()]
    if not args.layers or min(args.layers) < 1:
        raise SystemExit(f"--layers: positive layer counts, got {args.layers}")
    if args.device == "cpu":  # smoke sizes
        args.hidden, args.layers, args.new, args.reps = 64, [2], 8, 1
    return args


def _decoder(engine: Any) -> Any:
    from deepspeed_c.module_inject.fused_decoder import InjectedDecoder

    return next(m for m in engine.module.modules() if isinstance(m, InjectedDecoder))


class _Eager:
    """An engine with its decode-step CUDA graphs switched off (its eager path), same weights."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.dec = engine, _decoder(engine)

    def _off(self, fn: Any, *a: Any, **k: Any) -> Any:
        old, self.dec.enable_cuda_graph = self.dec.enable_cuda_graph, False
        try:
            return fn(*a, **k)
        finally:
            self.dec.enable_cuda_graph = old

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._off(self.engine, *a, **k)

    def generate(self, *a: Any, **k: Any) -> Any:
        return self._off(self.engine.generate, *a, **k)


@torch.no_grad()
def _forced_logits(engine: Any, seq: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits at positions prompt-1 .. len-2: prefill of the prompt, then one-token steps of seq's next tokens."""
    out = engine(input_ids=seq[:, :prompt], use_cache=True)
    got = [out.logits[:, -1]]
    for i in range(prompt, seq.shape[1] - 1):
        out = engine(input_ids=seq[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
        got.append(out.logits[:, -1])
    return torch.stack(got, 1).float()


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def _step_ms(engine: Any, ids: torch.Tensor, dev: str, reps: int = 15) -> tuple[float, float]:
    """(host ms to enqueue one decode step, wall ms of it) medians: 1 token, LM head included."""
    out = engine(input_ids=ids, use_cache=True)
    tok = ids[:, -1:]
    host, wall = [], []
    for i in range(reps + 2):
        _sync(dev)
        t0 = time.perf_counter()
        out = engine(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        if i >= 2:  # the first steps capture the graph
            host.append(1e3 * (t1 - t0))
            wall.append(1e3 * (t2 - t0))
    return statistics.median(host), statistics.median(wall)


def _allreduce_us(group: Any, hidden: int, dev: str, dt: torch.dtype, n: int = 64) -> tuple[float, float, float]:
    """us per all-reduce of [1, hidden]: eager (n back to back), its host part (the calls returning), and
    replayed in a CUDA graph (nan off a GPU)."""
    import torch.distributed as dist

    x = torch.zeros(1, hidden, dtype=dt, device=dev)
    for _ in range(8):
        dist.all_reduce(x, group=group)
    _sync(dev)
    dist.barrier(group=group)
    t = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x, group=group)
    host = 1e6 * (time.perf_counter() - t) / n
    _sync(dev)
    eager = 1e6 * (time.perf_counter() - t) / n
    if not dev.startswith("cuda"):
        return eager, host, float("nan")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(x, group=group)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(n):
                dist.all_reduce(x, group=group)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            dist.barrier(group=group)
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append(1e6 * (time.perf_counter() - t) / n)
        return eager, host, statistics.median(times)
    except Exception as e:  # noqa: BLE001 -- a breakdown figure, not the result
        print(f"  (rank {dist.get_rank()}: all-reduce graph capture failed: {type(e).__name__}: {str(e)[:200]})")
        return eager, host, float("nan")


def _one_model(rank: int, args: argparse.Namespace, layers: int, out: Any) -> None:
    import torch.distributed as dist

    import deepspeed_c

    cuda = args.device != "cpu"
    dev, dt = (f"cuda:{rank}", torch.bfloat16) if cuda else ("cpu", torch.float32)
    base = llama(args.hidden, layers, dev, dt)
    params = sum(p.numel() for p in base.parameters())
    ids = torch.randint(3, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(4)).to(dev)
    kw = dict(dtype=dt, replace_with_kernel_inject=True, max_out_tokens=args.prompt + max(args.new, 20) + 8,
              enable_cuda_graph=cuda)  # gloo cannot capture: the host smoke run has no graphs
    gen = dict(do_sample=False, pad_token_id=0, max_new_tokens=CHECK_NEW, min_new_tokens=CHECK_NEW)
    res: dict[str, Any] = {"layers": layers, "params": params}
    tp1 = deepspeed_c.init_inference(copy.deepcopy(base), **kw) if rank == 0 else None
    seq = torch.zeros(1, args.prompt + CHECK_NEW, dtype=torch.long, device=dev)
    with torch.no_grad():
        if rank == 0:
            seq.copy_(tp1.generate(input_ids=ids, **gen))
            exact = copy.deepcopy(base).float()(input_ids=seq[:, :-1]).logits[:, args.prompt - 1:].float()
            errs = {"hf-" + str(dt)[6:]: rel(base(input_ids=seq[:, :-1]).logits[:, args.prompt - 1:], exact)}
        dist.broadcast(seq, 0)
    tp2 = deepspeed_c.init_inference(base, tensor_parallel={"tp_size": 2}, **kw)  # base becomes TP2's
    del base
    systems = {"tp1": tp1, "tp1-eager": _Eager(tp1) if tp1 is not None else None, "tp2-eager": _Eager(tp2),
               "tp2": tp2}
    forced = {}
    for name in ("tp1", "tp2-eager", "tp2"):  # TP2's eager decode checked before its graph is captured
        e = systems[name]
        if e is None:
            continue
        try:
            forced[name] = _forced_logits(e, seq, args.prompt)
        except Exception as exc:  # noqa: BLE001 -- a failed TP2 capture still leaves the eager rows
            if name != "tp2":
                raise
            res["graph_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            _decoder(tp2).enable_cuda_graph = False
            systems["tp2"] = None
    with torch.no_grad():
        tokens = tp2.generate(input_ids=ids, **gen)
    if rank == 0:
        for name, got in forced.items():
            errs[name] = rel(got, exact)
        res["errs"] = errs
        res["tp2_vs_tp1"] = rel(forced.get("tp2", forced["tp2-eager"]), forced["tp1"])
        res["same_tokens"] = int((tokens[0, args.prompt:] == seq[0, args.prompt:]).sum())
    for e in systems.values():
        if e is not None:
            decode_ms(e, ids, 4, dev)  # warm-up (graphs captured)
    times: dict[str, list[float]] = {n: [] for n in systems}
    for _ in range(args.reps):
        for name, e in systems.items():
            dist.barrier()
            if e is not None:
                with torch.no_grad():  # both ranks past the barrier and in step before the clock starts
                    e.generate(input_ids=ids, do_sample=False, pad_token_id=0, max_new_tokens=1)
                times[name].append(decode_ms(e, ids, args.new, dev)[0])
    res["decode"] = {n: statistics.median(v) for n, v in times.items() if v}
    steps = {}
    for name, e in systems.items():
        dist.barrier()
        if e is not None:
            steps[name] = _step_ms(e, ids, dev)
    res["step"] = steps
    dist.barrier()
    res["allreduce"] = _allreduce_us(tp2.mp_group, args.hidden, dev, dt)
    if rank == 0:
        out.put(res)  # the main rows are out before the experimental one runs
    if cuda and args.symm:
        sym = _symm_phase(rank, args, tp2, seq, ids, dev, dt)
        if rank == 0:
            if "logits" in sym:
                sym["err"] = rel(sym.pop("logits"), exact)
            out.put(sym)


def _symm_phase(rank: int, args: argparse.Namespace, tp2: Any, seq: torch.Tensor, ids: torch.Tensor, dev: str,
                dt: torch.dtype) -> dict:
    """Experimental row: TP2 with graphs, its decode all-reduces through hybrid_tp.SymmetricAllReduce (one-shot,
    symmetric memory) instead of NCCL. Timed right after the main rounds (not interleaved with them)."""
    import torch.distributed as dist

    from deepspeed_c.module_inject import hybrid_tp

    r: dict[str, Any] = {"kind": "symm"}
    try:
        hybrid_tp.use_symmetric_allreduce(tp2.module, tokens=1)
        r["logits"] = _forced_logits(tp2, seq, args.prompt)
        decode_ms(tp2, ids, 4, dev)
        times = []
        for _ in range(args.reps):
            dist.barrier()
            with torch.no_grad():
                tp2.generate(input_ids=ids, do_sample=False, pad_token_id=0, max_new_tokens=1)
            times.append(decode_ms(tp2, ids, args.new, dev)[0])
        r["decode"] = statistics.median(times)
        dist.barrier()
        r["step"] = _step_ms(tp2, ids, dev)
        reducer = _decoder(tp2).layers[0].reducer
        x = torch.zeros(1, args.hidden, dtype=dt, device=dev)
        reducer(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(64):
                reducer(x)
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        r["ar"] = 1e6 * (time.perf_counter() - t) / 64
    except Exception as e:  # noqa: BLE001 -- an experimental row: its failure is reported, not fatal
        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return r


def _worker(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")
    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import transformers

    import deepspeed_c

    transformers.logging.set_verbosity_error()
    deepspeed_c.init_distributed(dist_backend="nccl" if cuda else "gloo")
    for layers in args.layers:
        try:
            _one_model(rank, args, layers, out)
        except Exception:  # noqa: BLE001 -- reported, then this rank stops (the other may be stuck in a collective)
            out.put({"layers": layers, "rank": rank, "error": traceback.format_exc(limit=8)})
            raise
        gc.collect()  # the engines, their graphs and memory pools go before the next model is built
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.synchronize()
    torch.distributed.barrier()


def _report(args: argparse.Namespace, r: dict) -> None:
    L = r["layers"]
    head = f"== tp: kernel injection, tp_size 2 vs 1, LLaMA hidden {args.hidden} x {L} layers"
    print(head + (f" ({r['params'] / 1e9:.2f}B params)" if "params" in r else "") + ", batch 1 ==")
    if "error" in r:
        print(f"  FAILED on rank {r['rank']}:\n" + "\n".join("    " + x for x in r["error"].rstrip().splitlines()))
        return
    if "graph_error" in r:
        print(f"  TP2 with enable_cuda_graph FAILED to capture (tp2 row left out): {r['graph_error']}")
    errs = r["errs"]
    hf = next(iter(errs))  # HF eager in the run's dtype: its own error sets the tolerance
    tol = 3 * errs[hf] + 1e-6
    print(f"  logits rel err vs HF fp32 (prefill + {CHECK_NEW - 1} teacher-forced decode steps; tolerance 3x "
          f"{hf}'s = {tol:.2e}): " + "  ".join(f"{n} {e:.2e}{'' if n == hf or e <= tol else ' WRONG'}"
                                             for n, e in errs.items()))
    print(f"  TP2 vs TP1 logits rel err {r['tp2_vs_tp1']:.2e};  TP2 (graphs) greedy tokens equal TP1's: "
          f"{r['same_tokens']}/{CHECK_NEW} (random weights: a bf16 near-tie can flip one)")
    dec, step = r["decode"], r["step"]
    print(f"  {'system':10s} {'decode ms/token':>16s} {'vs tp1':>7s}   {'step ms':>8s} {'(host enqueue ms)':>18s}")
    for n, v in dec.items():
        h, w = step.get(n, (float("nan"), float("nan")))
        print(f"  {n:10s} {v:16.3f} {dec['tp1'] / max(v, 1e-6):6.2f}x   {w:8.3f} {h:18.3f}")
    if "tp2" in dec:
        ratio = dec["tp1"] / dec["tp2"]
        print(f"  issue 39's bar, TP2 with injection >= 1.6x TP1 decode: {ratio:.2f}x, "
              f"{'met' if ratio >= 1.6 else 'NOT met'}" + (" (7B shape)" if L >= 32 else f" ({L} layers only)"))
    eager, host, graph = r["allreduce"]
    s1, s2 = step.get("tp1-eager", (0, 0))[1], step.get("tp2-eager", (0, 0))[1]
    print(f"  all-reduce [1 x {args.hidden}]: eager {eager:.1f} us/call (host {host:.1f}), in a CUDA graph "
          f"{graph:.1f} us/call;  "
          f"TP2-eager step - TP1-eager step = {(s2 - s1) / L * 1e3:.0f} us per block (2 all-reduces, half the "
          f"weights)")


def _report_symm(main: dict, r: dict) -> None:
    what = "  tp2-symm (experimental: graphs, decode all-reduces one-shot over torch symmetric memory, not NCCL)"
    if "error" in r or "decode" not in r:
        print(f"{what}: FAILED: {r.get('error', 'no result')}")
        return
    errs = main["errs"]
    tol = 3 * errs[next(iter(errs))] + 1e-6
    tp1 = main["decode"]["tp1"]
    print(f"{what}:\n    logits rel err vs HF fp32 {r['err']:.2e}{'' if r['err'] <= tol else ' WRONG'}  decode "
          f"{r['decode']:.3f} ms/token = {tp1 / r['decode']:.2f}x tp1 (tp2 with NCCL: "
          f"{tp1 / main['decode'].get('tp2', float('nan')):.2f}x)  step {r['step'][1]:.3f} ms  one-shot all-reduce "
          f"in a graph {r.get('ar', float('nan')):.1f} us/call")


def run(args: argparse.Namespace) -> None:
    if args.device != "cpu" and torch.cuda.device_count() < 2:
        print("== tp: skipped: needs 2 GPUs ==")
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in args.layers:
            r = _next(q, procs)
            _report(args, r)
            sys.stdout.flush()
            if "error" in r:
                break
            if args.device != "cpu" and args.symm:
                _report_symm(r, _next(q, procs))
                sys.stdout.flush()
    finally:
        for p in procs:  # a process group that captured NCCL work may not tear down cleanly: do not wait on it
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _next(q: Any, procs: list) -> dict:
    """The next result; a rank that died without one raises instead of waiting forever."""
    while True:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                try:
                    return q.get(timeout=2)  # its error report, if it sent one
                except queue.Empty:
                    raise RuntimeError(f"a spawned rank failed (exit codes {[p.exitcode for p in procs]})")


if __name__ == "__main__":
    run(parse())

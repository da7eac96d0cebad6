"""Issue 39's inference paths against their competitors, side by side in one process, correctness before timing.

Sections (random-weight models built from configs, no downloads; bf16 on a GPU):
  quant  weight-only int8 / int4 (quant section, group 128) vs bf16, kernel-injected LLaMA-shaped decoder, batch 1
         decode, all three with enable_cuda_graph (the decode step replayed). Correctness: the quant_gemv /
         dequantize CUDA kernels against the torch reference, and each
         quantized model's prefill logits against the bf16 model's (quantization error, printed).
  bert   BERT-large masked LM, kernel-injected encoder (ours) vs HF eager vs HF sdpa, batch x seq with padding,
         and the real DeepSpeed's injected BERT (init_inference, replace_with_kernel_inject) where importable.
         Correctness: each system's logits against the fp32 HF model (a system over 3x HF fp16's error: WRONG).
  zero   ZeRO-Inference (zero stage 3, offload_param cpu) tokens/s: ours (HF modules streamed; and with kernel
         injection) vs the real DeepSpeed's ZeRO-3 param offload (deepspeed.initialize) where importable, and HF
         with the whole model on the GPU as the upper bound. Correctness: greedy tokens equal to HF's.
  tp     kernel injection at tensor_parallel.tp_size 2 vs tp_size 1 decode: benchmarks/inference_tp.py (which
         also takes several layer counts, --layers 32,4), run here for --layers.
  ckpt   host memory of loading a save_mp_checkpoint_path folder (TP 2, injected, meta-built, 2 gloo ranks on
         the host): each rank's peak RSS growth against the whole model's size; loaded logits vs the saver's.
Timings: medians of --reps interleaved rounds (each system once a round); decode ms = (generate(new) -
generate(1)) / (new - 1).

    python benchmarks/inference_rest.py [quant|bert|zero|tp|all] [--hidden 4096 --layers 4 --new 32 --reps 3]
--device cpu: a smoke run of the same code on tiny models (fp32)."""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", nargs="?", default="all", choices=["quant", "bert", "zero", "tp", "ckpt", "all"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--zero-hidden", type=int, default=2048)
    ap.add_argument("--zero-layers", type=int, default=16)
    ap.add_argument("--bert-layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes-as-given", action="store_true", help="on the host, keep the sizes given (ckpt)")
    args = ap.parse_args()
    if args.device == "cpu" and not args.sizes_as_given:  # smoke sizes
        args.hidden, args.layers, args.zero_hidden, args.zero_layers, args.bert_layers = 64, 2, 64, 3, 2
        args.batch, args.seq, args.new, args.reps = 2, 16, 4, 1
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def llama(hidden: int, layers: int, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    heads = max(2, hidden // 128)
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(2, heads // 4),
                         max_position_embeddings=2048)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


@torch.no_grad()
def _rounded_hf(base: torch.nn.Module, bits: int, group: int) -> torch.nn.Module:
    """A copy of the HF model whose block Linear weights are the dequantized int8/int4 values (torch ops)."""
    from deepspeed_c.ops.transformer.inference import quant as Q

    model = copy.deepcopy(base)
    head = model.get_output_embeddings()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            q, s = Q.quantize(m.weight.float(), bits, group)
            m.weight.copy_(Q.dequantize_reference(q, s, bits, group, m.weight.dtype))
    return model


def decode_ms(model: Any, ids: torch.Tensor, new: int, device: str) -> tuple[float, float]:
    """(ms per decoded token, generate(new) seconds)."""
    gen = dict(do_sample=False, pad_token_id=0)
    one = timed(lambda: model.generate(input_ids=ids, max_new_tokens=1, **gen), device)
    full = timed(lambda: model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **gen), device)
    return 1e3 * max(full - one, 1e-9) / (new - 1), full


def rounds(systems: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    got: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(reps):
        for name, fn in systems.items():
            got[name].append(fn())
    return {k: statistics.median(v) for k, v in got.items()}


# ---- quant -------------------------------------------------------------------------------------------
def quant(args: argparse.Namespace) -> None:
    import deepspeed_c
    from deepspeed_c.ops.transformer.inference import quant as Q

    dev, dt = args.device, (torch.bfloat16 if args.device != "cpu" else torch.float32)
    print(f"== quant: weight-only int8/int4 vs {str(dt)[6:]}, injected LLaMA hidden {args.hidden} x {args.layers} "
          f"layers, batch 1 ==")
    k = args.hidden
    for bits in (8, 4):  # kernels vs reference
        group = 128 if k % 128 == 0 else 16
        q, s = Q.quantize(torch.randn(3 * k, k, device=dev), bits, group)  # torch ops (the host path's math)
        x = torch.randn(1, k, device=dev, dtype=dt)
        ref_w = Q.dequantize_reference(q, s, bits, group, torch.float32)  # torch ops, float32
        ref = x.float() @ ref_w.t()
        print(f"  kernel int{bits}: quant_gemv rel err {rel(Q.linear(x, q, s, bits, group), ref):.2e} (bf16 output)  "
              f"dequantize rel err {rel(Q.dequantize(q, s, bits, group, torch.float32), ref_w):.2e}")
    base = llama(args.hidden, args.layers, dev, dt)
    ids = torch.randint(3, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(dev)
    engines = {}
    group = 128 if args.hidden % 128 == 0 else 16
    for name, q in (("bf16", None), ("int8", 8), ("int4", 4)):
        extra = {"quant": {"weight": {"num_bits": q, "group_size": group}}} if q else {}
        # CUDA graphs on a GPU: at batch 1 the decode step is otherwise launch-bound, not weight-bound
        engines[name] = deepspeed_c.init_inference(copy.deepcopy(base), dtype=dt, replace_with_kernel_inject=True,
                                                   max_out_tokens=args.prompt + args.new + 8,
                                                   enable_cuda_graph=dev != "cpu", **extra)
    with torch.no_grad():
        ref = engines["bf16"](input_ids=ids).logits
        hf = base(input_ids=ids).logits
        print(f"  bf16 injected prefill logits rel err vs HF eager bf16 (same weights): {rel(ref, hf):.3e}")
        for name, bits in (("int8", 8), ("int4", 4)):
            got = engines[name](input_ids=ids).logits
            # the quantization's own error (vs the unquantized model) against the path's error (vs HF eager run
            # with the dequantized weights, torch math): only the second can reveal a kernel or layout fault
            deq = _rounded_hf(base, bits, group)(input_ids=ids).logits
            print(f"  {name} prefill logits rel err: vs bf16 {rel(got, ref):.3e} (quantization)   vs HF with "
                  f"dequantized weights {rel(got, deq):.3e} (path; bf16 level above)   HF dequantized vs bf16 "
                  f"{rel(deq, ref):.3e}")
            # decode (quant_gemv, one row) against prefill (dequantize + GEMM) on the same last position
            e = engines[name]
            out = e(input_ids=ids[:, :-1], use_cache=True)
            step = e(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
            print(f"  {name} decode-step logits vs prefill's last position: rel err {rel(step, got[:, -1]):.3e}")
            del deq
    del base
    torch.cuda.empty_cache() if dev != "cpu" else None
    for e in engines.values():
        decode_ms(e, ids, 4, dev)  # warm-up
    res = rounds({n: (lambda e=e: decode_ms(e, ids, args.new, dev)[0]) for n, e in engines.items()}, args.reps)
    # the captured decoder step alone (no generate() bookkeeping, no LM head): where the weights are read
    body = {n: _replay_ms(e) for n, e in engines.items()} if dev != "cpu" else {}
    print(f"  {'system':8s} {'decode ms/token':>16s} {'vs bf16':>8s}" + ("   graph replay ms  vs bf16" if body else ""))
    for n, v in res.items():
        extra = f"   {body[n]:15.3f} {body['bf16'] / body[n]:6.2f}x" if body.get(n) and body.get("bf16") else ""
        print(f"  {n:8s} {v:16.3f} {res['bf16'] / v:7.2f}x{extra}")


def _replay_ms(engine: Any, reps: int = 20) -> float:
    """Median ms of one replay of the injected decoder's captured one-token step (0.0 when none was captured)."""
    graphs = getattr(getattr(engine.module, "model", None), "_graphs", None) or {}
    if 1 not in graphs:
        return 0.0
    g = graphs[1]["graph"]
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# ---- bert --------------------------------------------------------------------------------------------
def bert(args: argparse.Namespace) -> None:
    import transformers as tf

    import deepspeed_c

    dev, dt = args.device, (torch.float16 if args.device != "cpu" else torch.float32)
    big = args.device != "cpu"
    cfg = dict(vocab_size=30522, hidden_size=1024 if big else 64, num_hidden_layers=args.bert_layers,
               num_attention_heads=16 if big else 4, intermediate_size=4096 if big else 128)
    print(f"== bert: BERT-large-shaped masked LM ({args.bert_layers} layers), batch {args.batch} x seq {args.seq}, "
          f"{str(dt)[6:]}, padding in half the rows ==")
    torch.manual_seed(0)
    ref_model = tf.BertForMaskedLM(tf.BertConfig(**cfg, attn_implementation="eager")).eval().to(dev)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=torch.Generator().manual_seed(2)).to(dev)
    mask = torch.ones_like(ids)
    mask[args.batch // 2:, args.seq * 3 // 4:] = 0
    with torch.no_grad():
        exact = ref_model.float()(input_ids=ids, attention_mask=mask).logits
    systems: dict[str, Any] = {}
    eager = copy.deepcopy(ref_model).to(dt)
    systems["hf-eager"] = eager
    sdpa = copy.deepcopy(eager)
    sdpa.config._attn_implementation = "sdpa"
    systems["hf-sdpa"] = sdpa
    systems["ours"] = deepspeed_c.init_inference(copy.deepcopy(ref_model), dtype=dt, replace_with_kernel_inject=True)
    if big:
        try:
            import deepspeed  # the real one (scripts/device_deepspeed.sh puts /tmp/ds_real first)

            if "dsc" in str(getattr(deepspeed, "__version__", "")):
                raise RuntimeError("`import deepspeed` is deepspeed_c's alias, not the real DeepSpeed")
            systems["deepspeed"] = deepspeed.init_inference(copy.deepcopy(ref_model), dtype=dt,
                                                            replace_with_kernel_inject=True)
        except Exception as e:  # noqa: BLE001 - the competitor's failure is reported, ours still runs
            print(f"  deepspeed: n/a ({type(e).__name__}: {str(e)[:300]})")
    del ref_model
    errs = {}
    with torch.no_grad():
        for n, m in list(systems.items()):
            try:
                errs[n] = rel(m(input_ids=ids, attention_mask=mask).logits, exact)
            except Exception as e:  # noqa: BLE001 - a competitor that cannot run is reported, not timed
                if n == "ours":
                    raise
                print(f"  {n}: forward failed ({type(e).__name__}: {str(e)[:200]}); not timed")
                del systems[n]
    bad = {n for n, e in errs.items() if e > 3 * errs["hf-eager"] + 1e-6}
    print("  logits rel err vs fp32: " + "  ".join(f"{n} {e:.2e}{' WRONG' if n in bad else ''}"
                                                   for n, e in errs.items()))

    def fwd(m: Any) -> float:
        with torch.no_grad():
            return 1e3 * timed(lambda: m(input_ids=ids, attention_mask=mask), dev)

    for m in systems.values():
        fwd(m)
    res = rounds({n: (lambda m=m: fwd(m)) for n, m in systems.items() if n not in bad}, max(args.reps, 5))
    print(f"  {'system':9s} {'forward ms':>11s} {'eager/sys':>10s}" + ("  deepspeed/sys" if "deepspeed" in res else ""))
    for n, v in res.items():
        vs_ds = f"  {res['deepspeed'] / v:12.2f}x" if "deepspeed" in res else ""
        print(f"  {n:9s} {v:11.2f} {res['hf-eager'] / v:9.2f}x{vs_ds}")


# ---- zero --------------------------------------------------------------------------------------------
def _deepspeed_zero3(model: torch.nn.Module) -> Any:
    import deepspeed  # the real one (scripts/device_deepspeed.sh puts /tmp/ds_real first)

    if "dsc" in str(getattr(deepspeed, "__version__", "")):
        raise RuntimeError("`import deepspeed` is deepspeed_c's alias, not the real DeepSpeed")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    engine.module.eval()
    return engine.module


def zero(args: argparse.Namespace) -> None:
    import deepspeed_c

    dev, dt = args.device, (torch.bfloat16 if args.device != "cpu" else torch.float32)
    print(f"== zero: ZeRO-Inference (offload_param cpu), LLaMA hidden {args.zero_hidden} x {args.zero_layers} layers, "
          f"batch 1, {args.new} new tokens ==")
    base = llama(args.zero_hidden, args.zero_layers, "cpu", dt)
    ids = torch.randint(3, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(3))
    gen = dict(do_sample=False, pad_token_id=0, max_new_tokens=args.new, min_new_tokens=args.new)
    zcfg = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    systems: dict[str, Any] = {}
    systems["hf-gpu"] = copy.deepcopy(base).to(dev)
    systems["ours"] = deepspeed_c.init_inference(copy.deepcopy(base), dtype=dt, zero=zcfg)
    systems["ours-inject"] = deepspeed_c.init_inference(copy.deepcopy(base), dtype=dt, zero=zcfg,
                                                        replace_with_kernel_inject=True,
                                                        max_out_tokens=args.prompt + args.new + 8)
    if dev != "cpu":
        try:
            systems["deepspeed"] = _deepspeed_zero3(copy.deepcopy(base))
        except Exception as e:  # noqa: BLE001 -- report and go on
            print(f"  deepspeed: n/a ({type(e).__name__}: {str(e)[:160]})")
            traceback.print_exc(limit=2, file=sys.stdout)
    del base
    ids = ids.to(dev)
    with torch.no_grad():
        ref = systems["hf-gpu"].generate(input_ids=ids, **gen)
        for n, m in list(systems.items()):
            out = m.generate(input_ids=ids, **gen)
            same = int((out[0, args.prompt:] == ref[0, args.prompt:]).sum())
            print(f"  {n}: {same}/{args.new} greedy tokens equal HF-on-GPU's")
    res = rounds({n: (lambda m=m: timed(lambda: m.generate(input_ids=ids, **gen), dev)) for n, m in systems.items()},
                 args.reps)
    print(f"  {'system':12s} {'tokens/s':>9s} {'vs deepspeed':>13s}")
    for n, v in res.items():
        ratio = f"{res['deepspeed'] / v:12.2f}x" if "deepspeed" in res else f"{'n/a':>13s}"
        print(f"  {n:12s} {args.new / v:9.2f} {ratio}")


def _collect(q: Any, procs: list, n: int) -> list:
    """n results from the spawned ranks; a rank that died raises instead of waiting forever."""
    import queue

    got = []
    while len(got) < n:
        try:
            got.append(q.get(timeout=2))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a spawned rank failed (exit codes {[p.exitcode for p in procs]})")
    return got


# ---- tp ----------------------------------------------------------------------------------------------
def tp(args: argparse.Namespace) -> None:
    """benchmarks/inference_tp.py (its own file: spawned NCCL ranks, a correctness check and a breakdown)."""
    import inference_tp

    argv = ["--device", args.device, "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--prompt", str(args.prompt), "--new", str(args.new), "--reps", str(args.reps)]
    inference_tp.run(inference_tp.parse(argv))


# ---- ckpt --------------------------------------------------------------------------------------------
def _ckpt_worker(rank: int, args: argparse.Namespace, port: int, folder: str, mode: str, out: Any) -> None:
    import resource

    import psutil

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    import transformers

    import deepspeed_c

    transformers.logging.set_verbosity_error()
    deepspeed_c.init_distributed(dist_backend="gloo")
    dt = torch.bfloat16
    ids = torch.randint(3, 32000, (1, 8), generator=torch.Generator().manual_seed(5))
    cfg = dict(dtype=dt, replace_with_kernel_inject=True, max_out_tokens=64, tensor_parallel={"tp_size": 2},
               keep_module_on_host=True)
    with torch.no_grad():
        if mode == "save":
            model = llama(args.zero_hidden, args.zero_layers, "cpu", dt)
            whole = sum(p.numel() * p.element_size() for p in model.parameters())  # before sharding
            engine = deepspeed_c.init_inference(model, save_mp_checkpoint_path=folder, **cfg)
            logits = engine(input_ids=ids).logits  # collective: every rank of the TP group
            if rank == 0:
                torch.save(logits, os.path.join(folder, "ref_logits.pt"))
                out.put(whole)
        else:
            import deepspeed_c.inference.engine  # noqa: F401 -- imports done before the measured window
            import deepspeed_c.module_inject.kernel_inject  # noqa: F401

            with deepspeed_c.OnDevice(dtype=dt, device="meta"):
                model = llama(args.zero_hidden, args.zero_layers, "meta", dt)
            before = psutil.Process().memory_info().rss
            engine = deepspeed_c.init_inference(model, checkpoint=os.path.join(folder, "ds_inference_config.json"),
                                                **cfg)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            logits = engine(input_ids=ids).logits
            if rank == 0:
                ref = torch.load(os.path.join(folder, "ref_logits.pt"))
                out.put((rel(logits, ref), peak - before))
            else:
                out.put((0.0, peak - before))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def ckpt(args: argparse.Namespace) -> None:
    """Host memory of loading a save_mp_checkpoint_path folder (TP 2, injected, meta-built), per rank: each
    rank's peak RSS growth against the whole model's bytes. Runs on the host (gloo), no GPU needed."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    print(f"== ckpt: sharded checkpoint load (TP 2, injected, bf16, meta-built), LLaMA hidden {args.zero_hidden} x "
          f"{args.zero_layers} layers, host RSS per rank ==")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        results = {}
        for mode in ("save", "load"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            q = ctx.Queue()
            procs = [ctx.Process(target=_ckpt_worker, args=(r, args, port, folder, mode, q)) for r in range(2)]
            for p in procs:
                p.start()
            results[mode] = _collect(q, procs, 1 if mode == "save" else 2)
            for p in procs:
                p.join()
        full = results["save"][0]
        files = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".pt"))
    print(f"  model {full / 2**20:.0f} MiB, checkpoint files {files / 2**20:.0f} MiB; loaded logits rel err vs the "
          f"saving engine: {max(r[0] for r in results['load']):.1e}")
    for r, (_, grew) in enumerate(results["load"]):
        print(f"  rank {r}: peak RSS growth {grew / 2**20:.0f} MiB = {grew / full:.2f} x the whole model (its share: "
              f"half the blocks + the replicated embedding, head and norms)")


def main() -> None:
    args = parse()
    import transformers

    transformers.logging.set_verbosity_error()
    for name, fn in (("quant", quant), ("bert", bert), ("zero", zero), ("tp", tp), ("ckpt", ckpt)):
        if args.section in (name, "all"):
            try:
                fn(args)
            except Exception:  # noqa: BLE001 -- one section failing leaves the others' rows
                print(f"  {name}: FAILED")
                traceback.print_exc(limit=6, file=sys.stdout)
            sys.stdout.flush()


if __name__ == "__main__":
    main()

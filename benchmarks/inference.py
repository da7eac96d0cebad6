"""Inference with kernel injection against HF and the real DeepSpeed, side by side in one process.

Models (random weights from configs, no downloads): llama1b, a ~1.1B LLaMA config (hidden 2048, 22 layers,
32 heads on 4 kv heads, TinyLlama's shape); llama1b_mha, the same shape with 32 kv heads (multi-head
attention: the real DeepSpeed's LLaMA container cannot inject grouped-query attention, it asserts
"Merging tensors is not allowed here" in its QKV copy); gpt2xl, GPT-2 XL (1600 wide, 48 layers, 25 heads).
Greedy generation of --new tokens after a --prompt token prompt, at each --batch.

Systems (names in the table):
  hf          HF eager, bf16, transformers' default attention (SDPA on 5.x, eager on 4.35), its own KV cache
  hf-compile  HF with torch.compile: generate(cache_implementation="static") compiles the decode step
              (transformers >= 4.38; left out, with a note, on older ones)
  ours        deepspeed_c.init_inference(replace_with_kernel_inject=True): our fused kernels
  ours-graph  the same with enable_cuda_graph=True (decode step replayed as a CUDA graph)
  deepspeed   the real DeepSpeed's init_inference(replace_with_kernel_inject=True), driven through its
              InferenceEngine (engine.generate resets its KV workspace). Import guarded: when it is missing,
              its kernels fail to build or its injected model fails, the exception and the tail of its
              traceback are printed and the other systems' rows still print

Correctness first: (1) in fp32 (the bf16 weights widened), ours and ours-graph give HF eager's greedy
tokens on a short check (batch 2, 64-token prompt, 32 new); (2) in bf16 every system's prefill
logits on the check prompt are compared with the fp32 model's: a system further off than 3x HF
eager bf16's own error is reported WRONG and not timed; greedy-token agreement with hf over the
timed run is printed for information (random-weight models have near-tied logits, so bf16 systems
may legitimately part ways). Then --reps interleaved rounds (each system once per round):
  prefill ms   one forward over the prompt (a fresh cache)
  decode ms    (generate time - prefill) / (new - 1): per generated token after the first
  tok/s        batch * new / generate time
medians, and ratios: hf decode / system decode, system prefill / hf prefill, ours-graph vs deepspeed.

    python benchmarks/inference.py [--model llama1b|llama1b_mha|gpt2xl|all] [--batch 1,16] [--prompt 512]
                                   [--new 128] [--reps 3] [--systems hf,hf-compile,ours,ours-graph,deepspeed]
                                   [--pythonpath DIR[:DIR]]
--device cpu runs a smoke test of the same code with a tiny model on the host (hf and ours only).
The real DeepSpeed: `source scripts/device_deepspeed.sh` first (installs the carried sdist into
/tmp/ds_real); its inference op JIT-builds on first use (minutes).

DeepSpeed 0.19.8's injected layers take and return legacy (key, value) tuples, so they run only under a
transformers whose GPT-2 and LLaMA model loops still pass tuples (4.35.x; under 5.x GPT-2 fails with
"'DynamicCache' object has no attribute 'dtype'"). The wheels of transformers 4.35.2 with the tokenizers
and huggingface_hub its import check asks for are carried in .whl_tf4/ (requests & co., which 4.35 imports
and transformers 5 no longer needs, in .whl_tf4/extra/). On the GPU box, after
`source scripts/device_setup.sh && source scripts/device_deepspeed.sh`:

    python3 -m pip install -q --no-deps --no-index --target /tmp/tf4 .whl_tf4/*.whl
    python3 -c "import requests" 2>/dev/null || \
        python3 -m pip install -q --no-deps --no-index --target /tmp/tf4 .whl_tf4/extra/*.whl
    python3 benchmarks/inference.py --pythonpath /tmp/tf4 --model gpt2xl --batch 1 --new 64 --reps 3 \
        --systems hf,ours,ours-graph,deepspeed        # and --model llama1b_mha

(--pythonpath DIR puts DIR first on sys.path before transformers is imported; PYTHONPATH=/tmp/tf4:$PYTHONPATH
does the same.) DeepSpeed's first init_inference JIT-builds its inference op (~1-2 minutes, cached after):
building it beforehand (`python3 -c "from deepspeed.ops.op_builder import InferenceBuilder as B; B().load()"`)
keeps that out of a timed-out run."""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ALL_SYSTEMS = ["hf", "hf-compile", "ours", "ours-graph", "deepspeed"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="all", choices=[*MODELS, "all"])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-out-tokens", type=int, default=1024, help="KV cache of ours and DeepSpeed's (its default)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    ap.add_argument("--pythonpath", default="",
                    help="directories (':'-separated) put first on sys.path before transformers is imported, e.g. "
                         "/tmp/tf4 holding transformers 4.35.2 from .whl_tf4/ for the real DeepSpeed's injection")
    args = ap.parse_args()
    if args.pythonpath:
        if "transformers" in sys.modules:
            ap.error("--pythonpath: transformers is already imported; set PYTHONPATH instead")
        for d in reversed([d for d in args.pythonpath.split(":") if d]):
            if not os.path.isdir(d):
                ap.error(f"--pythonpath: {d} is not a directory")
            sys.path.insert(0, os.path.abspath(d))
    args.batches = [int(b) for b in args.batch.split(",")]
    args.system_list = [s for s in args.systems.split(",") if s]
    unknown = set(args.system_list) - set(ALL_SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {ALL_SYSTEMS}")
    if args.device == "cpu":  # smoke-test sizes
        args.batches, args.prompt, args.new, args.reps, args.max_out_tokens = [2], 16, 8, 1, 64
        args.system_list = [s for s in args.system_list if s in ("hf", "ours")]
    return args


# name -> (family, full-size shape); the CPU smoke test builds a tiny model of the same family and attention kind
MODELS: dict[str, tuple[str, dict[str, int]]] = {
    "llama1b": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)),
    "llama1b_mha": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                  max_position_embeddings=2048)),
    "gpt2xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257)),
}


def build(name: str, device: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    family, shape = MODELS[name]
    if device == "cpu":  # bos/eos inside the tiny vocabulary (transformers 4.x indexes the logits at eos)
        mha = shape.get("num_key_value_heads") == shape.get("num_attention_heads")
        shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4 if mha else 2) if family == "llama" else \
            dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)
        shape.update(vocab_size=128, bos_token_id=1, eos_token_id=2)
    cfg = LlamaConfig(**shape) if family == "llama" else GPT2Config(**shape)
    cls = LlamaForCausalLM if family == "llama" else GPT2LMHeadModel
    if device == "cpu":
        return cls(cfg).eval()
    with torch.device(device):
        model = cls(cfg)
    # transformers 4.3x keeps float cos/sin tables in each attention's rotary module; .to(bf16) would round
    # them for good, and the fp32 reference copies (bf16 weights widened) would inherit the rounded tables.
    # Kept in fp32 they still reach HF's bf16 attention as bf16 (it casts them at use), and ours reads them
    # after its init_inference's own cast, as HF uses them; the real DeepSpeed builds its own from rope_theta.
    tables = {n: b for n, b in model.named_buffers() if ".rotary_emb." in n} \
        if not hasattr(getattr(model, "model", None), "rotary_emb") else {}
    model.to(torch.bfloat16)
    for n, b in tables.items():
        owner, _, attr = n.rpartition(".")
        setattr(model.get_submodule(owner), attr, b)
    return model.eval()


def print_tail(what: str, e: BaseException, lines: int = 14) -> None:
    """A failure of one system: the exception, then the innermost frames of its traceback."""
    print(f"  {what}: {type(e).__name__}: {e}", flush=True)
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip().splitlines()
    print("\n".join("    | " + ln for ln in tb[-lines:]), flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def inject_ours(model: torch.nn.Module, dtype: torch.dtype, max_out: int, graphs: bool) -> torch.nn.Module:
    """Through the public init_inference when it is there, else the injection entry point."""
    import deepspeed_c
    try:
        engine = deepspeed_c.init_inference(model, dtype=dtype, replace_with_kernel_inject=True,
                                            max_out_tokens=max_out, enable_cuda_graph=graphs)
        return engine.module
    except (AttributeError, NotImplementedError, TypeError) as e:
        print(f"  (deepspeed_c.init_inference unavailable here: {type(e).__name__}: {e}; injecting directly)",
              flush=True)
    from deepspeed_c.module_inject.kernel_inject import inject
    return inject(model, SimpleNamespace(dtype=dtype, max_out_tokens=max_out, enable_cuda_graph=graphs))


def set_graphs(model: torch.nn.Module, on: bool) -> None:
    for m in model.modules():
        if hasattr(m, "enable_cuda_graph") and hasattr(m, "_graphs"):
            m.enable_cuda_graph = on


def _version(v: str) -> tuple[int, int]:
    parts = (v.split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def inject_deepspeed(model: torch.nn.Module, max_out: int) -> torch.nn.Module:
    """The real DeepSpeed's InferenceEngine: its forward runs the injected model, its generate resets
    DeepSpeed's KV workspace first (as a DeepSpeed user's script calls it)."""
    import deepspeed  # the real one (scripts/device_deepspeed.sh)
    where = os.path.dirname(os.path.abspath(deepspeed.__file__))
    if "dsc" in str(getattr(deepspeed, "__version__", "")) or where.startswith(ROOT):
        raise RuntimeError(f"`import deepspeed` gives deepspeed_c's compat alias ({where}), not the real DeepSpeed: "
                           "source scripts/device_deepspeed.sh (it puts /tmp/ds_real first)")
    print(f"  DeepSpeed {deepspeed.__version__} from {where}", flush=True)
    engine = deepspeed.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                      max_out_tokens=max_out)
    layers = [type(m).__name__ for m in engine.module.modules()
              if type(m).__module__.startswith("deepspeed.model_implementations")]
    if not layers:
        raise RuntimeError("DeepSpeed's init_inference returned the model without its injected transformer layers")
    print(f"  DeepSpeed injected {len(layers)} {layers[0]} layers", flush=True)
    return engine


def generate(model: torch.nn.Module, ids: torch.Tensor, new: int, static: bool = False) -> torch.Tensor:
    kw = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, **kw)


def prefill(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=torch.ones_like(ids), use_cache=True).logits


def fp32_check(base: torch.nn.Module, args: argparse.Namespace, vocab: int) -> bool:
    """ours and ours-graph in fp32 give HF eager fp32's greedy tokens."""
    ref = copy.deepcopy(base).float()
    ids = torch.randint(3, vocab, (2, 64 if args.device == "cuda" else 8), device=args.device)
    new = 32 if args.device == "cuda" else 8
    want = generate(ref, ids, new)
    ours = inject_ours(copy.deepcopy(base).float(), torch.float32, args.max_out_tokens, False)
    ok = True
    for graphs in (False, True) if args.device == "cuda" else (False,):
        set_graphs(ours, graphs)
        got = generate(ours, ids, new)
        same = torch.equal(got, want)
        ok &= same
        print(f"  check fp32 greedy {new} tokens, ours{'-graph' if graphs else ''} == hf: {same}"
              + ("" if same else f" (first difference at new token "
                 f"{int((got != want).any(0).nonzero()[0]) - ids.shape[1]})"), flush=True)
    del ref, ours
    gc.collect()
    return ok


def main() -> None:
    args = parse()
    dev = args.device
    # one process, no launcher: the rendezvous both init_inference calls may ask for
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29547")):
        os.environ.setdefault(key, value)
    if dev == "cuda":
        print(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    import transformers
    print(f"transformers {transformers.__version__} from {os.path.dirname(transformers.__file__)}", flush=True)
    if "hf-compile" in args.system_list and _version(transformers.__version__) < (4, 38):
        print("  hf-compile left out: generate(cache_implementation='static') needs transformers >= 4.38", flush=True)
        args.system_list.remove("hf-compile")
    models = list(MODELS) if args.model == "all" else [args.model]
    for name in models:
        run_model(name, args)


def run_model(name: str, args: argparse.Namespace) -> None:
    dev = args.device
    print(f"\n=== {name}: prompt {args.prompt}, {args.new} new tokens, greedy, batches {args.batches} ===", flush=True)
    base = build(name, dev)
    vocab = base.config.vocab_size
    nparams = sum(p.numel() for p in base.parameters())
    print(f"  {nparams / 1e9:.2f}B parameters, bf16" if dev == "cuda" else "  tiny smoke model", flush=True)
    system_list = list(args.system_list)
    if any(s.startswith("ours") for s in system_list):
        try:
            ok = fp32_check(base, args, vocab)
        except Exception as e:  # noqa: BLE001  (reported; the other systems still run)
            print_tail("ours: the fp32 check raised", e)
            ok = False
        if not ok:
            print("  ours FAILED the fp32 check: not timed", flush=True)
            system_list = [s for s in system_list if not s.startswith("ours")]
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32

    systems: dict[str, tuple[torch.nn.Module, Callable, Callable]] = {}
    # the real DeepSpeed set up last: its JIT build and injection cannot disturb the others' set-up
    for s in sorted(system_list, key=lambda name: name == "deepspeed"):
        try:
            if s == "hf":
                systems[s] = (base, lambda m, i: prefill(m, i), lambda m, i: generate(m, i, args.new))
            elif s == "hf-compile":
                systems[s] = (base, lambda m, i: prefill(m, i), lambda m, i: generate(m, i, args.new, static=True))
            elif s in ("ours", "ours-graph"):
                if "ours-model" not in systems:
                    systems["ours-model"] = (inject_ours(copy.deepcopy(base), dtype, args.max_out_tokens, False),
                                             None, None)
                graphs = s == "ours-graph"
                m = systems["ours-model"][0]

                def pre(mm, i, g=graphs):
                    set_graphs(mm, g)
                    return prefill(mm, i)

                def gen(mm, i, g=graphs):
                    set_graphs(mm, g)
                    return generate(mm, i, args.new)
                systems[s] = (m, pre, gen)
            elif s == "deepspeed":
                systems[s] = (inject_deepspeed(copy.deepcopy(base), args.max_out_tokens),
                              lambda m, i: prefill(m, i), lambda m, i: generate(m, i, args.new))
        except Exception as e:  # noqa: BLE001  (a competitor that cannot start is reported, not fatal)
            print_tail(f"{s}: could not be set up", e)
    systems.pop("ours-model", None)

    # bf16 correctness: prefill logits against the fp32 model's
    check_ids = torch.randint(3, vocab, (2, min(64, args.prompt)), device=dev)
    ref32 = copy.deepcopy(base).float()
    want = prefill(ref32, check_ids).float()
    del ref32
    gc.collect()
    errs: dict[str, float] = {}
    for s, (m, pre, _) in list(systems.items()):
        try:
            errs[s] = (pre(m, check_ids).float() - want).abs().max().item()
        except Exception as e:  # noqa: BLE001
            print_tail(f"{s}: prefill failed", e)
            systems.pop(s)
    hf_err = errs.get("hf", max(errs.values(), default=0.0))
    scale = want.abs().max().item()
    for s in list(systems):
        bad = errs[s] > 3 * hf_err + scale * 2 ** -7
        print(f"  check {dtype} prefill logits, {s}: max |logit - fp32 logit| {errs[s]:.4g} (hf {hf_err:.4g}, "
              f"logit scale {scale:.3g}){'  WRONG: not timed' if bad else ''}", flush=True)
        if bad:
            systems.pop(s)

    for batch in args.batches:
        run_batch(name, batch, systems, args, vocab)
    del systems, base
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def run_batch(name: str, batch: int, systems: dict, args: argparse.Namespace, vocab: int) -> None:
    dev = args.device
    ids = torch.randint(3, vocab, (batch, args.prompt), device=dev, generator=None)
    outs: dict[str, torch.Tensor] = {}
    for s, (m, pre, gen) in list(systems.items()):  # warm-up: compiles, captures, JIT builds
        try:
            pre(m, ids)
            outs[s] = gen(m, ids)
        except Exception as e:  # noqa: BLE001
            print_tail(f"{s} batch {batch}: failed", e)
    if "hf" in outs:
        for s, o in outs.items():
            if s != "hf":
                agree = (o[:, args.prompt:] == outs["hf"][:, args.prompt:]).float().mean().item()
                print(f"  batch {batch}: {s} greedy tokens equal hf's at {agree:.1%} of positions", flush=True)
    times: dict[str, dict[str, list[float]]] = {s: {"pre": [], "gen": []} for s in outs}
    for _ in range(args.reps):
        for s in outs:
            m, pre, gen = systems[s]
            sync(dev)
            t0 = time.perf_counter()
            pre(m, ids)
            sync(dev)
            t1 = time.perf_counter()
            gen(m, ids)
            sync(dev)
            t2 = time.perf_counter()
            times[s]["pre"].append(t1 - t0)
            times[s]["gen"].append(t2 - t1)
    print(f"\n  {name} batch {batch}: median of {args.reps} interleaved rounds", flush=True)
    print(f"  {'system':<12}{'prefill ms':>12}{'decode ms/tok':>15}{'tok/s':>10}{'decode x hf':>13}"
          f"{'prefill x hf':>14}", flush=True)
    res = {}
    for s, t in times.items():
        pre_s, gen_s = statistics.median(t["pre"]), statistics.median(t["gen"])
        dec = (gen_s - pre_s) / max(1, args.new - 1)
        res[s] = (pre_s, dec, batch * args.new / gen_s)
    for s, (pre_s, dec, tps) in res.items():
        hf = res.get("hf")
        dx = f"{hf[1] / dec:.2f}x" if hf else "-"
        px = f"{hf[0] / pre_s:.2f}x" if hf else "-"
        print(f"  {s:<12}{pre_s * 1e3:>12.2f}{dec * 1e3:>15.3f}{tps:>10.1f}{dx:>13}{px:>14}", flush=True)
    if "ours-graph" in res and "deepspeed" in res:
        print(f"  ours-graph vs deepspeed: decode {res['deepspeed'][1] / res['ours-graph'][1]:.2f}x, "
              f"prefill {res['deepspeed'][0] / res['ours-graph'][0]:.2f}x, "
              f"tok/s {res['ours-graph'][2] / res['deepspeed'][2]:.2f}x", flush=True)


if __name__ == "__main__":
    main()

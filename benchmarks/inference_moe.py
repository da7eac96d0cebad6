"""MoE inference decode (issue 39), side by side in one process on one GPU: a Mixtral-shaped decoder (random
weights from a config: hidden 4096, 8 experts top 2, FFN 14336, 32 heads over 8 kv heads; --layers of them), batch
1, bf16, greedy decode through generate():

  ours           deepspeed_c.init_inference(moe={"enabled": True, "ep_size": 1}, replace_with_kernel_inject=True,
                 enable_cuda_graph=True): fused attention kernels, the experts as device-indexed expert GEMVs, the
                 decode step one captured CUDA graph
  hf-sdpa        the Hugging Face model as built (SDPA attention), eager mode
  hf-eager-attn  the same model object with its eager attention
  deepspeed      the real DeepSpeed 0.19.8's init_inference with the same arguments (with kernel injection where it
                 takes the model, else without; which one is printed), where `import deepspeed` is the real one

Correctness first: prefill logits of ours and DeepSpeed's against the HF model's (bf16 each; relative norm error
printed, over 5e-2 marks a system WRONG and it is not timed) and our decode step (the expert-GEMV path, replayed
graph) against our prefill's last position (the grouped-expert GEMM path). Timings: medians of --reps interleaved
rounds, decode ms = (generate(new) - generate(1)) / (new - 1).

    python benchmarks/inference_moe.py [--layers 8 --new 32 --reps 3]
    python benchmarks/inference_moe.py --device cpu      # a smoke run on a tiny model (fp32)
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inference_rest import decode_ms, rel, rounds  # noqa: E402


def mixtral(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    import transformers as tf

    big = args.device != "cpu"
    cfg = tf.MixtralConfig(vocab_size=32000 if big else 101, hidden_size=4096 if big else 64,
                           intermediate_size=14336 if big else 96, num_hidden_layers=args.layers,
                           num_attention_heads=32 if big else 4, num_key_value_heads=8 if big else 2,
                           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the timed dtype: no float32 copy of a 10B-parameter model
    try:
        with torch.device(args.device):
            model = tf.MixtralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _set_attention(model: torch.nn.Module, impl: str) -> torch.nn.Module:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl
    return model


def _deepspeed(base: torch.nn.Module, kw: dict) -> tuple[Any, str]:
    import deepspeed  # the real one (scripts/device_deepspeed.sh puts /tmp/ds_real first)

    if "dsc" in str(getattr(deepspeed, "__version__", "")):
        raise RuntimeError("`import deepspeed` is deepspeed_c's alias, not the real DeepSpeed")
    try:
        return deepspeed.init_inference(copy.deepcopy(base), replace_with_kernel_inject=True, **kw), "injected"
    except Exception as e:  # noqa: BLE001 - its refusal is printed; it then runs as DeepSpeed runs it without
        print(f"  deepspeed with replace_with_kernel_inject=True: {type(e).__name__}: {str(e)[:200]}")
        return deepspeed.init_inference(copy.deepcopy(base), replace_with_kernel_inject=False, **kw), "not injected"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    import transformers

    import deepspeed_c

    transformers.logging.set_verbosity_error()
    if args.device == "cpu":
        args.layers, args.new, args.reps = 2, 4, 1
    dev, dt = args.device, (torch.bfloat16 if args.device != "cpu" else torch.float32)
    base = mixtral(args, dt)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"== moe decode: Mixtral-shaped, {args.layers} layers, {n_params / 1e9:.2f}B parameters, 8 experts top 2, "
          f"batch 1, {str(dt)[6:]}, prompt {args.prompt}, {args.new} new tokens ==")
    kw = dict(dtype=dt, max_out_tokens=args.prompt + args.new + 8, moe={"enabled": True, "ep_size": 1})
    systems: dict[str, Any] = {
        "ours": deepspeed_c.init_inference(copy.deepcopy(base), replace_with_kernel_inject=True,
                                           enable_cuda_graph=dev != "cpu", **kw)}
    if dev != "cpu" and not args.no_deepspeed:
        try:
            systems["deepspeed"], how = _deepspeed(base, kw)
            print(f"  deepspeed: {how}")
        except Exception as e:  # noqa: BLE001
            print(f"  deepspeed: n/a ({type(e).__name__}: {str(e)[:200]})")
    ids = torch.randint(3, base.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        want = _set_attention(base, "sdpa")(input_ids=ids).logits
        bad = set()
        for name, m in systems.items():
            err = rel(m(input_ids=ids).logits, want)
            print(f"  {name} prefill logits rel err vs HF (same dtype): {err:.3e}")
            if err > 5e-2:
                bad.add(name)
        e = systems["ours"]
        out = e(input_ids=ids[:, :-1], use_cache=True)
        step = e(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
        print(f"  ours decode step (expert GEMVs) vs its prefill's last position (grouped experts): rel err "
              f"{rel(step, e(input_ids=ids).logits[:, -1]):.3e}")
    timed = {n: m for n, m in systems.items() if n not in bad}
    timed["hf-sdpa"] = base
    timed["hf-eager-attn"] = base
    runs = {n: (lambda n=n, m=m: decode_ms(_set_attention(m, "eager") if n == "hf-eager-attn" else
                                           (_set_attention(m, "sdpa") if n == "hf-sdpa" else m), ids, args.new, dev)[0])
            for n, m in timed.items()}
    for fn in runs.values():
        fn()  # warm-up (captures our decode graph)
    res = rounds(runs, args.reps)
    ref = res.get("deepspeed")
    print(f"  {'system':14s} {'decode ms/token':>16s} {'hf-sdpa/sys':>12s} {'hf-eager-attn/sys':>18s}"
          + ("  deepspeed/sys" if ref else ""))
    for n, v in res.items():
        print(f"  {n:14s} {v:16.3f} {res['hf-sdpa'] / v:11.2f}x {res['hf-eager-attn'] / v:17.2f}x"
              + (f"  {ref / v:12.2f}x" if ref else ""))


if __name__ == "__main__":
    main()

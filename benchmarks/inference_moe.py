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

Correctness first, in float32 on a one-layer model of the same width (a bf16 comparison of random-weight MoE
stacks says little: bf16 noise flips near-tied routing choices, and each flip moves the logits): our prefill
logits against HF's (relative norm error over 1e-3 marks ours WRONG and nothing is timed), 8 greedy tokens equal
HF's, and our decode step (expert GEMVs, replayed graph) against our prefill's last position (grouped expert
GEMMs). Then the bf16 models' prefill logits against HF bf16 are printed (information). Timings: medians of --reps
interleaved rounds, decode ms = (generate(new) - generate(1)) / (new - 1).

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


def check_fp32(args: argparse.Namespace) -> bool:
    import deepspeed_c

    one = argparse.Namespace(**{**vars(args), "layers": 1})
    ref = _set_attention(mixtral(one, torch.float32), "eager")
    ours = deepspeed_c.init_inference(copy.deepcopy(ref), dtype=torch.float32, replace_with_kernel_inject=True,
                                      enable_cuda_graph=args.device != "cpu", max_out_tokens=64,
                                      moe={"enabled": True, "ep_size": 1})
    ids = torch.randint(3, ref.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3)).to(args.device)
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        err = rel(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
        same = torch.equal(ours.generate(input_ids=ids, **gen), ref.generate(input_ids=ids, **gen))
        out = ours(input_ids=ids[:, :-1], use_cache=True)
        step = ours(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
        step_err = rel(step, ours(input_ids=ids).logits[:, -1])
    ok = err <= 1e-3 and same and step_err <= 1e-3
    print(f"  fp32 check (1 layer, same width): prefill logits rel err vs HF {err:.2e}; 8 greedy tokens equal HF: "
          f"{same}; decode step vs prefill last position {step_err:.2e} -> {'PASS' if ok else 'WRONG'}")
    del ours, ref
    torch.cuda.empty_cache() if args.device != "cpu" else None
    return ok


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
    if not check_fp32(args):
        return
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
        for name, m in systems.items():
            print(f"  {name} prefill logits rel err vs HF {str(dt)[6:]} (information): "
                  f"{rel(m(input_ids=ids).logits, want):.3e}")
    timed = dict(systems)
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

"""DeepSpeedTransformerLayer (ours: GEMMs in cuBLAS, fused CUDA pieces between them) against
Hugging Face's BertLayer, eager and under torch.compile, on a BERT-Large layer stack (hidden 1024,
16 heads, FFN 4096), one training step = forward + backward. DeepSpeed's own transformer kernel
joins when it builds (its error is printed otherwise). One GPU.

"ours" runs the attention core through torch's fused SDPA (the GPU default), "ours-softmax"
through our masked-softmax kernel between two GEMMs. "hf" is BertLayer as transformers 5 builds it
(SDPA attention), "hf-eager-attn" with the eager attention (scores materialised), "hf-compile" the
"hf" layers each under torch.compile (static shapes; one compiled graph serves every layer).
First correctness: our fp16/bf16 layer against float32 references (post-LN: HF BertLayer with the same weights; pre-LN: the layer written out in torch), odd sequence lengths and random padding
masks, and every memory flag on against off. Then step time (median of interleaved reps),
tokens/s and ratios; then the activation memory a forward keeps with and without the memory flags.

    python benchmarks/transformer_kernel.py                 # 24 layers, seq 128 (batch 64) and 512 (batch 16)
    python benchmarks/transformer_kernel.py --small         # .devrun/gpu_41.sh
"""
from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_c.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer  # noqa: E402
from deepspeed_c.ops.transformer.hf_bert import layer_from_bert  # noqa: E402
from deepspeed_c.ops.transformer.transformer_function import WEIGHT_NAMES  # noqa: E402

FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")


def bert_config(hidden, heads, inter, dropout, attn="sdpa"):
    """HF BERT's config; transformers 5's default attention is SDPA, "eager" materialises the scores."""
    from transformers import BertConfig

    cfg = BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=inter,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    cfg._attn_implementation = attn
    return cfg


def ds_config(hidden, heads, inter, dropout, pre_ln=False, **flags):
    return DeepSpeedTransformerConfig(batch_size=-1, hidden_size=hidden, intermediate_size=inter, heads=heads,
                                      attn_dropout_ratio=dropout, hidden_dropout_ratio=dropout, num_hidden_layers=24,
                                      initializer_range=0.02, pre_layer_norm=pre_ln, **flags)


class Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
            x = x[0] if isinstance(x, tuple) else x
        return x


def padding_mask(B, S, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(S // 2, S + 1, (B,), device="cuda", generator=g)
    keep = torch.arange(S, device="cuda")[None] < lengths[:, None]
    return ((~keep).to(dtype) * torch.finfo(dtype).min)[:, None, None, :]


def step(model, x, mask):
    """Forward and backward against a fixed random output gradient (a LayerNorm output's own norm
    would have a zero gradient: a post-LN layer's dx would be all rounding)."""
    x = x.detach().requires_grad_(True)
    out = model(x, mask)
    g = torch.Generator(device=x.device).manual_seed(1234)
    out.backward(torch.randn(out.shape, device=x.device, generator=g).to(out.dtype))
    return out.detach(), x.grad


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def pre_ln_reference(x, mask, w, heads, eps):
    B, S, H = x.shape
    d = H // heads
    h0 = F.layer_norm(x, (H,), w["norm_w"], w["norm_b"], eps)
    q, k, v = F.linear(h0, w["attn_qkvw"], w["attn_qkvb"]).view(B, S, 3, heads, d).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-1, -2) / d ** 0.5 + mask
    r1 = x + F.linear((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, S, H), w["attn_ow"], w["attn_ob"])
    h1 = F.layer_norm(r1, (H,), w["attn_nw"], w["attn_nb"], eps)
    return r1 + F.linear(F.gelu(F.linear(h1, w["inter_w"], w["inter_b"])), w["output_w"], w["output_b"])


class PreLNRef(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.w = torch.nn.ParameterDict({n: torch.nn.Parameter(getattr(layer, n).detach().float().clone())
                                         for n in WEIGHT_NAMES})
        self.heads, self.eps = layer.config.heads, layer.config.layer_norm_eps

    def forward(self, x, mask):
        return pre_ln_reference(x, mask, self.w, self.heads, self.eps)


def check(hidden, heads, inter) -> bool:
    from transformers.models.bert.modeling_bert import BertLayer

    ok = True
    print("correctness: ours (fp16/bf16, CUDA kernels) vs float32 reference; max |err| / max |ref|")
    print(f"{'case':>40} {'dtype':>9} {'out':>9} {'dx':>9} {'worst dW':>9}")
    for pre_ln, impl in itertools.product((False, True), ("sdpa", "softmax")):
        for S in (13, 128):
            for dtype in (torch.float16, torch.bfloat16):
                torch.manual_seed(S)
                hf = BertLayer(bert_config(hidden, heads, inter, 0.0)).cuda()
                with torch.no_grad():
                    for p in hf.parameters():
                        if p.dim() == 1:
                            p.add_(torch.randn_like(p) * 0.1)
                layer = layer_from_bert(hf, ds_config(hidden, heads, inter, 0.0))
                layer.config.pre_layer_norm = pre_ln  # same weights, the pre-LN wiring
                ref = PreLNRef(layer) if pre_ln else hf
                B = 4
                x = torch.randn(B, S, hidden, device="cuda")
                mask = padding_mask(B, S, torch.float32, S)
                want, want_dx = step(ref, x, mask)
                ref_grads = ({n: ref.w[n].grad for n in WEIGHT_NAMES} if pre_ln else
                             {n: g for n, g in zip(WEIGHT_NAMES, hf_grads(hf))})
                ours = copy.deepcopy(layer).to(dtype)
                ours.attention_impl = impl
                got, got_dx = step(ours, x.to(dtype), mask.to(dtype).clamp_min(-1e4))
                dw = max(rel_err(getattr(ours, n).grad, ref_grads[n]) for n in WEIGHT_NAMES)
                errs = [rel_err(got, want), rel_err(got_dx, want_dx), dw]
                tol = 4e-2 if dtype == torch.bfloat16 else 1e-2
                good = all(e < tol for e in errs)
                ok &= good
                name = f"{'pre' if pre_ln else 'post'}-LN {impl} S={S} masked"
                print(f"{name:>40} {str(dtype)[6:]:>9} " + " ".join(f"{e:9.2e}" for e in errs)
                      + ("" if good else f"  FAIL (tol {tol})"))
    # every flag combination against flags off, bf16, dropout on (one seed: the same masks)
    for pre_ln, impl in itertools.product((False, True), ("sdpa", "softmax")):
        x = torch.randn(4, 77, hidden, device="cuda", dtype=torch.bfloat16)
        mask = padding_mask(4, 77, torch.bfloat16, 1).clamp_min(-1e4)
        base = None
        worst = 0.0
        for combo in [(False, False, False), (True, False, False), (False, True, False), (False, False, True),
                      (True, True, True)]:
            torch.manual_seed(0)
            layer = DeepSpeedTransformerLayer(ds_config(hidden, heads, inter, 0.1, pre_ln=pre_ln, seed=3,
                                                        **dict(zip(FLAGS, combo))))
            layer.config.layer_id = 0
            layer = layer.cuda().to(torch.bfloat16)
            layer.attention_impl = impl
            out, dx = step(layer, x, mask)
            res = [out, dx] + [getattr(layer, n).grad for n in WEIGHT_NAMES]
            if base is None:
                base = res
            worst = max([worst] + [rel_err(a, b) for a, b in zip(res, base)])
        good = worst < 2e-2
        ok &= good
        name = f"{'pre' if pre_ln else 'post'}-LN {impl} flags on vs off S=77"
        print(f"{name:>40} {'bf16':>9} {worst:9.2e}"
              + ("" if good else "  FAIL"))
    return ok


def hf_grads(hf):
    s, a = hf.attention.self, hf.attention.output
    return [torch.cat([s.query.weight.grad, s.key.weight.grad, s.value.weight.grad]),
            torch.cat([s.query.bias.grad, s.key.bias.grad, s.value.bias.grad]), a.dense.weight.grad,
            a.dense.bias.grad, a.LayerNorm.weight.grad, a.LayerNorm.bias.grad, hf.intermediate.dense.weight.grad,
            hf.intermediate.dense.bias.grad, hf.output.dense.weight.grad, hf.output.dense.bias.grad,
            hf.output.LayerNorm.weight.grad, hf.output.LayerNorm.bias.grad]


def deepspeed_stack(hidden, heads, inter, dropout, n_layers, dtype, hf_layers):
    from deepspeed.ops.transformer import DeepSpeedTransformerConfig as DSConfig
    from deepspeed.ops.transformer import DeepSpeedTransformerLayer as DSLayer

    layers = []
    for hf in hf_layers:
        cfg = DSConfig(batch_size=64, hidden_size=hidden, intermediate_size=inter, heads=heads,
                       attn_dropout_ratio=dropout, hidden_dropout_ratio=dropout, num_hidden_layers=n_layers,
                       initializer_range=0.02, fp16=dtype == torch.float16, pre_layer_norm=False, training=True)
        layer = DSLayer(cfg).cuda().to(dtype)
        ours = layer_from_bert(hf, ds_config(hidden, heads, inter, dropout))
        layer.load_state_dict(ours.state_dict())
        layers.append(layer)
    return Stack(layers)


def compiled_stack(hf_layers) -> Stack:
    """HF's layers, each under torch.compile (static shapes): the layers share one compiled graph
    (parameters are graph inputs), so a deep stack compiles in the time of one layer."""
    return Stack([torch.compile(layer, dynamic=False) for layer in hf_layers])


def compile_warmup(hidden, heads, inter, shapes, dtype) -> None:
    """One HF layer's compiled training step at each shape: fills torch.compile's on-disk caches
    (FX graphs, Triton kernels) so that a later process times instead of compiling."""
    from transformers.models.bert.modeling_bert import BertLayer

    layer = BertLayer(bert_config(hidden, heads, inter, 0.1)).cuda().to(dtype)
    model = compiled_stack([layer])
    for B, S in shapes:  # as bench() runs it: an eval forward (the agreement check), then a step
        x = torch.randn(B, S, hidden, device="cuda", dtype=dtype)
        mask = padding_mask(B, S, dtype, 0).clamp_min(-1e4)
        model.eval()
        with torch.no_grad():
            model(x, mask)
        model.train()
        step(model, x, mask)
    torch.cuda.synchronize()
    print(f"compile warm-up done: {shapes}")


def bench(hidden, heads, inter, n_layers, B, S, dtype, reps, compile_hf: bool, with_deepspeed: bool,
          only: set[str] | None = None) -> None:
    from transformers.models.bert.modeling_bert import BertLayer

    dropout = 0.1
    torch.manual_seed(0)
    hf_layers = [BertLayer(bert_config(hidden, heads, inter, dropout)).cuda().to(dtype) for _ in range(n_layers)]
    def ours(impl):
        stack = Stack([layer_from_bert(layer, ds_config(hidden, heads, inter, dropout)) for layer in hf_layers])
        for layer in stack.layers:
            layer.attention_impl = impl
        return stack

    def hf_eager_attention():
        layers = []
        for layer in hf_layers:
            twin = BertLayer(bert_config(hidden, heads, inter, dropout, attn="eager")).cuda().to(dtype)
            twin.load_state_dict(layer.state_dict())
            layers.append(twin)
        return Stack(layers)

    systems = {"ours": lambda: ours("sdpa"), "ours-softmax": lambda: ours("softmax"), "hf": lambda: Stack(hf_layers),
               "hf-eager-attn": hf_eager_attention}
    if compile_hf:
        systems["hf-compile"] = lambda: compiled_stack(hf_layers)
    if only:
        systems = {k: v for k, v in systems.items() if k == "ours" or k in only}
    try:
        import deepspeed  # noqa: F401
        if with_deepspeed:
            systems["deepspeed"] = lambda: deepspeed_stack(hidden, heads, inter, dropout, n_layers, dtype, hf_layers)
        else:
            print("  deepspeed: installed; its JIT kernel build is skipped in this run (--deepspeed builds it)")
    except ImportError as e:
        print(f"  deepspeed: not installed ({e})")
    x = torch.randn(B, S, hidden, device="cuda", dtype=dtype)
    mask = padding_mask(B, S, dtype, 0).clamp_min(-1e4)
    live = {}
    ref_out = None
    for name, build in systems.items():
        try:
            model = build()
            model.eval()  # correctness of the stack: dropout off, same weights, outputs against ours
            with torch.no_grad():
                out = model(x, mask)
            if ref_out is None:
                ref_out = out
            else:
                print(f"  {name}: eval output vs ours {rel_err(out, ref_out):.2e} (max rel err)")
            model.train()
            step(model, x, mask)  # warm-up (compiles)
            live[name] = model
        except Exception as e:
            print(f"  {name}: not run: {type(e).__name__}: {' '.join(str(e).split())[:400]}")
    times = {name: [] for name in live}
    host = {name: [] for name in live}  # the time to enqueue the step: ~ the GPU time when host-bound
    for _ in range(reps):
        for name, model in live.items():
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step(model, x, mask)
            end.record()
            host[name].append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    print(f"\ntraining step (fwd+bwd), {n_layers} BERT-Large layers, batch {B} x seq {S}, {str(dtype)[6:]}, "
          f"dropout 0.1, median of {reps} interleaved reps")
    print(f"{'system':>12} {'ms':>9} {'host ms':>9} {'tokens/s':>11} {'ours speed-up':>14}")
    t_ours = statistics.median(times["ours"])
    for name in live:
        t = statistics.median(times[name])
        print(f"{name:>12} {t:9.2f} {statistics.median(host[name]):9.2f} {B * S / t * 1e3:11.0f} "
              f"{t / t_ours:13.2f}x")


def profile(hidden, heads, inter, n_layers, B, S, dtype, steps: int = 3) -> None:
    """Per training step, the CUDA time of the costliest kernels of ours and of HF (SDPA and eager
    attention), from torch.profiler: where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from transformers.models.bert.modeling_bert import BertLayer

    dropout = 0.1
    torch.manual_seed(0)
    hf_layers = [BertLayer(bert_config(hidden, heads, inter, dropout)).cuda().to(dtype) for _ in range(n_layers)]
    eager = []
    for layer in hf_layers:
        twin = BertLayer(bert_config(hidden, heads, inter, dropout, attn="eager")).cuda().to(dtype)
        twin.load_state_dict(layer.state_dict())
        eager.append(twin)
    systems = {"ours": Stack([layer_from_bert(layer, ds_config(hidden, heads, inter, dropout)) for layer in hf_layers]),
               "hf": Stack(hf_layers), "hf-eager-attn": Stack(eager)}
    x = torch.randn(B, S, hidden, device="cuda", dtype=dtype)
    mask = padding_mask(B, S, dtype, 0).clamp_min(-1e4)
    for name, model in systems.items():
        model.train()
        step(model, x, mask)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step(model, x, mask)
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()
                if e.device_time_total > 0]
        total = sum(r[1] for r in rows)
        rows.sort(key=lambda r: -r[1])
        print(f"\n{name}: {total:.2f} ms of kernels per step ({n_layers} layers, batch {B} x seq {S}), "
              f"{sum(r[2] for r in rows)} launches; costliest:")
        for key, ms, count in rows[:24]:
            print(f"  {ms:7.3f} ms x{count:<4} {key[:100]}")


def activation_memory(hidden, heads, inter, n_layers, B, S, dtype) -> None:
    from transformers.models.bert.modeling_bert import BertLayer

    x = torch.randn(B, S, hidden, device="cuda", dtype=dtype, requires_grad=True)
    mask = padding_mask(B, S, dtype, 0).clamp_min(-1e4)
    rows = []
    variants = [("hf", None, None), ("ours", {}, "sdpa"), ("ours-softmax", {}, "softmax"),
                ("ours-softmax +normalize_invertible", {"normalize_invertible": True}, "softmax"),
                ("ours-softmax +gelu_checkpoint", {"gelu_checkpoint": True}, "softmax"),
                ("ours-softmax +attn_dropout_checkpoint", {"attn_dropout_checkpoint": True}, "softmax"),
                ("ours-softmax, all three flags", dict.fromkeys(FLAGS, True), "softmax"),
                ("ours, all three flags", dict.fromkeys(FLAGS, True), "sdpa")]
    for name, flags, impl in variants:
        if flags is None:
            model = Stack([BertLayer(bert_config(hidden, heads, inter, 0.1)) for _ in range(n_layers)])
        else:
            model = Stack([DeepSpeedTransformerLayer(ds_config(hidden, heads, inter, 0.1, **flags))
                           for _ in range(n_layers)])
            for layer in model.layers:
                layer.attention_impl = impl
        model = model.cuda().to(dtype).train()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(x, mask)
        torch.cuda.synchronize()
        kept = (torch.cuda.memory_allocated() - before) / 2**20
        out.float().mean().backward()
        rows.append((name, kept))
        del model, out
        x.grad = None
    print(f"\nactivation memory kept by the forward for backward, {n_layers} layers, batch {B} x seq {S}, "
          f"{str(dtype)[6:]}, dropout 0.1")
    base = max(dict(rows)["ours"], 1e-9)
    for name, kept in rows:
        print(f"{name:>38} {kept:10.1f} MiB {kept / base:7.2f}x of ours")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--deepspeed", action="store_true", help="build and time DeepSpeed's own kernel (minutes)")
    ap.add_argument("--skip-check", action="store_true", help="no correctness table (timings still check agreement)")
    ap.add_argument("--no-memory", action="store_true", help="skip the activation-memory table")
    ap.add_argument("--profile-only", action="store_true",
                    help="only the per-kernel CUDA time of a step (ours, HF SDPA, HF eager), 2 layers, seq 128")
    ap.add_argument("--check-only", action="store_true", help="only the correctness table against HF BertLayer")
    ap.add_argument("--systems", default="", help="comma list of the systems timed beside 'ours' "
                    "(ours-softmax, hf, hf-eager-attn, hf-compile, deepspeed); default: all")
    ap.add_argument("--seqs", default="128,512", help="sequence lengths timed (batch 64 at 128, 16 at 512)")
    ap.add_argument("--compile-warmup", action="store_true",
                    help="only compile one HF layer's step at the timed shapes (fills torch.compile's caches)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/transformer_kernel.py needs a GPU")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    hidden, heads, inter = 1024, 16, 4096
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    batch_for = {128: 64, 512: 16}
    shapes = [(64, 128)] if args.small else [(batch_for.get(int(S), 8192 // int(S)), int(S))
                                             for S in args.seqs.split(",")]
    if args.compile_warmup:
        compile_warmup(hidden, heads, inter, shapes, dtype)
        return
    if args.profile_only:
        profile(hidden, heads, inter, 2, 64, 128, dtype)
        return
    ok = True if args.skip_check else check(hidden, heads, inter)
    if args.check_only:
        print("\ntransformer layer correctness:", "PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)
    layers = 2 if args.small else args.layers
    reps = 5 if args.small else args.reps
    only = {n for n in args.systems.split(",") if n} or None
    for B, S in shapes:
        try:
            bench(hidden, heads, inter, layers, B, S, dtype, reps, compile_hf=not args.no_compile,
                  with_deepspeed=args.deepspeed, only=only)
        except Exception:
            traceback.print_exc()
            ok = False
    if not args.no_memory:
        activation_memory(hidden, heads, inter, layers, 16, 512 if not args.small else 128, dtype)
    if args.skip_check:
        print("\ntransformer layer timings:", "done" if ok else "FAIL (see the traceback above)")
    else:
        print("\ntransformer layer correctness:", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()

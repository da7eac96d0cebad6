"""Session 8, issue 41: where the GPU idles in a training step of 8 BERT-Large layers (batch 64 x seq 128, bf16),
ours vs HF (SDPA): host time to enqueue a step vs its GPU time, and a chrome trace of one step each in $OUT."""
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import transformer_kernel as tk  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

out_dir = os.environ.get("OUT", "/tmp")
dtype, hidden, heads, inter, n_layers, B, S = torch.bfloat16, 1024, 16, 4096, 8, 64, 128
torch.manual_seed(0)
hf_layers = [BertLayer(tk.bert_config(hidden, heads, inter, 0.1)).cuda().to(dtype) for _ in range(n_layers)]
ours = tk.Stack([tk.layer_from_bert(layer, tk.ds_config(hidden, heads, inter, 0.1)) for layer in hf_layers])
systems = {"ours": ours, "hf": tk.Stack(hf_layers)}
x = torch.randn(B, S, hidden, device="cuda", dtype=dtype)
mask = tk.padding_mask(B, S, dtype, 0).clamp_min(-1e4)
for m in systems.values():
    m.train()
    tk.step(m, x, mask)
torch.cuda.synchronize()
res = {k: ([], []) for k in systems}
for _ in range(7):
    for name, m in systems.items():
        for p in m.parameters():
            p.grad = None
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        tk.step(m, x, mask)
        b.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[name][0].append(a.elapsed_time(b))
        res[name][1].append((t1 - t0) * 1e3)
for name, (g, h) in res.items():
    g, h = sorted(g), sorted(h)
    print(f"{name:>5}: GPU step {g[3]:.2f} ms, host enqueue {h[3]:.2f} ms (median of 7)")
from torch.profiler import ProfilerActivity, profile  # noqa: E402
for name, m in systems.items():
    for p in m.parameters():
        p.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tk.step(m, x, mask)
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(out_dir, f"trace41_{name}.json"))
    print(f"trace of {name} written")

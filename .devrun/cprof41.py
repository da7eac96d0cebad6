"""Session 8, issue 41: where the host's time goes in our layer's training step (8 BERT-Large layers, 64 x 128,
bf16, dropout 0.1): cProfile over 10 steps, by own time and by cumulative time."""
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import transformer_kernel as tk  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

dtype = torch.bfloat16
torch.manual_seed(0)
hf_layers = [BertLayer(tk.bert_config(1024, 16, 4096, 0.1)).cuda().to(dtype) for _ in range(8)]
ours = tk.Stack([tk.layer_from_bert(layer, tk.ds_config(1024, 16, 4096, 0.1)) for layer in hf_layers]).train()
x = torch.randn(64, 128, 1024, device="cuda", dtype=dtype)
mask = tk.padding_mask(64, 128, dtype, 0).clamp_min(-1e4)
for _ in range(3):
    tk.step(ours, x, mask)
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(10):
    for p in ours.parameters():
        p.grad = None
    tk.step(ours, x, mask)
    torch.cuda.synchronize()
prof.disable()
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumulative").print_stats(30)

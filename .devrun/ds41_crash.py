"""Session 8, issue 41: where DeepSpeed 0.19.8's DeepSpeedTransformerLayer crashes on this GPU (fp16, the dtype
its kernel takes), step by step, with faulthandler's traceback."""
import faulthandler
import sys

import torch

faulthandler.enable()
from deepspeed.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer  # noqa: E402

for B in (64, 8):
    cfg = DeepSpeedTransformerConfig(batch_size=B, hidden_size=1024, intermediate_size=4096, heads=16,
                                     attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=1,
                                     initializer_range=0.02, fp16=True, pre_layer_norm=False, training=True)
    layer = DeepSpeedTransformerLayer(cfg).cuda().half()
    print(f"B={B}: constructed", flush=True)
    x = torch.randn(B, 128, 1024, device="cuda", dtype=torch.half, requires_grad=True)
    mask = torch.zeros(B, 1, 1, 128, device="cuda", dtype=torch.half)
    y = layer(x, mask)
    y = y[0] if isinstance(y, tuple) else y
    torch.cuda.synchronize()
    print(f"B={B}: forward ok, out finite {bool(torch.isfinite(y).all())}", flush=True)
    y.float().sum().backward()
    torch.cuda.synchronize()
    print(f"B={B}: backward ok", flush=True)
sys.exit(0)

"""The training script benchmarks/autotuning_vs_exhaustive.py tunes: a GPT (deepspeed_c/profiling/
toy_models.py, the model the profiler tests count) on random tokens through deepspeed_c.initialize,
for --steps global steps (an autotuning experiment's engine stops it after end_profile_step).
--mbs and --checkpoint_activations are the flags the tuner's arg_mappings drive."""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import deepspeed_c  # noqa: E402
from deepspeed_c.profiling.toy_models import GPT  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=-1)
ap.add_argument("--deepspeed_config", required=True)
ap.add_argument("--mbs", type=int, default=1)
ap.add_argument("--checkpoint_activations", default="false", choices=["true", "false", "auto"])
for name, default in (("d", 2048), ("layers", 16), ("heads", 16), ("vocab", 32000), ("seq", 1024), ("steps", 20)):
    ap.add_argument(f"--{name}", type=int, default=default)
a = ap.parse_args()
torch.manual_seed(0)
model = GPT(a.vocab, a.seq, a.d, a.layers, a.heads, checkpoint_activations=a.checkpoint_activations == "true")
engine, _, _, _ = deepspeed_c.initialize(model=model, config=a.deepspeed_config)
while engine.global_steps < a.steps:
    ids = torch.randint(0, a.vocab, (a.mbs, a.seq), device=engine.device)
    logits = engine(ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    engine.backward(loss)
    engine.step()

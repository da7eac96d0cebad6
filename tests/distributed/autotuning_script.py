"""A user training script for the autotuning test: reads --deepspeed_config and --mbs (mapped by
autotuning.arg_mappings), trains a small GPT-like MLP stack with deepspeed_c, and, when it runs to
the end (not stopped by an autotuning experiment), writes which config it ran with to --marker.
With --crash_stage S --crash_mbs M it dies like an out-of-memory run at that point of the space.
--ckpt true runs each hidden block under deepspeed_c.checkpointing.checkpoint (the tuner maps its
activation-checkpointing axis onto this flag)."""
import argparse
import json
import os

import torch

import deepspeed_c

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--deepspeed_config", type=str, required=True)
parser.add_argument("--mbs", type=int, default=1)
parser.add_argument("--marker", type=str, required=True)
parser.add_argument("--crash_stage", type=int, default=-1)
parser.add_argument("--crash_mbs", type=int, default=-1)
parser.add_argument("--ckpt", type=str, default="false", choices=["true", "false"])
args = parser.parse_args()
with open(args.deepspeed_config) as f:
    cfg = json.load(f)
stage, mbs = cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"]
assert mbs == args.mbs, (mbs, args.mbs)  # the arg mapping carries the tuned value
if (stage, mbs) == (args.crash_stage, args.crash_mbs):
    raise MemoryError(f"simulated out of memory at stage {stage}, micro-batch {mbs}")
torch.manual_seed(0)


class Net(torch.nn.Sequential):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if args.ckpt == "true" and not x.requires_grad:
            x = x.detach().requires_grad_()  # a reentrant checkpoint passes gradients only to inputs needing them
        for block in self[:3]:
            x = deepspeed_c.checkpointing.checkpoint(block, x) if args.ckpt == "true" else block(x)
        return self[3](x)


model = Net(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3)],
            torch.nn.Linear(32, 1))
engine, _, _, _ = deepspeed_c.initialize(model=model, config=cfg,
                                         optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
for step in range(6):
    x = torch.randn(mbs, 32)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
if engine.global_rank == 0:
    with open(args.marker, "w") as f:
        json.dump({"stage": stage, "mbs": mbs, "gas": engine.gradient_accumulation_steps(), "ckpt": args.ckpt,
                   "steps": engine.global_steps}, f)
engine.destroy()
torch.distributed.barrier()
torch.distributed.destroy_process_group()

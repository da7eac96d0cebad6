"""The tiny GPT fine-tune the ZenFlow and SuperOffload tests train (examples/train_gpt's GPT): a learnable
next-token rule over a fixed set of sequences, so losses fall and a lagging optimizer shows."""
from __future__ import annotations

import copy
import os
import sys
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, SEQ, MICRO = 24, 12, 4


def make_gpt(seed: int = 0) -> torch.nn.Module:
    sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))


def batch(step: int, rank: int, world: int, rule: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences x[t+1] = (3 x[t] + 1 + t % (rule + 1)) mod VOCAB from seeded starts; rank r takes its slice."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, VOCAB, (MICRO * world,), generator=g)
    seq = [starts]
    for t in range(SEQ):
        seq.append((3 * seq[-1] + 1 + t % (rule + 1)) % VOCAB)
    full = torch.stack(seq, 1)
    lo, hi = rank * MICRO, (rank + 1) * MICRO
    return full[lo:hi, :SEQ].contiguous(), full[lo:hi, 1:].contiguous()


def pretrained_gpt(steps: int = 150, seed: int = 0) -> torch.nn.Module:
    """The GPT after `steps` plain torch AdamW steps on rule 1 (the fine-tunes then learn rule 2)."""
    model = make_gpt(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for s in range(steps):
        x, y = batch(10_000 + s, 0, 2, rule=1)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model


def ds_config(stage: int, zenflow: Optional[dict] = None, offload: Optional[dict] = None,
              clip: float = 1.0, bf16: bool = False, lr: float = 3e-3) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                            "offload_optimizer": dict(offload or {"device": "cpu"})}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
           "zero_optimization": zero}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(rank: int, world: int, config: dict, steps: int, model: Optional[torch.nn.Module] = None,
          start: int = 0, engine: Any = None, rule: int = 1) -> tuple[list[float], Any]:
    import deepspeed_c

    if engine is None:
        engine, *_ = deepspeed_c.initialize(model=copy.deepcopy(model or make_gpt()), config=config)
    dev = engine.device
    losses = []
    for s in range(start, start + steps):
        x, y = batch(s, rank, world, rule)
        loss = engine(x.to(dev), y.to(dev))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return losses, engine


def flat_weights(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in engine.module.parameters()])


def resume_run(rank: int, world: int, config: dict, steps: int, saved_at: int, ckpt: str, tag: str) -> dict:
    """`steps` steps in one run, and the same steps saved after `saved_at`, loaded into a fresh engine and
    finished there: the losses and final flat weights of both."""
    import torch.distributed as dist

    full, e_full = train(rank, world, config, steps)
    w_full = flat_weights(e_full).numpy()
    e_full.destroy()
    first, e1 = train(rank, world, config, saved_at)
    e1.save_checkpoint(ckpt, tag=tag)
    e1.destroy()
    dist.barrier()
    _, e2 = train(rank, world, config, 0)
    e2.load_checkpoint(ckpt, tag=tag)
    rest, e2 = train(rank, world, config, steps - saved_at, start=saved_at, engine=e2)
    w_res = flat_weights(e2).numpy()
    e2.destroy()
    return {"full": full, "resumed": first + rest, "w_full": w_full, "w_res": w_res}

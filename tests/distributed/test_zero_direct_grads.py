"""ZeRO-1/2 contiguous gradients written in place (runtime/zero/bucket_linear.py): a Linear's weight
gradient computed straight into its bucket slot instead of materialised and copied.

On 2 and 4 gloo ranks, a GPT-style model with two outputs (two heads sharing one weight), a Linear applied
twice in one forward, a frozen bias, activation checkpointing (a reentrant and a non-reentrant block) and
gradient accumulation trains like one process on the whole batch (fp32, AdamW), in every variant: stage 2
through engine.backward (direct writes), stage 1 without accumulation (direct writes; with accumulation
the gradients accumulate in .grad and take autograd's path), a direct loss.backward() under accumulation
(the engine's scaling hooks then act: no direct write), a user's gradient hook on one weight (that weight
takes autograd's path), and contiguous_gradients false (no direct write). The number of direct writes is
counted exactly: once per distinct eligible Linear weight and backward; a second use of a weight in the
same backward goes through autograd and is added into the bucket before it goes out (collectives counted:
each bucket once per reducing backward)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.distributed.test_zero3_granularity import WIDTH, Block as GranularityBlock
from tests.harness import rank_device, run_distributed

LAYERS, MICRO, SEQ, STEPS, VOCAB = 2, 2, 5, 3, 32
# distinct Linear weights a reducing backward writes directly: qkv, proj, mlp.0, mlp.2 per block, the
# shared head weight once (its second use, and proj's, go through autograd)
DIRECT_PER_BACKWARD = 4 * LAYERS + 1


class Block(GranularityBlock):  # LayerNorm, qkv (no bias), proj, MLP with a frozen bias; WIDTH wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / WIDTH ** 0.5, dim=-1) @ v
        x = x + self.proj(att) + 0.5 * self.proj(x)  # one Linear used twice
        return x + self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head_a = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head_b = torch.nn.Linear(WIDTH, VOCAB)
        self.head_b.weight = self.head_a.weight  # two outputs, one shared weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x)
        for i, b in enumerate(self.blocks):
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=(i == 0))
        return self.head_a(h), self.head_b(torch.tanh(h))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g),
             torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g)) for _ in range(2 * STEPS)]


def _loss(outs: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    a, b = outs
    ce = torch.nn.functional.cross_entropy
    return ce(a.reshape(-1, VOCAB), y.reshape(-1)) + 0.5 * ce(b.reshape(-1, VOCAB), y.reshape(-1))


def _hooked(model: Net) -> None:
    model.blocks[1].mlp[0].weight.register_hook(lambda g: g * 2.0)


# name: stage, accumulation steps, direct loss.backward(), user hook, contiguous_gradients, direct writes/backward
CASES: dict[str, tuple[int, int, bool, bool, bool, int]] = {
    "z2-gas2": (2, 2, False, False, True, DIRECT_PER_BACKWARD),
    "z1-gas1": (1, 1, False, False, True, DIRECT_PER_BACKWARD),
    "z1-gas2": (1, 2, False, False, True, 0),
    "z2-gas2-loss.backward": (2, 2, True, False, True, 0),
    "z2-gas2-hook": (2, 2, False, True, True, DIRECT_PER_BACKWARD - 1),
    "z2-gas2-not-contiguous": (2, 2, False, False, False, 0),
}


def body(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    import deepspeed_c

    out: dict[str, Any] = {}
    for name in names:
        stage, gas, direct, hook, contiguous, _ = CASES[name]
        model = Net()
        if hook:
            _hooked(model)
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                  "zero_optimization": {"stage": stage, "contiguous_gradients": contiguous,
                                        "reduce_bucket_size": 700}}  # several buckets
        engine, *_ = deepspeed_c.initialize(model=model, config=config,
                                            model_parameters=[p for p in model.parameters() if p.requires_grad])
        batches = _batches(world)[:STEPS * gas]
        lo, hi = rank * MICRO, (rank + 1) * MICRO
        for x, y in batches:
            loss = _loss(engine(x[lo:hi].to(rank_device())), y[lo:hi].to(rank_device()))
            if direct:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
        out[name] = {"weights": [p.detach().cpu().numpy().copy() for p in engine.module.parameters()],
                     "direct": engine.optimizer.reducer.direct_writes,
                     "collectives": engine.optimizer.reducer.collectives,
                     "buckets": len(engine.optimizer.reducer.order),
                     "installed": len(engine.optimizer.reducer.direct_linears)}
        engine.destroy()
        out[name]["restored"] = all("forward" not in m.__dict__ for m in model.modules())
    return out


def _reference(world: int, gas: int, hook: bool) -> list[np.ndarray]:
    model = Net().double()
    if hook:
        _hooked(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    batches = _batches(world)[:STEPS * gas]
    for s in range(STEPS):
        for x, y in batches[gas * s:gas * (s + 1)]:
            (_loss(model(x), y) / gas).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy() for p in model.parameters()]


def _check(world: int, names: list[str]) -> None:
    results = run_distributed(body, world, args=(names,), timeout=300)
    for name in names:
        stage, gas, direct, hook, contiguous, per_backward = CASES[name]
        ref = _reference(world, gas, hook)
        for res in results:
            got = res[name]
            assert got["direct"] == per_backward * STEPS * gas, (name, got["direct"])
            # every bucket goes out once per reducing backward: a shared weight's or a twice-used Linear's
            # bucket waits for its last part (no second, late collective)
            reducing = STEPS * (gas if stage == 2 else 1)
            assert got["buckets"] > 2 and got["collectives"] == reducing * got["buckets"], (name, got)
            # head_b shares head_a's weight: 4 Linears a block + 2 heads
            assert got["installed"] == (4 * LAYERS + 2 if contiguous else 0), (name, got["installed"])
            assert got["restored"], name
            for k, (mine, want) in enumerate(zip(got["weights"], ref)):
                rel = np.linalg.norm(mine - want) / np.linalg.norm(want)
                assert rel < 2e-5, f"{name}: parameter {k} relative difference {rel:.3g}"


def test_direct_linear_gradients_train_like_one_process_on_2_ranks() -> None:
    _check(2, list(CASES))


def test_direct_linear_gradients_train_like_one_process_on_4_ranks() -> None:
    _check(4, ["z2-gas2", "z1-gas1", "z2-gas2-hook"])

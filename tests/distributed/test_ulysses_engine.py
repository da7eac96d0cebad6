"""Ulysses inside a model trained by the engine: 2 gloo ranks each hold half of every sequence, the
attention runs through DistributedAttention over both, and the engine (no sequence_parallel_size:
it averages gradients over every rank, the data x sequence reduction Ulysses needs) must train as
one process training the same model on the whole sequence with plain attention (float64 model;
the engine reduces gradients in fp32, hence the 1e-6 tolerance). Under DSC_TEST_BACKEND=nccl the engine's
model and data are on the rank's GPU; the one-process reference stays on the CPU."""
from __future__ import annotations

import numpy as np
import torch

from tests.harness import rank_device, run_distributed

VOCAB, HIDDEN, HEADS, SEQ, BATCH, STEPS = 16, 16, 4, 8, 2, 6


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [b, s, h, d], causal
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).triu(1)
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(mask, float("-inf")).softmax(-1), v)


class _Local(torch.nn.Module):
    def forward(self, q, k, v):
        return _attention(q, k, v)


class TinyLM(torch.nn.Module):
    def __init__(self, group=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)
        if group is not None:
            from deepspeed_c.sequence.layer import DistributedAttention

            self.attn = DistributedAttention(_Local(), group)
        self.group = group

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = (t.reshape(*ids.shape, HEADS, HIDDEN // HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        a = self.attn(q, k, v, 0) if self.group is not None else _attention(q, k, v)
        logits = self.out(x + a.reshape(*ids.shape, HIDDEN))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def body(rank: int, world: int) -> dict:
    import deepspeed_c

    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ref = TinyLM()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-6)
    ref_losses = []
    for _ in range(STEPS):
        loss = ref(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    # a client torch Adam: float64 end to end (the key bias's true gradient is zero: eps keeps its noise small)
    engine, *_ = deepspeed_c.initialize(model=TinyLM(torch.distributed.group.WORLD), config=cfg,
                                        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-6))
    # no Ulysses mpu: DeepSpeed's layout attributes say so
    assert engine.seq_parallel_group is None and engine.mp_world_size == 1 and engine.seq_dp_world_size == world
    lo, hi = rank * SEQ // world, (rank + 1) * SEQ // world  # this rank's slice of every sequence
    losses = []
    for _ in range(STEPS):
        loss = engine(ids[:, lo:hi].to(rank_device()), targets[:, lo:hi].to(rank_device()))
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    weights = max((p.detach().cpu() - r.detach()).abs().max().item()
                  for p, r in zip(engine.module.parameters(), ref.parameters()))
    return {"loss_err": float(np.max(np.abs(np.array(losses) - np.array(ref_losses)))), "weight_err": weights,
            "loss_drop": ref_losses[0] - ref_losses[-1]}


def test_ulysses_model_trains_as_full_sequence():
    for r in run_distributed(body, 2, timeout=120):
        assert r["loss_drop"] > 0.05, r
        assert r["loss_err"] < 1e-6 and r["weight_err"] < 1e-6, r  # gradients travel in fp32

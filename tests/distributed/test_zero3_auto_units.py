"""ZeRO-3 units chosen automatically (runtime/zero/auto_units.py) with DeepSpeed's default JSON (no
stage3_module_granularity_threshold): each GPT block becomes one gather/reduce unit, and training equals plain
PyTorch.

On 2 gloo ranks, fp32, AdamW, gradient accumulation 2, 3 optimizer steps, against one process of plain
PyTorch on the whole batch (1e-5 norm-wise per tensor), with and without non-reentrant activation
checkpointing, for a GPT-like model that has what coarse units must survive: tied input/output embeddings
(the tied pair is never folded into a unit), a block called twice per forward, a frozen block and a frozen
bias inside a trained block (that block spans two parameter groups), a module of a unit called from the
root's forward outside its block (a block's LayerNorm reused as the final norm: a step of its block), a
GatheredParameters(modifier_rank=0) edit of a parameter inside a unit before training, and a module inside a
unit called directly, outside any forward of the model, after training (its unit is gathered for the call).
The same runs with DSC_Z3_AUTO_UNITS=0 (per-module units) train the same; the auto units issue fewer
all-gathers per forward and per backward, counted on torch.distributed's ProcessGroup class (every gather,
coalesced or not, goes through one of its methods)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.harness import rank_device, run_distributed

WIDTH, LAYERS, MICRO, SEQ, STEPS, VOCAB, GAS, WORLD = 16, 3, 2, 6, 3, 40, 2, 2
TOL = 1e-5
GATHER_METHODS = ("_allgather_base", "allgather_into_tensor_coalesced", "allgather", "allgather_coalesced")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.ln2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / WIDTH ** 0.5, dim=-1) @ v
        x = x + self.proj(att)
        return x + self.mlp(self.ln2(x))


class TiedGPT(torch.nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.ckpt = ckpt
        self.tok = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.twice = Block()  # called twice per forward
        self.frozen = Block().requires_grad_(False)
        self.blocks[1].mlp[2].bias.requires_grad_(False)  # a frozen bias inside a trained block
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def _run(self, block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, h, use_reentrant=False) if self.ckpt and torch.is_grad_enabled() else block(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        # checkpointed too: torch's checkpoint keeps a frozen parameter itself (no detached alias) for its
        # recompute check, so its unit must stay gathered from the recompute to its backward
        h = self._run(self.frozen, h)
        for b in self.blocks:
            h = self._run(b, h)
            h = self._run(self.twice, h)
        return self.head(self.blocks[-1].ln2(h))  # a block's LayerNorm reused as the final norm


class Wrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [(torch.randint(0, VOCAB, (MICRO * WORLD, SEQ), generator=g),
             torch.randint(0, VOCAB, (MICRO * WORLD, SEQ), generator=g)) for _ in range(GAS * STEPS)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _probe() -> torch.Tensor:
    return torch.randn(3, 2 * WIDTH, generator=torch.Generator().manual_seed(4))


@torch.no_grad()
def _edit(model: torch.nn.Module) -> None:
    model.blocks[0].proj.bias.fill_(0.25)


def _body(rank: int, world: int, auto: str, ckpt: bool) -> dict[str, Any]:
    import os

    os.environ["DSC_Z3_AUTO_UNITS"] = auto
    from torch._C._distributed_c10d import ProcessGroup

    import deepspeed_c

    model = TiedGPT(ckpt)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              # a bucket below a block and no reuse: every step gathers (the default bucket holds this whole
              # model, so the plan would gather it in two coalesced batches whatever the units)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 1000, "stage3_max_reuse_distance": 0}}
    engine, *_ = deepspeed_c.initialize(model=model, config=config)
    with deepspeed_c.zero.GatheredParameters([engine.module.blocks[0].proj.bias], modifier_rank=0):
        if rank == 0:
            _edit(engine.module)
    counts = {"fwd": 0, "bwd": 0}
    phase = ["none"]
    originals = {n: getattr(ProcessGroup, n) for n in GATHER_METHODS if hasattr(ProcessGroup, n)}

    def counting(orig: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if phase[0] in counts:
                counts[phase[0]] += 1
            return orig(*a, **k)
        return call

    batches = _batches()
    lo, hi = rank * MICRO, (rank + 1) * MICRO
    try:
        for n, orig in originals.items():
            setattr(ProcessGroup, n, counting(orig))
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1  # the plan of the first iteration is followed by then
            phase[0] = "fwd" if last else "none"
            loss = _loss(engine(x[lo:hi].to(rank_device())), y[lo:hi].to(rank_device()))
            phase[0] = "bwd" if last else "none"
            engine.backward(loss)
            phase[0] = "none"
            engine.step()
    finally:
        for n, orig in originals.items():
            setattr(ProcessGroup, n, orig)
    with torch.no_grad():  # a module inside a unit, called alone
        probe = engine.module.blocks[2].mlp(_probe()[:, :WIDTH].to(rank_device())).cpu().numpy()
    names = [n for n, _ in engine.module.named_parameters()]
    with deepspeed_c.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().cpu().numpy().copy() for n, p in engine.module.named_parameters()}
    store = engine.optimizer.store
    units, peak = len(store.full), store.peak_live_numel
    engine.destroy()
    return {"weights": weights, "names": names, "probe": probe, "counts": counts, "units": units, "peak": peak}


def _reference(ckpt: bool) -> dict[str, Any]:
    model = TiedGPT(ckpt)
    _edit(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    batches = _batches()
    for s in range(STEPS):
        for x, y in batches[GAS * s:GAS * (s + 1)]:
            (_loss(model(x), y) / GAS).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        probe = model.blocks[2].mlp(_probe()[:, :WIDTH]).numpy()
    return {"weights": {n: p.detach().numpy() for n, p in model.named_parameters()}, "probe": probe}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_auto_units_choose_blocks_not_the_tied_pair() -> None:
    from deepspeed_c.runtime.zero.auto_units import choose_unit_roots

    model = TiedGPT(ckpt=False)
    roots = choose_unit_roots(model, int(1e9))
    assert [id(m) for m in roots] == [id(b) for b in model.blocks] + [id(model.twice), id(model.frozen)]
    # a wrapper holding nearly the whole model is descended; a stage3_max_live_parameters below a block
    # leaves every leaf its own unit
    wrapped = Wrapper(model)
    assert [id(m) for m in choose_unit_roots(wrapped, int(1e9))] == [id(m) for m in roots]
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert choose_unit_roots(model, 2 * block - 2) == []


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_auto_units_train_as_plain_pytorch_with_fewer_gathers(ckpt: bool) -> None:
    ref = _reference(ckpt)
    auto = run_distributed(_body, WORLD, args=("1", ckpt), timeout=300)
    leaf = run_distributed(_body, WORLD, args=("0", ckpt), timeout=300)
    for res in auto + leaf:
        assert sorted(res["weights"]) == sorted(ref["weights"])
        for n, want in ref["weights"].items():
            err = _rel(res["weights"][n], want)
            assert err < TOL, (n, err)
        assert _rel(res["probe"], ref["probe"]) < TOL
    a, b = auto[0], leaf[0]
    assert a["units"] < b["units"], (a["units"], b["units"])
    # the blocks' leaves gathered as one unit per block (and parameter group): fewer collectives both ways
    assert 0 < a["counts"]["fwd"] < b["counts"]["fwd"], (a["counts"], b["counts"])
    assert 0 < a["counts"]["bwd"] < b["counts"]["bwd"], (a["counts"], b["counts"])
    print(f"\nall-gathers per forward / backward ({'checkpointing' if ckpt else 'plain'}): auto units "
          f"{a['counts']['fwd']} / {a['counts']['bwd']}, per-module {b['counts']['fwd']} / {b['counts']['bwd']}; "
          f"units {a['units']} vs {b['units']}; peak live elements {a['peak']} vs {b['peak']}")

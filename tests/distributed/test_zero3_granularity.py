"""zero_optimization.stage3_module_granularity_threshold (DeepSpeed's): modules at or below the threshold
become ZeRO-3 leaves, gathered (and their gradients reduce-scattered) as one unit.

Checked on 2 gloo ranks with a GPT-style model (embedding, blocks of LayerNorm + attention projections +
MLP with a frozen bias, untied head) and activation checkpointing over each block: granularity values
equal DeepSpeed's formula computed here by hand; with the threshold at the block's granularity every
block is one leaf and one unit, so the gathers and gradient collectives per step fall to about a sixth of
the per-module count; training (fp32, AdamW, gradient accumulation 2, 3 steps) equals one process on the
whole batch with and without the threshold. A threshold below every module's granularity flags nothing.
Without a threshold the automatic units (runtime/zero/auto_units.py) are the same blocks, with no leaf flag
set; DSC_Z3_AUTO_UNITS=0 gives the per-module baseline."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from tests.harness import rank_device, run_distributed

WIDTH, LAYERS, MICRO, SEQ, STEPS, VOCAB = 16, 3, 2, 6, 3, 40


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(WIDTH)
        # no bias: a key bias has an exactly-zero gradient, and Adam would blow its rounding noise up
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(2 * WIDTH, WIDTH))
        self.mlp[2].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / WIDTH ** 0.5, dim=-1) @ v
        x = x + self.proj(att)
        return x + self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False) if self.checkpointing else b(h)
        return self.head(h)


def block_granularity() -> int:
    # DeepSpeed's formula: subtree parameters // (counted modules: torch leaves with parameters (ln, qkv,
    # proj, two MLP Linears) + non-container modules on the way (the block itself; Sequential is a container))
    b = Block()
    return sum(p.numel() for p in b.parameters()) // (5 + 1)


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [(torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g),
             torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g)) for _ in range(2 * STEPS)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def body(rank: int, world: int, threshold: int, auto: str = "0") -> dict[str, Any]:
    import os

    os.environ["DSC_Z3_AUTO_UNITS"] = auto  # "0": per-module units where no threshold is set (the baseline)
    import deepspeed_c
    import deepspeed_c.comm as dist  # what the ZeRO-3 reducer calls (the store gathers on the process group)
    from deepspeed_c.runtime.zero.leaf_granularity import granularities
    from deepspeed_c.utils.z3_leaf_module import get_z3_leaf_modules

    model = Net(checkpointing=True)
    gran = granularities(model)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_module_granularity_threshold": threshold}}
    counts = {"reduce_scatter_tensor": 0}
    originals = {n: getattr(dist, n) for n in counts}

    def counting(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return originals[name](*a, **k)
        return call

    engine, *_ = deepspeed_c.initialize(model=model, config=config)
    leaves = [type(m).__name__ for m in get_z3_leaf_modules(engine.module)]
    batches = _batches(world)
    per_step = []
    for s in range(STEPS):
        for n in counts:
            counts[n] = 0
            setattr(dist, n, counting(n))
        for x, y in batches[2 * s:2 * s + 2]:
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = _loss(engine(x[lo:hi].to(rank_device())), y[lo:hi].to(rank_device()))
            engine.backward(loss)
            engine.step()
        for n in counts:
            setattr(dist, n, originals[n])
        per_step.append(dict(counts))
        gathered = engine.optimizer.store.gathers  # units gathered so far (one all-gather each)
        per_step[-1]["all_gather_into_tensor"] = gathered - sum(p["all_gather_into_tensor"] for p in per_step[:-1])
    with deepspeed_c.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().cpu().numpy().copy() for p in engine.module.parameters()]
    units = len(engine.optimizer.store.full)
    engine.destroy()
    return {"weights": weights, "leaves": leaves, "per_step": per_step, "units": units,
            "block_gran": gran[id(model.blocks[0])], "root_gran": gran[id(model)],
            "list_gran": gran[id(model.blocks)], "linear_gran": gran[id(model.head)]}


def _reference(world: int) -> list[np.ndarray]:
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    batches = _batches(world)
    for s in range(STEPS):
        for x, y in batches[2 * s:2 * s + 2]:
            (_loss(model(x), y) / 2).backward()  # accumulation 2: the mean over both micro-steps
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy() for p in model.parameters()]


def test_granularity_threshold_makes_blocks_one_unit_and_trains_the_same() -> None:
    world = 2
    want = block_granularity()
    ref = _reference(world)
    plain = run_distributed(body, world, args=(0,), timeout=240)
    auto = run_distributed(body, world, args=(0, "1"), timeout=240)
    coarse = run_distributed(body, world, args=(want,), timeout=240)
    none = run_distributed(body, world, args=(1,), timeout=240)
    for res in plain + coarse + none + auto:
        assert res["block_gran"] == want
        # the root: every parameter over 3 blocks x 6 counted modules + embedding + head + itself
        assert res["root_gran"] == sum(p.numel() for p in Net().parameters()) // (LAYERS * 6 + 3)
        assert res["root_gran"] > want  # so the threshold stops at the blocks
        for mine, want_w in zip(res["weights"], ref):
            rel = np.linalg.norm(mine - want_w) / np.linalg.norm(want_w)
            assert rel < 1e-5, rel
    assert plain[0]["leaves"] == [] and none[0]["leaves"] == []
    assert coarse[0]["leaves"] == ["Block"] * LAYERS
    assert plain[0]["list_gran"] == sys.maxsize and plain[0]["linear_gran"] == sys.maxsize
    # per-module units: emb, 3 x (ln, qkv, proj, mlp.0, mlp.2 + its frozen bias elsewhere), head; leaves: a
    # unit per block and param group
    assert coarse[0]["units"] < plain[0]["units"]
    g_plain = plain[0]["per_step"][-1]["all_gather_into_tensor"]
    g_coarse = coarse[0]["per_step"][-1]["all_gather_into_tensor"]
    r_plain = plain[0]["per_step"][-1]["reduce_scatter_tensor"]
    r_coarse = coarse[0]["per_step"][-1]["reduce_scatter_tensor"]
    assert g_coarse * 2 < g_plain, (g_coarse, g_plain)
    assert r_coarse * 2 < r_plain, (r_coarse, r_plain)
    # without a threshold the automatic units (auto_units.py) are the blocks too, with no leaf flag set
    assert auto[0]["leaves"] == [] and auto[0]["units"] == coarse[0]["units"]
    assert auto[0]["per_step"][-1] == coarse[0]["per_step"][-1]


def ckpt_body(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Saved with blocks as units, loaded per module (and the reverse order of steps checked by the caller):
    the checkpoint is DeepSpeed's per-parameter layout, whatever the units."""
    import os

    import deepspeed_c

    def engine(threshold: int) -> Any:
        os.environ["DSC_Z3_AUTO_UNITS"] = "0"  # threshold 0: per-module units, not the automatic blocks
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "stage3_module_granularity_threshold": threshold}}
        return deepspeed_c.initialize(model=Net(), config=config)[0]

    def run(e: Any, batches: list) -> list[float]:
        out = []
        for x, y in batches:
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = _loss(e(x[lo:hi].to(rank_device())), y[lo:hi].to(rank_device()))
            e.backward(loss)
            e.step()
            out.append(loss.item())
        return out

    batches = _batches(world)
    coarse = engine(block_granularity())
    run(coarse, batches[:3])
    coarse.save_checkpoint(ckpt, tag="t")
    straight = run(coarse, batches[3:])
    coarse.destroy()
    fine = engine(0)
    fine.load_checkpoint(ckpt, tag="t")
    resumed = run(fine, batches[3:])
    fine.destroy()
    return {"straight": straight, "resumed": resumed}


def test_checkpoint_saved_with_leaf_units_loads_per_module(tmp_path: Any) -> None:
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(ckpt_body, 2, args=(ckpt,), timeout=240)
    for res in results:
        # the same fp32 masters, Adam moments and weights, stepped on per-module units: the same losses up to
        # the order the reduce-scatter sums each element in (buckets laid out otherwise)
        np.testing.assert_allclose(res["resumed"], res["straight"], rtol=1e-6, atol=0)
    # zero_to_fp32 reads the unit-agnostic layout: every parameter whole, with its model shape
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    want = {n: p.shape for n, p in Net().named_parameters()}
    assert {n: tuple(t.shape) for n, t in sd.items()} == {n: tuple(s) for n, s in want.items()}

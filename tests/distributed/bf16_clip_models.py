"""ZeRO-Offload with bf16 and gradient clipping that clips every step: the model, the data, the engine run and its
independent reference, shared by tests/unit/test_zero_offload_bf16_clip.py (one process) and
tests/distributed/test_zero_offload_bf16_clip.py (two gloo ranks); importable by spawned ranks.

The model is one users train: two heads whose losses are summed, a frozen submodule in the middle, gradient
accumulation 2. The reference emulates the engine's bf16 math in plain torch, written from what the engine is
documented to do (runtime/zero/stage_1_and_2.py, grad_partition.py, step_sequence.py), none of its code:
- each rank's share of the micro-batch through the bf16 model, backward of loss / GAS (exact: a power of two);
- the ranks' bf16 gradients summed and averaged (exact: / 2) in bf16, then the micro-steps' results summed in bf16
  (stages 2 and 3 reduce every micro-step into a bf16 partition; fp32 accumulation is stage 1's only);
- fp32 masters cut from the bf16 weights, torch.nn.utils.clip_grad_norm_ on the fp32 up-cast of that sum,
  torch.optim.AdamW on the masters, and the bf16 model takes the masters rounded to bf16.

Adam divides out a constant gradient scale: with a tiny eps a skipped or doubled clip would hardly move the weights.
EPS = 1e-3 sits near the clipped gradients' elements (CLIP / sqrt(229 trainable) ~ 3e-3), so the update depends on the
gradient's scale and the clip shows in the masters (see the tests' TOL for the figures)."""
from __future__ import annotations

from typing import Any, Optional

import torch

STEPS, GAS, MICRO = 3, 2, 4
CLIP = 0.05  # the gradient norms here are 3.5-6: every step clips, by about 100x
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-3, 0.01

Snap = dict[str, torch.Tensor]


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.frozen = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.frozen.requires_grad_(False)
        self.head_a = torch.nn.Linear(16, 3)
        self.head_b = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        h = h + self.frozen(h)
        return self.head_a(h), self.head_b(h)


def two_head_loss(out: tuple[torch.Tensor, torch.Tensor], ya: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    a, b = out
    return torch.nn.functional.mse_loss(a.float(), ya) + torch.nn.functional.mse_loss(b.float(), yb)


def make_model() -> TwoHeads:
    torch.manual_seed(7)
    return TwoHeads()


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """STEPS * GAS global micro-batches of world * MICRO samples (rank r takes rows r*MICRO .. (r+1)*MICRO)."""
    g = torch.Generator().manual_seed(3)
    n = world * MICRO
    return [(torch.randn(n, 8, generator=g).bfloat16(), 3 * torch.randn(n, 3, generator=g),
             3 * torch.randn(n, 2, generator=g)) for _ in range(STEPS * GAS)]


def _shard(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * MICRO:(rank + 1) * MICRO] for t in batch)


def reference(world: int) -> tuple[list[Snap], list[float]]:
    """Per step: the fp32 masters of the trainable parameters by name, and the pre-clip global gradient norm."""
    model = make_model().bfloat16()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(world)
    snaps, norms = [], []
    for step in range(STEPS):
        acc: list[Optional[torch.Tensor]] = [None] * len(params)
        for k in range(GAS):
            mean: list[Optional[torch.Tensor]] = [None] * len(params)
            for rank in range(world):
                x, ya, yb = _shard(data[step * GAS + k], rank)
                grads = torch.autograd.grad(two_head_loss(model(x), ya, yb) / GAS, params)
                mean = [g if m is None else m + g for m, g in zip(mean, grads)]  # bf16 sums
            mean = [m / world for m in mean]  # exact for world 1 and 2
            acc = [m if a is None else a + m for a, m in zip(acc, mean)]
        for master, a in zip(masters, acc):
            master.grad = a.float()
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, params):
                p.copy_(master)
        snaps.append({n: m.detach().clone() for n, m in zip(names, masters)})
    return snaps, norms


def train(rank: int, world: int, stage: int) -> dict[str, Any]:
    """deepspeed_c.initialize with bf16 + offload_optimizer cpu + clipping; per step the whole fp32 masters (a
    collective) and the engine's global gradient norm. Checks on the way out: the frozen submodule is untouched
    and every bf16 weight is its master rounded to bf16."""
    import deepspeed_c
    from deepspeed_c.utils.tensor_fragment import safe_get_full_fp32_param

    model = make_model()
    frozen_before = {n: p.detach().bfloat16().clone() for n, p in model.frozen.named_parameters()}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "gradient_clipping": CLIP, "steps_per_print": 10**9, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    data = batches(world)
    snaps, norms = [], []
    for step in range(STEPS):
        for k in range(GAS):
            x, ya, yb = _shard(data[step * GAS + k], rank)
            engine.backward(two_head_loss(engine(x), ya, yb))
            engine.step()
        norms.append(engine.get_global_grad_norm())
        snaps.append({n: safe_get_full_fp32_param(p).detach().float().clone() for n, p in trainable})
    with deepspeed_c.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    for n, before in frozen_before.items():
        assert torch.equal(weights[f"frozen.{n}"], before), f"frozen parameter frozen.{n} changed"
    for n, master in snaps[-1].items():
        assert weights[n].dtype == torch.bfloat16, (n, weights[n].dtype)
        assert torch.equal(weights[n], master.bfloat16()), f"{n}: the model's weight is not its master in bf16"
    # numpy: a tensor returned from a rank travels through shared memory that the rank's exit tears down
    return {"snaps": [{n: t.numpy() for n, t in snap.items()} for snap in snaps], "norms": norms}


def check_against_reference(got: dict[str, Any], want: tuple[list[Snap], list[float]], tol: float,
                            what: str) -> None:
    """Step by step: the engine's norm is the reference's (and clips), then every trainable master is within
    `tol` norm-wise relative."""
    want_snaps, want_norms = want
    assert len(got["norms"]) == len(got["snaps"]) == len(want_norms) == STEPS
    for step, (g_norm, w_norm, g, w) in enumerate(zip(got["norms"], want_norms, got["snaps"], want_snaps)):
        assert w_norm > 10 * CLIP, f"{what} step {step}: the reference norm {w_norm} does not clip"
        assert abs(g_norm - w_norm) <= 1e-4 * w_norm, f"{what} step {step}: norm {g_norm} vs {w_norm}"
        assert g.keys() == w.keys()
        for name in w:
            rel = float((torch.from_numpy(g[name]).double() - w[name].double()).norm() / w[name].double().norm())
            assert rel < tol, f"{what} step {step} {name}: relative difference {rel:.2e} >= {tol}"

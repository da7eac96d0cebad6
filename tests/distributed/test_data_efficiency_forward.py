"""The legacy seqlen curriculum and progressive layer drop hand the model's forward, at every micro-step,
the values DeepSpeed 0.19.6's engine hands it (pinned from DeepSpeed's own schedulers in
tests/fixtures/data_efficiency/schedules.npz): `curriculum_seqlen` (the scheduler moved to global_steps + 1
before each training forward) and `progressive_layer_drop=True, pld_theta` (theta updated at each
accumulation boundary with the step count before the step). 2 gloo ranks, gradient accumulation 2; a
checkpoint is taken mid-run and a fresh engine that loads it continues with the same values (theta
included: DeepSpeed would restart it at 1.0). Eval-mode forwards get neither keyword."""
from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np
import torch

from tests.fixtures.data_efficiency.cases import CURRICULUM, PLD
from tests.harness import run_distributed

FIXTURE = "tests/fixtures/data_efficiency/schedules.npz"
CASE, PLD_CASE = "root3_min_off_step", "deep"
MICRO, GAS, SAVE_AT, STEPS, SEQ = 2, 2, 5, 12, 1024


class SeqNet(torch.nn.Module):
    """Reads the first curriculum_seqlen tokens, as a GPT under the seqlen curriculum does; records what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 1)
        self.seen: list[tuple] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, curriculum_seqlen: Optional[int] = None,
                progressive_layer_drop: Optional[bool] = None, pld_theta: Optional[float] = None) -> torch.Tensor:
        self.seen.append((curriculum_seqlen, progressive_layer_drop, pld_theta))
        if curriculum_seqlen is not None:
            x = x[:, :curriculum_seqlen]
        out = self.proj(x).mean(dim=(1, 2))
        if pld_theta is not None:
            out = out * pld_theta
        return torch.nn.functional.mse_loss(out, y)


def _config() -> dict:
    theta, gamma = PLD[PLD_CASE]
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
            "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **copy.deepcopy(CURRICULUM[CASE])},
            "progressive_layer_drop": {"enabled": True, "theta": theta, "gamma": gamma}}


def _run(engine: Any, model: SeqNet, steps: int, rank: int) -> list[tuple]:
    got = []
    for step in range(steps):
        for micro in range(GAS):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(MICRO, SEQ, 4, generator=g), torch.randn(MICRO, generator=g)
            before = len(model.seen)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            got.append((engine.global_steps,) + model.seen[before])
    return got


def body(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    import deepspeed_c

    torch.manual_seed(0)
    model = SeqNet()
    engine, *_ = deepspeed_c.initialize(model=model, config=_config())
    assert engine.curriculum_enabled_legacy() and engine.pld_enabled()
    assert engine.curriculum_params_legacy()["schedule_type"] == CURRICULUM[CASE]["schedule_type"]
    first = _run(engine, model, SAVE_AT, rank)
    engine.save_checkpoint(ckpt, tag="mid")
    theta_at_save, seqlen_at_save = engine.get_pld_theta(), engine.curriculum_scheduler.get_current_difficulty()
    engine.eval()
    before = len(model.seen)
    with torch.no_grad():
        engine(torch.zeros(MICRO, SEQ, 4), torch.zeros(MICRO))
    eval_seen = model.seen[before]
    engine.destroy()

    torch.manual_seed(0)
    model2 = SeqNet()
    engine2, *_ = deepspeed_c.initialize(model=model2, config=_config())
    engine2.load_checkpoint(ckpt, tag="mid")
    assert engine2.global_steps == SAVE_AT
    restored = (engine2.get_pld_theta(), engine2.curriculum_scheduler_legacy.get_current_difficulty())
    rest = _run(engine2, model2, STEPS - SAVE_AT, rank)
    engine2.destroy()
    return {"seen": first + rest, "eval": eval_seen, "restored": restored,
            "at_save": (theta_at_save, seqlen_at_save)}


def test_forward_receives_deepspeed_0196_values_on_2_ranks_and_across_resume(tmp_path):
    with np.load(FIXTURE) as data:
        seqlen_ref, theta_ref = data[f"legacy/{CASE}"], data[f"pld/{PLD_CASE}"]
    results = run_distributed(body, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=240)
    for rank, res in enumerate(results):
        assert len(res["seen"]) == STEPS * GAS
        for i, (steps_after, seqlen, pld_on, theta) in enumerate(res["seen"]):
            g = i // GAS  # the optimizer step this micro-batch belongs to
            assert steps_after == g + (1 if i % GAS == GAS - 1 else 0)
            assert seqlen == seqlen_ref[g], (rank, i, seqlen, seqlen_ref[g])
            assert pld_on is True
            assert theta == theta_ref[g], (rank, i, theta, theta_ref[g])  # bit for bit
        assert res["eval"] == (None, None, None)
        assert res["restored"] == res["at_save"]
        assert res["at_save"] == (theta_ref[SAVE_AT], seqlen_ref[SAVE_AT - 1])
    # the curriculum is not flat over the window: the test sees it move
    assert len({s for _, s, _, _ in results[0]["seen"]}) > 3

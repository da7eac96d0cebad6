"""save_checkpoint / load_checkpoint through the engine, on real gloo ranks: DeepSpeed's layout,
client_state, and exact resume (20 steps == 10 + save + load in fresh processes + 10, bit for bit)
for ZeRO stages 0, 1 and 2. Under DSC_TEST_BACKEND=nccl the same runs go one GPU a rank (data on
engine.device) and stay bit for bit: the same world size, the same kernels, and the harness asks torch
for deterministic ones (a GPU-only divergence there would be nondeterminism, not rounding).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed

STEPS = 20
MICRO = 2


def _config(stage: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if dtype == "fp32-offload":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def train_body(rank: int, world: int, stage: int, dtype: str, ckpt_dir: str, mode: str) -> dict:
    """mode: 'full' (20 steps), 'first' (10 steps then save), 'resume' (load then 10 steps)."""
    import deepspeed_c

    model = make_model("transformer", seed=3)
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=_config(stage, dtype))
    batches = make_batches("transformer", STEPS, MICRO * world, seed=7)
    start, stop = {"full": (0, STEPS), "first": (0, STEPS // 2), "resume": (STEPS // 2, STEPS)}[mode]
    client = None
    if mode == "resume":
        path, client = engine.load_checkpoint(ckpt_dir)
        # DeepSpeed returns the path of the model-states file it loaded
        assert path is not None and f"global_step{STEPS // 2}" in path, (path, client)
        assert engine.global_steps == STEPS // 2
    losses = []
    for x, y in batches[start:stop]:
        lo, hi = rank * MICRO, (rank + 1) * MICRO
        out = engine(x[lo:hi].to(engine.device))
        loss = loss_fn(out, y[lo:hi].to(engine.device, out.dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if mode == "first":
        assert engine.save_checkpoint(ckpt_dir, client_state={"epoch": 3, "note": "hello"})
    # numpy arrays travel back by value (torch tensors would go through shared-memory handles)
    weights = {k: v.detach().float().cpu().numpy().copy() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "weights": weights, "client": client, "lr": engine.get_lr()}


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (0, "bf16"), (1, "bf16"),
                                         (2, "bf16"), (0, "fp16"), (2, "fp16"), (2, "fp32-offload")])
def test_exact_resume(tmp_path, stage, dtype):
    world = 2
    full = run_distributed(train_body, world, args=(stage, dtype, str(tmp_path), "full"))
    run_distributed(train_body, world, args=(stage, dtype, str(tmp_path), "first"))
    ckpt = tmp_path / f"global_step{STEPS // 2}"
    assert (tmp_path / "latest").read_text().strip() == ckpt.name
    assert (ckpt / "mp_rank_00_model_states.pt").exists()
    if stage > 0:
        prefix = "bf16_" if dtype == "bf16" else ""  # DeepSpeed 0.19.8: whenever bf16 is enabled
        for r in range(world):
            assert (ckpt / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt").exists()
    resumed = run_distributed(train_body, world, args=(stage, dtype, str(tmp_path), "resume"))
    for r in range(world):
        assert resumed[r]["client"] == {"epoch": 3, "note": "hello"}
        assert resumed[r]["losses"] == full[r]["losses"][STEPS // 2:], "losses after resume differ"
        assert resumed[r]["lr"] == full[r]["lr"]
        for k, v in full[r]["weights"].items():
            assert (resumed[r]["weights"][k] == v).all(), f"weight {k} differs after resume"

"""ZeRO-0 checkpoints on 2 gloo ranks, fp32 and bf16 (fp32 masters): 20 uninterrupted steps equal
10 steps + save + load in fresh processes + 10 steps, bit for bit; client_state comes back; tags
that differ across ranks are refused under checkpoint.tag_validation = "Fail"."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.engine_models import MLP, loss_fn
from tests.harness import run_distributed

STEPS, MICRO, WORLD = 20, 2, 2
DTYPES = ("fp32", "bf16")


def _engine(dtype: str):
    import deepspeed_c

    torch.manual_seed(4)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "checkpoint": {"tag_validation": "Fail"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed_c.initialize(model=MLP(), config=cfg)
    return engine


def body(rank: int, world: int, root: str, mode: str) -> dict:
    out = {}
    for dtype in DTYPES:
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        engine = _engine(dtype)
        g = torch.Generator().manual_seed(9)
        data = [(torch.randn(MICRO * world, 12, generator=g).to(tdt), torch.randn(MICRO * world, 3, generator=g).to(tdt))
                for _ in range(STEPS)]
        start, stop = {"full": (0, STEPS), "first": (0, STEPS // 2), "resume": (STEPS // 2, STEPS)}[mode]
        client = None
        ckpt_dir = f"{root}/{dtype}"
        if mode == "resume":
            path, client = engine.load_checkpoint(ckpt_dir)
            assert path.endswith(f"global_step{STEPS // 2}/mp_rank_00_model_states.pt"), path
        losses = []
        for x, y in data[start:stop]:
            sl = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = loss_fn(engine(x[sl].to(engine.device)), y[sl].to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        refused = None
        if mode == "first":
            engine.save_checkpoint(ckpt_dir, client_state={"epoch": 7, "rank_saved": 0})
            try:
                engine.save_checkpoint(ckpt_dir, tag=f"rank{rank}")
            except AssertionError as e:  # DeepSpeed asserts on an inconsistent tag under "Fail"
                refused = str(e)
        out[dtype] = {"losses": losses, "client": client, "refused": refused, "lr": engine.get_lr(),
                      "steps": engine.global_steps,
                      "weights": {k: v.float().cpu().numpy().copy() for k, v in engine.module.state_dict().items()}}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    full = run_distributed(body, WORLD, args=(root, "full"), timeout=300)
    first = run_distributed(body, WORLD, args=(root, "first"), timeout=300)
    resumed = run_distributed(body, WORLD, args=(root, "resume"), timeout=300)
    return root, full, first, resumed


@pytest.mark.parametrize("dtype", DTYPES)
def test_resume_in_fresh_processes_is_bit_exact(runs, dtype):
    _, full, _, resumed = runs
    for r in range(WORLD):
        got, ref = resumed[r][dtype], full[r][dtype]
        assert got["client"] == {"epoch": 7, "rank_saved": 0}
        assert got["steps"] == STEPS and got["lr"] == ref["lr"]
        assert got["losses"] == ref["losses"][STEPS // 2:]
        for k, v in ref["weights"].items():
            assert (got["weights"][k] == v).all(), k


def test_tag_mismatch_refused_and_nothing_written(runs):
    root, _, first, _ = runs
    import os

    for r in range(WORLD):
        assert "not consistent across all ranks" in first[r]["fp32"]["refused"]
    assert not any(n.startswith("rank") for n in os.listdir(f"{root}/fp32"))

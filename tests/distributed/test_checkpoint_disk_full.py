"""A save whose disk fills on one rank, on 2 real gloo ranks at ZeRO stage 2: rank 1's ZeRO file is written
into /dev/full (a real ENOSPC from the kernel through torch's zip writer). Rank 1 raises OSError(ENOSPC)
naming its file; rank 0, whose files were written, raises too, and its error carries rank 1's; the
staging directory is removed; the earlier tag and `latest` are untouched and load on both ranks."""
from __future__ import annotations

import errno
import os

import torch

from tests.distributed.engine_models import MLP, loss_fn
from tests.harness import run_distributed

ZERO_FILE = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def body(rank: int, world: int, save_dir: str) -> dict:
    import torch.distributed as dist

    import deepspeed_c
    from deepspeed_c.checkpoint import store

    torch.manual_seed(3)
    engine, *_ = deepspeed_c.initialize(model=MLP(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 100}})
    x, y = torch.randn(2, 12), torch.randn(2, 3)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    engine.save_checkpoint(save_dir, tag="good")
    before = sorted(os.listdir(save_dir))
    if rank == 1:
        real = store.save_file

        def save_file(obj, path):
            if os.path.basename(path) == ZERO_FILE:
                os.symlink("/dev/full", path)
            return real(obj, path)

        store.save_file = save_file
    error: dict = {}
    try:
        engine.save_checkpoint(save_dir, tag="bad")
    except Exception as e:  # noqa: BLE001
        error = {"type": type(e).__name__, "errno": getattr(e, "errno", None), "text": str(e)}
    dist.barrier()
    after = sorted(os.listdir(save_dir))
    path, _ = engine.load_checkpoint(save_dir)
    return {"error": error, "before": before, "after": after, "latest": store.read_latest(save_dir), "loaded": path}


def test_enospc_on_one_rank_raises_everywhere_and_keeps_the_previous_checkpoint(tmp_path):
    results = run_distributed(body, 2, args=(str(tmp_path),), timeout=120)
    one = results[1]["error"]
    assert one.get("type") == "OSError" and one["errno"] == errno.ENOSPC and ZERO_FILE in one["text"], one
    zero = results[0]["error"]
    assert zero.get("type") == "RankFailed" and "rank 1" in zero["text"] and ZERO_FILE in zero["text"], zero
    assert "No space left on device" in zero["text"], zero
    for r in results:
        assert r["after"] == r["before"], f"the failed save left {sorted(set(r['after']) - set(r['before']))}"
        assert r["latest"] == "good" and r["loaded"].endswith(os.path.join("good", "mp_rank_00_model_states.pt"))

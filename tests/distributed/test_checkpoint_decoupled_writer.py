"""checkpoint.writer.decoupled (runtime/checkpointing/process_writer.py): the staged files are written by a
child process from shared-memory buffers; 2 gloo ranks, ZeRO-1, fp32. The resumed run repeats the
uninterrupted run's losses exactly (the files hold the state at the save, though training changed the live
tensors while the child wrote), the writer is another process, and a second save reuses the child."""
from __future__ import annotations

import os
from typing import Any

import torch

from tests.distributed.test_checkpoint_async_writer import _config, _net, _train
from tests.harness import run_distributed


def body(rank: int, world: int, root: str) -> dict:
    import deepspeed_c

    res: dict[str, Any] = {}
    engine = deepspeed_c.initialize(model=_net(), config=_config({"type": "python", "decoupled": True}))[0]
    _train(engine, rank, 0, 3)
    engine.save_checkpoint(root, tag="a")
    straight = _train(engine, rank, 3, 3)
    res["committed"] = engine.checkpoint_commit()
    writer = engine.checkpointer.writer
    res["pid"] = writer.process_pid
    engine.save_checkpoint(root, tag="b")
    engine.checkpoint_commit()
    res["same_child"] = writer.process_pid == res["pid"]
    engine.destroy()
    fresh = deepspeed_c.initialize(model=_net(), config=_config(None))[0]
    fresh.load_checkpoint(root, tag="a")
    res["resumed"], res["straight"] = _train(fresh, rank, 3, 3), straight
    res["me"] = os.getpid()
    return res


def test_decoupled_writer_process_resumes_exactly(tmp_path: Any) -> None:
    for res in run_distributed(body, 2, args=(str(tmp_path / "ckpt"),), timeout=240):
        assert res["committed"] is True
        assert res["pid"] is not None and res["pid"] != res["me"] and res["same_child"]
        assert res["resumed"] == res["straight"]
        assert os.path.isdir(tmp_path / "ckpt" / "b")

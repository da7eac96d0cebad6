"""Background checkpoint writes (checkpoint.writer) SIGKILLed at random points never leave `latest`
naming a half-written checkpoint, and never lose the previous one.

Each round is one process (a gloo group of one): it loads `latest` through the engine's verified loader
and records what it got, then saves over and over with the python writer, every weight and the step
counter stamped with the save's number: save_checkpoint (returns with the files staged), a note that the
background write runs, more training-like changes to the weights, checkpoint_commit. The test SIGKILLs
it a random moment after the first background write started. The next round's load must give one save
whole (every weight and the counter hold the same number, the weights as staged, not as changed after
the save), never an earlier one than the previous round's."""
from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import torch

from tests.harness import free_port, rank_server_context

KILLS = 20
KILL_WINDOW_S = 0.5
WIDTH = 512  # 4 layers of 512 x 512: ~4 MB of weights, 12 MB with Adam's moments, per save


def _engine() -> Any:
    import deepspeed_c

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "checkpoint": {"writer": {"type": "python"}}}
    engine = deepspeed_c.initialize(model=model, config=cfg)[0]
    loss = engine(torch.randn(1, WIDTH)).sum()
    engine.backward(loss)
    engine.step()  # Adam states in the files too
    return engine


def _stamp(engine: Any, value: float, step: int) -> None:
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(value)
    engine.global_steps = step


def _round(save_dir: str, record_path: str, started_path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = _engine()
    record: dict = {"loaded": None}
    if os.path.exists(os.path.join(save_dir, "latest")):
        engine.load_checkpoint(save_dir)
        values = {float(v) for p in engine.module.parameters() for v in p.detach().unique()}
        record["loaded"] = {"values": sorted(values), "steps": engine.global_steps}
    with open(record_path, "w") as f:
        json.dump(record, f)
    start = (record["loaded"] or {}).get("steps", 0) + 1
    for n in range(start, start + 10_000):
        _stamp(engine, float(n), n)
        engine.save_checkpoint(save_dir, tag=f"s{n % 3}")  # re-saves tags too
        if not os.path.exists(started_path):
            with open(started_path, "w") as f:
                f.write("1")
        _stamp(engine, -float(n), n)  # the write must hold the staged weights, not these
        engine.checkpoint_commit()


def test_kills_during_background_writes_leave_the_previous_checkpoint(tmp_path: Any) -> None:
    # forked from the harness's rank server, not from this process: a pytest worker may hold a default process
    # group another test left, which a forked round would inherit (and could not initialise its own); the
    # server has imported torch, dynamo and deepspeed_c's engine once, clean
    ctx = rank_server_context()
    save_dir = str(tmp_path / "ckpt")
    rng = random.Random(51)
    best = 0
    for k in range(KILLS + 1):
        record, started = str(tmp_path / f"record{k}.json"), str(tmp_path / f"started{k}")
        proc = ctx.Process(target=_round, args=(save_dir, record, started, free_port()))
        proc.start()
        deadline = time.time() + 120
        while not os.path.exists(started) and proc.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        assert os.path.exists(record), f"round {k}: the load failed (exit code {proc.exitcode})"
        with open(record) as f:
            loaded = json.load(f)["loaded"]
        if loaded is None:  # only while no save was ever committed
            assert best == 0, f"round {k}: no checkpoint loadable after a kill (the last held step {best})"
        else:
            assert len(loaded["values"]) == 1, f"round {k}: weights of several saves mixed: {loaded}"
            assert loaded["values"][0] == loaded["steps"] > 0, f"round {k}: weights and counter disagree: {loaded}"
            assert loaded["steps"] >= best, f"round {k}: an older checkpoint than before: {loaded} < {best}"
            best = loaded["steps"]
        if k == KILLS:
            proc.kill()
            proc.join()
            break
        assert os.path.exists(started), f"round {k}: no background write started (exit code {proc.exitcode})"
        time.sleep(rng.uniform(0.0, KILL_WINDOW_S))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert best > 0

"""Pipeline saves SIGKILLed at random points (2 gloo ranks, 2 stages, tied layers, Adam) never leave
`latest` naming a half-written tag.

Each round is one 2-rank run: it loads `latest` (as a resumed job would, through the engine's
verified loader), records what it got, then saves over and over, every weight and the step counter
stamped with the save's number, until the test SIGKILLs both ranks a random moment later (the two
kills a few milliseconds apart, so one rank may go on alone for a while). Odd rounds re-save the tag
`latest` names (the case where writing in place mixes two saves), even rounds save fresh tags. The
next round's load must give one save whole: every layer of both stages and both stages' counters
hold the same number, never less than the previous round's."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import torch

from tests.distributed import pipe_models as pm
from tests.harness import DistributedTestError, run_distributed

KILLS = 20
KILL_WINDOW_S = 0.6  # the kill lands this long after both ranks are saving, at most


def _engine():
    import deepspeed_c as deepspeed
    from deepspeed_c.pipe import PipelineModule

    model = PipelineModule(pm.specs(), num_stages=2, loss_fn=pm.loss_fn, seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": pm.MBS, "gradient_accumulation_steps": pm.GAS}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    engine.train_batch(iter(pm.batches(1, 1)[0]))  # Adam states in the files too
    return model, engine


def _stamp(model, engine, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    engine.global_steps = step


def _write_json(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _round(rank: int, world: int, save_dir: str, rounds_dir: str, n: int, save: bool) -> None:
    import torch.distributed as dist

    model, engine = _engine()
    record: dict = {"loaded": None}
    if os.path.exists(os.path.join(save_dir, "latest")):
        try:
            path, _ = engine.load_checkpoint(save_dir)
            values = sorted({float(v) for p in model.parameters() for v in p.detach().reshape(-1).tolist()})
            record = {"loaded": os.path.basename(os.path.dirname(path)), "steps": engine.global_steps,
                      "values": values}
        except Exception as e:  # noqa: BLE001 (a load that fails is the finding)
            record = {"error": f"{type(e).__name__}: {e}"}
    _write_json(os.path.join(rounds_dir, f"{n}_{rank}.json"), record)
    if not save:
        return
    step = max(int(record.get("steps") or 0), 0)
    if record["loaded"] is None:  # the first round: one good save before any kill
        step += 1
        _stamp(model, engine, step)
        engine.save_checkpoint(save_dir, tag="same")
    dist.barrier()
    _write_json(os.path.join(rounds_dir, f"{n}_{rank}.pid"), {"pid": os.getpid()})
    while True:
        step += 1
        _stamp(model, engine, step)
        engine.save_checkpoint(save_dir, tag="same" if n % 2 else f"global_step{step}")


def _wait_for(paths: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"the saving ranks never got ready ({paths})")
        time.sleep(0.02)


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _kill_round(save_dir: str, rounds_dir: str, n: int, rng: random.Random) -> None:
    """Round n on 2 ranks, both SIGKILLed a random moment after they start saving."""
    failure: list = []

    def run() -> None:
        try:
            run_distributed(_round, world_size=2, args=(save_dir, rounds_dir, n, True), timeout=120)
            failure.append("the saving ranks returned; they should have been killed")
        except DistributedTestError:
            pass  # both ranks are killed; the one killed second may first fail on its dead peer

    thread = threading.Thread(target=run)
    thread.start()
    pid_files = [os.path.join(rounds_dir, f"{n}_{r}.pid") for r in range(2)]
    try:
        _wait_for(pid_files, 100)
        time.sleep(rng.uniform(0.0, KILL_WINDOW_S))
        pids = [_read(p)["pid"] for p in pid_files]
        rng.shuffle(pids)
        for i, pid in enumerate(pids):
            os.kill(pid, signal.SIGKILL)
            if i == 0:
                time.sleep(rng.uniform(0.0, 0.02))
    finally:
        thread.join(150)
    assert not thread.is_alive(), f"round {n}: the killed run did not end"
    assert not failure, f"round {n}: {failure[0]}"


def test_sigkilled_pipeline_saves_leave_latest_whole(tmp_path):
    rng = random.Random(4321)
    save_dir, rounds_dir = str(tmp_path / "ckpt"), str(tmp_path / "rounds")
    os.makedirs(rounds_dir)
    last, interrupted, advanced = 1, 0, 0
    for n in range(KILLS + 1):
        if n < KILLS:
            _kill_round(save_dir, rounds_dir, n, rng)
            if any(name.endswith(".partial") or name.endswith(".old") for name in os.listdir(save_dir)):
                interrupted += 1
        else:  # the last kill's checkpoint, loaded by a run that only loads
            run_distributed(_round, world_size=2, args=(save_dir, rounds_dir, n, False), timeout=120)
        if n == 0:
            continue  # round 0 loaded nothing: it wrote the first checkpoint
        records = [_read(os.path.join(rounds_dir, f"{n}_{r}.json")) for r in range(2)]
        for rank, rec in enumerate(records):
            assert "error" not in rec, f"round {n}: rank {rank} could not load latest: {rec['error']}"
            # one save, whole: every weight this stage holds is that save's number, and so is its counter
            assert rec["values"] == [float(rec["steps"])], \
                f"round {n}: rank {rank} loaded a mix of saves: weights {rec['values']}, global_steps {rec['steps']}"
        assert records[0]["steps"] == records[1]["steps"], f"round {n}: the stages loaded different saves {records}"
        assert records[0]["loaded"] == records[1]["loaded"]
        step = records[0]["steps"]
        assert step >= last, f"round {n}: latest went back from save {last} to {step}"
        advanced += step > last
        last = step
    assert advanced > 0, "no save ever completed before its kill: the kill window is too short to test anything"
    assert interrupted > 0, "no kill landed inside a save: the test exercised nothing"

"""Fault injection: saves SIGKILLed at random points never damage the previous checkpoint; loading
`latest` afterwards yields the last complete checkpoint, verified against its manifest."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.checkpointing import engine as checkpoint_engine
from tests.distributed.engine_models import MLP

KILLS = 24


pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def make(hidden: int = 64):
    torch.manual_seed(0)
    engine, *_ = deepspeed_c.initialize(model=MLP(hidden=hidden), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    return engine


def stamp(engine, step: int) -> None:
    """Every weight equals the step number, so a loaded checkpoint shows which save it came from."""
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(float(step))
    engine.global_steps = step


def saver_child(engine, save_dir: str, start: int) -> None:
    # The forked child has no working process group (gloo's threads are not forked): save as one rank.
    checkpoint_engine._dist = lambda: False
    step = start
    while True:
        step += 1
        stamp(engine, step)
        engine.save_checkpoint(save_dir)


def test_sigkilled_saves_leave_previous_checkpoint_loadable(tmp_path):
    rng = random.Random(1234)
    engine = make()
    stamp(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    last_step, interrupted = 1, 0
    for _ in range(KILLS):
        pid = os.fork()
        if pid == 0:  # pragma: no cover (child)
            try:
                saver_child(engine, str(tmp_path), last_step)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), "the saver must die by SIGKILL, not exit"
        fresh = make()
        path, _ = fresh.load_checkpoint(str(tmp_path))
        assert path is not None
        step = fresh.global_steps
        assert step >= last_step, f"latest went backwards: {step} < {last_step}"
        assert os.path.basename(os.path.dirname(path)) == f"global_step{step}"
        for name, p in fresh.module.named_parameters():
            assert torch.all(p == float(step)), f"{name} does not hold the weights of save {step}"
        if any(n.startswith(".") for n in os.listdir(tmp_path)):
            interrupted += 1
        last_step = step
    # Every complete tag directory still loads and verifies.
    for name in os.listdir(tmp_path):
        if name.startswith("global_step"):
            e = make()
            e.load_checkpoint(str(tmp_path), tag=name)
            assert e.global_steps == int(name.removeprefix("global_step"))
    assert last_step > 1, "no save ever completed; the kill window is too short to test anything"
    assert interrupted > 0, "no kill landed inside a save; the test exercised nothing"

"""TrainState: the engine's training counters save and load themselves; the engine's DeepSpeed
attributes (global_steps, global_samples, skipped_steps, micro_steps) read and write through it, and a
loaded checkpoint restores them through it (keys on disk: DeepSpeed's)."""
from __future__ import annotations

import os

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.train_state import TrainState
from tests.distributed.engine_models import MLP

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def _engine():
    torch.manual_seed(0)
    engine, *_ = deepspeed_c.initialize(model=MLP(hidden=16), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    return engine


def test_round_trip_uses_deepspeed_keys_and_leaves_micro_steps():
    state = TrainState(global_steps=7, global_samples=56, skipped_steps=2, micro_steps=21)
    saved = state.state_dict()
    assert saved == {"global_steps": 7, "global_samples": 56, "skipped_steps": 2}
    fresh = TrainState(micro_steps=3)
    fresh.load_state_dict({**saved, "module": None})  # a whole model-states dict: other keys ignored
    assert (fresh.global_steps, fresh.global_samples, fresh.skipped_steps, fresh.micro_steps) == (7, 56, 2, 3)


def test_missing_global_samples_defaults_from_the_batch_size():
    state = TrainState()
    state.load_state_dict({"global_steps": 5, "skipped_steps": 1}, samples_per_step=8)
    assert (state.global_steps, state.global_samples, state.skipped_steps) == (5, 40, 1)
    state.load_state_dict({"global_steps": 5, "skipped_steps": 1})
    assert state.global_samples == 0
    with pytest.raises(KeyError):
        TrainState().load_state_dict({"global_samples": 3, "skipped_steps": 0})


def test_engine_attributes_read_and_write_through_the_train_state():
    engine = _engine()
    assert isinstance(engine.train_state, TrainState)
    engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps = 4, 16, 1, 9
    assert engine.train_state == TrainState(global_steps=4, global_samples=16, skipped_steps=1, micro_steps=9)
    engine.train_state.global_steps = 6
    assert engine.global_steps == 6
    x = torch.randn(2, 12)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (7, 16 + engine.train_batch_size(), 10)
    assert "global_steps" not in vars(engine)  # one state, not a shadowing attribute


def test_loaded_checkpoint_restores_the_counters_through_the_train_state(tmp_path):
    engine = _engine()
    engine.train_state.load_state_dict({"global_steps": 12, "global_samples": 96, "skipped_steps": 3})
    engine.save_checkpoint(str(tmp_path))
    saved = torch.load(os.path.join(tmp_path, "global_step12", "mp_rank_00_model_states.pt"), weights_only=False)
    assert (saved["global_steps"], saved["global_samples"], saved["skipped_steps"]) == (12, 96, 3)
    other = _engine()
    calls = []
    original = other.train_state.load_state_dict

    def recording(state, samples_per_step=None):
        calls.append(samples_per_step)
        original(state, samples_per_step=samples_per_step)

    other.train_state.load_state_dict = recording
    path, client = other.load_checkpoint(str(tmp_path))
    assert calls == [other.train_batch_size()] and client == {}
    assert (other.global_steps, other.global_samples, other.skipped_steps) == (12, 96, 3)

"""deepspeed.runtime.checkpoint_engine: the engine kinds create_checkpoint_engine picks from the config,
TorchCheckpointEngine's crash-safe file round trip, the decoupled engine's snapshot-at-save and commit
check, and the refusals (abstract base, DataStates without its package). The engine's use of a user's
CheckpointEngine (hooks, files, resume) runs with 2 gloo ranks in tests/distributed/test_checkpoint_async_writer.py."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from deepspeed_c.runtime.checkpoint_engine import (CheckpointCommitInfo, DataStatesCheckpointEngine,
                                                   DecoupledCheckpointEngine, FastCheckpointEngine,
                                                   TorchCheckpointEngine, create_checkpoint_engine)
from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


def _config(extra: dict) -> Any:
    from deepspeed_c.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig({"train_batch_size": 1, **extra})


@pytest.mark.parametrize("extra,kind", [
    ({}, TorchCheckpointEngine),
    ({"checkpoint": {"writer": {"type": "python"}}}, FastCheckpointEngine),
    ({"checkpoint": {"writer": {"type": "fast", "decoupled": True}}}, DecoupledCheckpointEngine),
    ({"datastates_ckpt": {"host_cache_size": 1}}, DecoupledCheckpointEngine),  # our decoupled writer serves it
])
def test_create_checkpoint_engine_follows_the_config(extra: dict, kind: type) -> None:
    engine = create_checkpoint_engine(_config(extra), None, 0, False, True)
    assert type(engine) is kind and engine.is_decoupled() is (kind is DecoupledCheckpointEngine)
    assert engine.is_data_parallel_writer(0) and engine.preserves_storage_sharing()


def test_torch_engine_round_trip_and_base_defaults(tmp_path: Any) -> None:
    with pytest.raises(TypeError):
        CheckpointEngine()  # abstract: create, save, load, commit
    engine = TorchCheckpointEngine()
    assert (engine.name, engine.is_data_parallel_writer(1), engine.get_commit_info()) == ("TorchCheckpointEngine",
                                                                                          False, None)
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=True)
    engine.makedirs(str(tmp_path / "t"), exist_ok=True)
    engine.create(info)
    sd = {"w": torch.arange(6.0).view(2, 3)[:, 1], "n": 3}  # a view into a larger storage
    engine.save(sd, str(tmp_path / "t" / "f.pt"))
    assert engine.commit(info) is True
    assert sorted(os.listdir(tmp_path / "t")) == ["f.pt"]  # no temporaries left beside it
    back = engine.load(str(tmp_path / "t" / "f.pt"), map_location=torch.device("cpu"))
    assert torch.equal(back["w"], torch.tensor([1.0, 4.0])) and back["n"] == 3
    with pytest.raises(TypeError, match="checkpoint"):  # only plain state goes into a checkpoint file
        engine.save({"bad": object()}, str(tmp_path / "t" / "g.pt"))


def test_decoupled_engine_writes_the_state_as_saved_at_commit(tmp_path: Any) -> None:
    engine = DecoupledCheckpointEngine(_config({"checkpoint": {"writer": {"type": "python", "decoupled": True}}}),
                                       True, False)
    info = CheckpointCommitInfo(tag="x", save_dir=str(tmp_path), save_latest=False)
    engine.create(info)
    w = torch.ones(5)
    engine.save({"w": w}, str(tmp_path / "a.pt"))
    w.fill_(7.0)  # training goes on: the file holds the state at save()
    assert engine.get_commit_info() == info
    with pytest.raises(ValueError, match="does not match"):
        engine.commit(CheckpointCommitInfo(tag="y", save_dir=str(tmp_path), save_latest=False))
    assert engine.commit(info) is True and engine.get_commit_info() is None
    assert torch.equal(engine.load(str(tmp_path / "a.pt"))["w"], torch.ones(5))


def test_datastates_engine_needs_its_package() -> None:
    with pytest.raises(RuntimeError, match="datastates"):
        DataStatesCheckpointEngine(None, 0)

"""RNGStates and the data loader's position (runtime/rng_state.py, runtime/data_position.py) in one process:
what comes back after a round trip through a checkpoint file (torch.save / the weights_only loader)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from deepspeed_c.checkpoint import safe_load
from deepspeed_c.runtime.dataloader import DeepSpeedDataLoader
from deepspeed_c.runtime.rng_state import RNGStates


def _through_file(obj: Any, tmp_path: Any) -> Any:
    path = str(tmp_path / "s.pt")
    torch.save(obj, path)
    return safe_load.load(path)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_states_round_trip(tmp_path: Any) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = _through_file(RNGStates().state_dict(), tmp_path)
    want = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    RNGStates().load_state_dict(state)
    assert _draws() == want


def test_rng_states_missing_key_is_named() -> None:
    with pytest.raises(KeyError, match="np_rng_state"):
        RNGStates().load_state_dict({"random_rng_state": [3, [0] * 625, None],
                                     "torch_rng_state": torch.get_rng_state()})


def _loader(dataset: Any) -> DeepSpeedDataLoader:
    # local_rank -1: one process, the RandomSampler the loader builds itself
    return DeepSpeedDataLoader(dataset, batch_size=3, pin_memory=False, local_rank=-1, tput_timer=None,
                               num_local_io_workers=0)


def test_random_sampler_position_round_trip(tmp_path: Any) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(20.0))
    torch.manual_seed(0)
    loader = _loader(dataset)
    first = [next(loader)[0].tolist() for _ in range(3)]
    state = _through_file(loader.state_dict(), tmp_path)
    rest = [b[0].tolist() for b in loader.data]  # what the uninterrupted pass feeds next
    assert state["batches"] == 3
    torch.manual_seed(77)
    resumed = _loader(dataset)
    resumed.load_state_dict(state)
    again = [b[0].tolist() for b in resumed]
    assert again == rest
    assert sorted(sum(first + rest, [])) == list(range(20))


def test_changed_batch_size_resumes_after_the_consumed_samples() -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(24.0))
    loader = _loader(dataset)
    loader.load_state_dict({"batches": 4, "batch_size": 2, "dp_world_size": 2, "epoch": None, "sampler_seed": 5})
    assert len([b for b in loader]) == 8 - 16 // 3  # 16 samples consumed: 5 whole batches of 3 skipped


def test_bad_position_is_named() -> None:
    loader = _loader(torch.utils.data.TensorDataset(torch.arange(4.0)))
    with pytest.raises(ValueError, match="batches"):
        loader.load_state_dict({"epoch": 1})

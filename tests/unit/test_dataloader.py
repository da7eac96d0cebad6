"""RepeatingLoader and DeepSpeedDataLoader: sharding, batching, drop_last, collate_fn, length."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from deepspeed_c.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1), torch.arange(n))


def test_repeating_loader_restarts():
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    rep = RepeatingLoader(loader)
    got = [next(rep).tolist() for _ in range(7)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4], [0, 1]]
    assert iter(rep) is rep


def test_repeating_loader_empty_raises_stop_iteration():
    rep = RepeatingLoader([])
    with pytest.raises(StopIteration):
        next(rep)


def test_utils_export():
    import deepspeed_c.utils as u

    assert u.RepeatingLoader is RepeatingLoader


@pytest.mark.parametrize("world,drop_last", [(1, False), (2, False), (3, True), (4, False)])
def test_sharding_covers_dataset_once_per_epoch(world, drop_last):
    n, bs = 23, 4
    ds = _dataset(n)
    seen: list[int] = []
    for rank in range(world):
        dl = DeepSpeedDataLoader(ds, batch_size=bs, pin_memory=False, local_rank=rank, tput_timer=None,
                                 num_local_io_workers=0, data_parallel_world_size=world, data_parallel_rank=rank,
                                 dataloader_drop_last=drop_last)
        per_rank = math.ceil(n / world)  # DistributedSampler pads to an equal share
        want_len = per_rank // bs if drop_last else math.ceil(per_rank / bs)
        assert len(dl) == want_len
        batches = list(iter(dl))
        assert len(batches) == want_len
        for x, y in batches:
            assert x.shape[0] == y.shape[0] <= bs
            assert torch.equal(x[:, 0].long(), y)  # rows stay intact through the sampler
            if drop_last:
                assert x.shape[0] == bs
            seen.extend(y.tolist())
    if not drop_last:
        # every sample is seen; padding repeats only a few
        assert set(seen) == set(range(n))
        assert len(seen) == math.ceil(n / world) * world


def test_collate_fn_and_reiteration():
    ds = _dataset(10)
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return torch.stack([s[0] for s in samples]).sum()

    dl = DeepSpeedDataLoader(ds, batch_size=3, pin_memory=False, local_rank=0, tput_timer=None, collate_fn=collate,
                             num_local_io_workers=0, data_parallel_world_size=1, data_parallel_rank=0)
    first = [b.item() for b in dl]
    second = [b.item() for b in dl]
    assert calls == [3, 3, 3, 1] * 2
    assert sum(first) == pytest.approx(sum(range(10)))
    assert first == second  # the sampler's epoch is not advanced by the loader (as in DeepSpeed)


def test_next_without_iter_and_timer():
    class Timer:
        starts = 0

        def start(self):
            Timer.starts += 1

    dl = DeepSpeedDataLoader(_dataset(6), batch_size=2, pin_memory=False, local_rank=0, tput_timer=Timer(),
                             num_local_io_workers=0, data_parallel_world_size=2, data_parallel_rank=1)
    x, y = next(dl)
    assert x.shape == (2, 1) and Timer.starts == 1


def test_default_workers_and_bad_batch_size():
    dl = DeepSpeedDataLoader(_dataset(4), batch_size=2, pin_memory=False, local_rank=0, tput_timer=None,
                             data_parallel_world_size=1, data_parallel_rank=0)
    assert dl.num_local_io_workers == 2  # 2 * device_count, one device per rank
    with pytest.raises(ValueError, match="batch_size"):
        DeepSpeedDataLoader(_dataset(4), batch_size=0, pin_memory=False, local_rank=0, tput_timer=None)
    with pytest.raises(NotImplementedError, match="curriculum_learning"):
        DeepSpeedDataLoader(_dataset(4), batch_size=2, pin_memory=False, local_rank=0, tput_timer=None,
                            data_parallel_world_size=1, data_parallel_rank=0,
                            deepspeed_dataloader_config={"curriculum_learning": True})

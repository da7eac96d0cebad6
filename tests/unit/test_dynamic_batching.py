"""Dynamic batching (data_efficiency.data_sampling.dynamic_batching): the packing, the data loader's per-rank
batches and the scaled LRs equal the real DeepSpeed 0.19.8's (pinned in dynamic_batching.json by
make_dynamic_batching_fixtures.py, which runs the same cases through both); sqrt scaling (which DeepSpeed's
own code cannot run: it calls torch.sqrt on a float) against the formula; and through the engine: the loader
and LR scheduler from the config, the sequence lengths read from the DataAnalyzer's seqlen files (written on
first use from batch_seqlens_fn), every micro-batch within max_tokens, the LR scaled by each batch's size."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vb
from tests.fixtures.data_efficiency import dynamic_batching_cases as C
from tests.fixtures.data_efficiency.make_dynamic_batching_fixtures import run_cases

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def test_packing_loader_and_lr_equal_deepspeeds():
    with open(C.FIXTURE) as f:
        want = json.load(f)
    got = json.loads(json.dumps(run_cases(vb)))
    for section in ("packing", "loader", "lr"):
        for name in want[section]:
            assert got[section][name] == want[section][name], (section, name)


def test_packing_limits_and_sqrt_scaling():
    lens = C.seqlens()
    mb, sizes, maxlens = vb.batch_by_seqlens(lens, 100, min_batch_size=2, max_batch_size=5, effective_batch_size=3,
                                             required_microbatches_of_same_size=True)
    assert len(mb) == 3 * len(sizes)
    for b in range(len(sizes)):
        group = mb[3 * b:3 * b + 3]
        assert all(bid == b for bid, _ in group)
        assert len({len(ids) for _, ids in group}) == 1 and 2 <= len(group[0][1]) <= 5
        assert all(sum(lens[i] for i in ids) <= 100 for _, ids in group)
        assert sizes[b] == sum(len(ids) for _, ids in group) and maxlens[b] == max(lens[i] for _, ids in group
                                                                                    for i in ids)
    assert vb.scale_lr(8, 2, 0.4, "sqrt") == pytest.approx(0.4 * math.sqrt(2 / 8))
    with pytest.raises(ValueError, match="cubic"):
        vb.scale_lr(8, 2, 0.4, "cubic")


class Tokens(torch.utils.data.Dataset):
    """Sample i: a sequence of lens[i] tokens."""

    def __init__(self) -> None:
        self.lens = np.random.default_rng(5).integers(2, 17, 64)

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(int(self.lens[i])) % 7 + 1


def _pad(samples: list) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


def test_engine_loader_and_lr_from_the_config(tmp_path):
    data = Tokens()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "data_efficiency": {"enabled": True, "seed": 3, "data_sampling": {"enabled": True, "num_workers": 0,
                               "dynamic_batching": {"enabled": True, "max_tokens": 40, "min_batch_size": 2,
                                                    "lr_scaling_method": "linear",
                                                    "metrics_path": str(tmp_path / "metrics")}}}}
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 1))
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    assert engine.data_efficiency_config()["data_sampling"]["dynamic_batching"]["sequence_picking_order"] == "dataloader"
    # no seqlen files yet: the DataAnalyzer writes them from batch_seqlens_fn, then they are read
    loader, sched, io_kwargs = vb.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        data, engine, dataloader_collate_fn=_pad, batch_seqlens_fn=lambda b: (b != 0).sum(dim=1))
    assert (tmp_path / "metrics" / "seqlen" / "seqlen_sample_to_metric.bin").is_file()
    assert io_kwargs["batch_size"] == 1 and set(io_kwargs) >= {"dataset", "data_sampler", "collate_fn"}
    sizes = sched.batch_sizes
    seen = []
    for step, batch in enumerate(loader):
        assert int((batch != 0).sum()) <= 40 and batch.shape[0] >= 2
        assert engine.get_lr()[0] == pytest.approx(0.1 * batch.shape[0] / 1) and batch.shape[0] == sizes[step]
        loss = engine(batch).pow(2).mean()
        engine.backward(loss)
        engine.step()
        sched.step()
        seen += batch.shape[0] * [None]
    assert len(seen) == sum(sizes) and 0 < len(seen) <= len(data)
    engine.destroy()

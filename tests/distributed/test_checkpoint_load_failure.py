"""A checkpoint load that fails on one rank raises on every rank, within seconds, at ZeRO stages 0-3.

Two real gloo ranks save a checkpoint, then load copies of it in which one file only rank 1 reads is
corrupted: its per-rank ZeRO file, its ZeRO-3 model-states file, its reducer-order file, or (each
rank loading its own copy of the checkpoint, as ranks on different machines do) the shared
model-states file or `latest` (emptied) in rank 1's copy only. Every rank calls
engine.load_checkpoint inside try/except, as "resume if possible" code does, and then meets the
others at one more barrier: a rank left inside the load's collectives would hang there until the
process group timed out (30 minutes), so the run's own timeout fails the test. Every rank's error
must name the damaged file."""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import pytest
import torch

from tests.distributed.engine_models import MLP, loss_fn
from tests.harness import run_distributed

TAG = "t"
SECONDS = 15.0  # far below any process-group timeout; a load of this model takes well under a second
MODEL_FILE = "mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class Case:
    name: str
    file: str  # inside the tag directory, or `latest` beside it
    per_rank_dirs: bool  # each rank loads its own copy (rank 1's is damaged); else one shared copy


def _cases(stage: int) -> list[Case]:
    zero_optim = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    order = "dsc_reducer_order_rank_00001_of_00002.pt"
    if stage == 0:  # and rank 1's `latest` emptied (truncated by a crash or a full disk)
        return [Case("model", MODEL_FILE, True), Case("order", order, False), Case("latest", "latest", True)]
    if stage in (1, 2):
        return [Case("model", MODEL_FILE, True), Case("zero", zero_optim, False)]
    return [Case("model3", "zero_pp_rank_1_mp_rank_00_model_states.pt", False), Case("zero", zero_optim, False)]


def _engine(stage: int):
    import deepspeed_c

    torch.manual_seed(3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                 "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed_c.initialize(model=MLP(), config=cfg)
    return engine


def _corrupt(path: str) -> None:
    """Same size, bytes flipped in the middle: only the contents are wrong (as bit rot or a torn write)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def body(rank: int, world: int, stage: int, root: str) -> list[dict]:
    import torch.distributed as dist

    engine = _engine(stage)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        x, y = torch.randn(2 * world, 12, generator=g), torch.randn(2 * world, 3, generator=g)
        sl = slice(2 * rank, 2 * rank + 2)
        engine.backward(loss_fn(engine(x[sl]), y[sl]))
        engine.step()
    clean = os.path.join(root, "clean")
    engine.save_checkpoint(clean, tag=TAG)
    dist.barrier()
    out = []
    for case in _cases(stage):
        shared = os.path.join(root, case.name)
        load_dir = os.path.join(shared, f"rank{rank}") if case.per_rank_dirs else shared
        if case.per_rank_dirs or rank == 0:
            shutil.copytree(clean, load_dir)
        where = "" if case.file == "latest" else TAG
        present = os.path.isfile(os.path.join(clean, where, case.file))
        if present and rank == (1 if case.per_rank_dirs else 0):
            if case.file == "latest":
                open(os.path.join(load_dir, "latest"), "w").close()
            else:
                _corrupt(os.path.join(load_dir, TAG, case.file))
        dist.barrier()
        start = time.monotonic()
        error = None
        try:
            engine.load_checkpoint(load_dir)
        except Exception as e:  # noqa: BLE001 ("resume if possible" code catches whatever the load raised)
            error = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - start
        dist.barrier()  # no rank is left inside the load
        out.append({"case": case.name, "file": case.file, "present": present, "error": error, "elapsed": elapsed})
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_corrupt_file_on_one_rank_raises_on_every_rank(stage, tmp_path):
    results = run_distributed(body, 2, args=(stage, str(tmp_path)), timeout=120)
    for case in range(len(_cases(stage))):
        per_rank = [results[r][case] for r in range(2)]
        assert per_rank[0]["present"], f"stage {stage}: the checkpoint holds no {per_rank[0]['file']} to corrupt"
        for r, got in enumerate(per_rank):
            assert got["error"] is not None, f"stage {stage} {got['case']}: rank {r} did not raise"
            assert got["file"] in got["error"], (f"stage {stage} {got['case']}: rank {r}'s error does not name "
                                                 f"{got['file']}: {got['error']}")
            assert got["elapsed"] < SECONDS, f"stage {stage} {got['case']}: rank {r} took {got['elapsed']:.1f}s"

"""Collective entry points with a bad argument on 2 ranks raise on every rank, in bounded time.

DeepSpeed's behaviour: `save_checkpoint`, `load_checkpoint` and `save_16bit_model` must be called
by every rank ("all processes must call this method", its docs say); a bad argument there is a
user error to be reported, not a reason for the other ranks to wait forever. Before this fix
`save_checkpoint(save_dir=None)` raised on rank 0 inside and left rank 1 at a barrier. Each case
runs under the harness timeout (60 s), so a hang fails the test instead of the suite."""
from __future__ import annotations

import dataclasses
import os

import pytest

from tests.distributed.test_engine_save16_compile import _engine, _train
from tests.harness import run_distributed


def bad_args_body(rank: int, world: int, root: str) -> dict:
    from deepspeed_c.runtime.checkpointing.collective_guard import RankFailed

    engine = _engine(2, False)
    _train(engine, rank, world, steps=1)
    outcome = {}
    cases = {
        "save_none": lambda: engine.save_checkpoint(None),
        "save_empty": lambda: engine.save_checkpoint(""),
        "load_none": lambda: engine.load_checkpoint(None),
        "save16_none": lambda: engine.save_16bit_model(None),
        # only rank 0 writes, and its directory is a regular file: rank 1's part cannot fail
        "save16_unwritable": lambda: engine.save_16bit_model(os.path.join(root, "a_file", "sub")),
        "save_unwritable": lambda: engine.save_checkpoint(os.path.join(root, "a_file", "ckpt")),
        # a directory named per rank (DeepSpeedExamples' BERT script stamps the time into it): a split save
        "save_per_rank": lambda: engine.save_checkpoint(os.path.join(root, f"run_{rank}")),
    }
    if rank == 0:
        with open(os.path.join(root, "a_file"), "w") as f:
            f.write("not a directory")
    import torch.distributed as dist

    dist.barrier()
    for name, call in cases.items():
        try:
            call()
            outcome[name] = "returned"
        except RankFailed as e:
            outcome[name] = f"RankFailed: {e}"
        except (ValueError, TypeError, OSError) as e:
            outcome[name] = f"{type(e).__name__}: {e}"
    # the ranks are still in step: a good save afterwards works
    engine.save_checkpoint(os.path.join(root, "good"))
    outcome["good_load"] = engine.load_checkpoint(os.path.join(root, "good"))[0] is not None
    # the split save (each rank its own directory, as DeepSpeed allows) loads back from those directories
    import torch

    saved = [p.detach().clone() for p in engine.module.parameters()]
    _train(engine, rank, world, steps=1)
    own = os.path.join(root, f"run_{rank}")
    outcome["split_files"] = sorted(os.listdir(os.path.join(own, "global_step1")))
    outcome["split_load"] = engine.load_checkpoint(own)[0]
    outcome["split_equal"] = all(torch.equal(a, b) for a, b in zip(saved, engine.module.parameters()))
    outcome["tags"] = _per_rank_tags(engine, rank, root, saved)
    return outcome


def _per_rank_tags(warn_engine, rank: int, root: str, saved: list) -> dict:
    """Ranks saving under different tags (DeepSpeed's test_tag_validation): FAIL raises on every rank;
    WARN (the default, `warn_engine`) warns and IGNORE goes on, each rank's files under its own tag."""
    import logging

    import torch

    from deepspeed_c.utils.logging import logger

    out = {}
    for mode in ("FAIL", "IGNORE"):
        engine = _engine(2, False)
        engine.checkpointer.options = dataclasses.replace(
            engine.checkpointer.options, tag_validation=mode != "IGNORE", tag_validation_fail=mode == "FAIL")
        try:
            engine.save_checkpoint(os.path.join(root, mode), tag=f"tag-{rank}")
            out[mode] = "returned"
        except AssertionError as e:
            out[mode] = f"AssertionError: {e}"
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        warn_engine.save_checkpoint(os.path.join(root, "WARN"), tag=f"tag-{rank}")
    finally:
        logger.removeHandler(handler)
    out["WARN_logged"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    for mode in ("WARN", "IGNORE"):
        folder = os.path.join(root, mode)
        out[f"{mode}_listing"] = {t: sorted(f for f in os.listdir(os.path.join(folder, t)) if f.endswith(".pt"))
                                  for t in ("tag-0", "tag-1") if os.path.isdir(os.path.join(folder, t))}
        out[f"{mode}_staging_left"] = [f for f in os.listdir(folder) if f.endswith(".partial")]
        with open(os.path.join(folder, "latest")) as f:
            out[f"{mode}_latest"] = f.read().strip()
    # each rank's tag loads back the weights it saved (the tag directory holds its ranks' files)
    _train(warn_engine, rank, 2, steps=1)
    out["WARN_load"] = warn_engine.load_checkpoint(os.path.join(root, "WARN"), tag=f"tag-{rank}")[0]
    out["WARN_equal"] = all(torch.equal(a, b) for a, b in zip(saved, warn_engine.module.parameters()))
    return out


def test_bad_arguments_raise_on_every_rank(tmp_path):
    res = run_distributed(bad_args_body, 2, args=(str(tmp_path),), timeout=90)
    for rank, out in enumerate(res):
        for name in ("save_none", "save_empty"):
            assert out[name].startswith("ValueError") and "save_dir" in out[name], (rank, name, out[name])
        assert out["load_none"].startswith("ValueError") and "load_dir" in out["load_none"], out
        assert out["save16_none"].startswith("ValueError") and "save_dir" in out["save16_none"], out
        for name in ("save16_unwritable", "save_unwritable"):
            if rank == 0:
                assert out[name].startswith(("OSError", "FileExistsError", "NotADirectoryError")) or \
                    "Error" in out[name].split(":")[0], (name, out[name])
            else:
                assert out[name].startswith("RankFailed") and "rank 0" in out[name], (name, out[name])
        assert out["save_per_rank"] == "returned", out["save_per_rank"]
        # this rank's ZeRO file and a model-states file of the directory's own; no other rank's files
        files = [f for f in out["split_files"] if f.endswith(".pt")]
        assert "mp_rank_00_model_states.pt" in files and any(f"rank_{rank}_" in f for f in files), files
        assert not any(f"rank_{1 - rank}_" in f for f in files), files
        assert f"run_{rank}" in out["split_load"] and "global_step1" in out["split_load"], out["split_load"]
        assert out["split_equal"], out
        assert out["good_load"] is True
        tags = out["tags"]
        assert tags["FAIL"].startswith("AssertionError") and f"'tag-{rank}'" in tags["FAIL"], tags["FAIL"]
        warned = [m for m in tags["WARN_logged"] if "not consistent across all ranks" in m]
        assert len(warned) == 1 and f"rank={rank}" in warned[0], tags["WARN_logged"]
        for mode in ("WARN", "IGNORE"):
            # both tag directories exist, each with its own rank's ZeRO file (DeepSpeed writes each rank's
            # files under its tag); `latest` names rank 0's tag as only DeepSpeed's rank 0 writes it
            listing = tags[f"{mode}_listing"]
            assert sorted(listing) == ["tag-0", "tag-1"], listing
            for r in (0, 1):
                assert any(f"rank_{r}_" in f for f in listing[f"tag-{r}"]), listing
                assert not any(f"rank_{1 - r}_" in f for f in listing[f"tag-{r}"]), listing
            assert tags[f"{mode}_latest"] == "tag-0" and tags[f"{mode}_staging_left"] == []
        assert tags["IGNORE"] == "returned"
        assert f"tag-{rank}" in tags["WARN_load"] and tags["WARN_equal"], tags


@pytest.mark.parametrize("value", [None, "", 3])
def test_check_dir_arg_names_the_argument(value):
    from deepspeed_c.runtime.checkpointing.collective_guard import check_dir_arg

    with pytest.raises(ValueError, match="save_dir"):
        check_dir_arg("save_checkpoint", "save_dir", value)

"""checkpoint.writer (runtime/checkpointing/async_writer.py): save_checkpoint returns once the files are
staged, training goes on changing the weights while a thread writes them, and the commit (manifest last,
then the rename and `latest`) happens at the next commit point; 2 gloo ranks, ZeRO-1, fp32.

Checked: the checkpoint holds the state at the save, not the weights trained after it (the resumed run
repeats the uninterrupted run's losses exactly); nothing of it is visible before the commit; the next save
and load_checkpoint commit a pending save; a failed background write raises at the commit point on every
rank, leaves the previous checkpoint and `latest` loadable, and does not stop the next save; the mock
writer commits nothing; an unknown writer type is refused at initialize. The in-process runs share one
launch (tests/shared_launch.py: a world of 2 ranks, then one of 1 for the refused configs)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.harness import free_port
from tests.shared_launch import run_worlds

MICRO = 3


def _net() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))


def _config(writer: Any) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if writer is not None:
        cfg["checkpoint"] = {"writer": writer}
    return cfg


def _train(engine: Any, rank: int, first: int, count: int) -> list[float]:
    out = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 2, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def _latest(root: str) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read()


def body(rank: int, world: int, root: str) -> dict:
    import deepspeed_c
    from deepspeed_c.checkpoint import store

    res: dict[str, Any] = {}
    engine = deepspeed_c.initialize(model=_net(), config=_config({"type": "python", "show_statistics": True}))[0]
    _train(engine, rank, 0, 3)
    engine.save_checkpoint(root, tag="a")  # returns with the files staged
    res["visible_before_commit"] = os.path.isdir(os.path.join(root, "a"))
    straight = _train(engine, rank, 3, 3)  # changes the weights while the thread writes
    res["committed"] = engine.checkpoint_commit()
    res["latest_a"] = _latest(root)
    res["again"] = engine.checkpoint_commit()  # nothing pending

    # a failed background write: raised at the commit point, the previous checkpoint stays loadable
    real = store.save_file

    def failing(obj: Any, path: str) -> dict:
        raise OSError(28, "No space left on device (injected)", path)

    store.save_file = failing
    try:
        engine.save_checkpoint(root, tag="b")
        try:
            engine.checkpoint_commit()
            res["failure"] = "not raised"
        except Exception as e:  # noqa: BLE001
            res["failure"] = str(e)
    finally:
        store.save_file = real
    torch.distributed.barrier()  # rank 0 removes the failed save's staging directory after raising
    res["b_exists"] = os.path.isdir(os.path.join(root, "b")) or os.path.isdir(os.path.join(root, ".b.partial"))
    res["latest_after_failure"] = _latest(root)

    # the next save commits the pending one; load_checkpoint commits a pending save before reading
    engine.save_checkpoint(root, tag="c")
    engine.save_checkpoint(root, tag="d")
    res["c_committed_by_next_save"] = os.path.isdir(os.path.join(root, "c"))
    engine.destroy()

    engine = deepspeed_c.initialize(model=_net(), config=_config({"type": "fast"}))[0]
    engine.load_checkpoint(root, tag="a")
    res["resumed_equal"] = _train(engine, rank, 3, 3) == straight
    engine.save_checkpoint(root, tag="e")
    path, _ = engine.load_checkpoint(root)  # commits "e" first, then follows latest to it
    res["loaded_e"] = path is not None and os.sep + "e" + os.sep in path
    engine.destroy()

    engine = deepspeed_c.initialize(model=_net(), config=_config({"type": "mock"}))[0]
    engine.save_checkpoint(root, tag="m")
    engine.checkpoint_commit()
    res["mock_wrote"] = os.path.isdir(os.path.join(root, "m")) or os.path.isdir(os.path.join(root, ".m.partial"))
    res["latest_after_mock"] = _latest(root)
    engine.destroy()
    return res


def test_async_writer(runs: dict) -> None:
    assert len(runs["async"]) == 2
    for res in runs["async"]:
        assert res["visible_before_commit"] is False
        assert res["committed"] is True and res["again"] is False and res["latest_a"] == "a"
        assert "background write of the previous checkpoint failed" in res["failure"], res["failure"]
        assert "No space left" in res["failure"]
        assert res["b_exists"] is False and res["latest_after_failure"] == "a"
        assert res["c_committed_by_next_save"] is True
        assert res["resumed_equal"] is True
        assert res["loaded_e"] is True
        assert res["mock_wrote"] is False and res["latest_after_mock"] == "e"


def _bad_writer(rank: int, world: int, writer: dict) -> str:
    import deepspeed_c

    try:
        deepspeed_c.initialize(model=_net(), config=_config(writer))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "accepted"


@pytest.mark.parametrize("writer,named", [({"type": "turbo"}, "checkpoint.writer.type"),
                                          ({"type": "python", "buffer": 1}, "buffer"),
                                          ({"type": "python", "data_parallel": "rack"}, "data_parallel")])
def test_bad_writer_config_is_named(runs: dict, writer: dict, named: str) -> None:
    assert named in runs[("bad", repr(writer))][0]


def datastates_body(rank: int, world: int, root: str, cache_gb: float) -> dict:
    import deepspeed_c

    cfg = _config(None)
    cfg["datastates_ckpt"] = {"host_cache_size": cache_gb}
    engine = deepspeed_c.initialize(model=_net(), config=cfg)[0]
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(root, tag="ds")
    straight = _train(engine, rank, 2, 2)
    committed = engine.checkpoint_commit()
    engine.destroy()
    engine = deepspeed_c.initialize(model=_net(), config=_config(None))[0]
    engine.load_checkpoint(root, tag="ds")
    return {"committed": committed, "equal": _train(engine, rank, 2, 2) == straight}


@pytest.mark.parametrize("cache_gb", [16, 1e-6])  # all staged; the host cache full at once: written while saving
def test_datastates_config_runs_on_the_background_writer(runs: dict, cache_gb: float) -> None:
    assert len(runs[("datastates", cache_gb)]) == 2
    for res in runs[("datastates", cache_gb)]:
        assert res == {"committed": True, "equal": True}


def _bad_datastates(rank: int, world: int) -> str:
    import deepspeed_c

    cfg = _config(None)
    cfg["datastates_ckpt"] = {"host_cache_size": -1}
    try:
        deepspeed_c.initialize(model=_net(), config=cfg)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "accepted"


def test_bad_datastates_config_is_named(runs: dict) -> None:
    assert "datastates_ckpt.host_cache_size" in runs["bad_datastates"][0]


class RecordingEngine:
    """A user's checkpoint engine (DeepSpeed's CheckpointEngine interface, torch.save files): records its hooks."""

    def __new__(cls, decoupled: bool) -> Any:
        from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        class Recording(CheckpointEngine):
            def __init__(self) -> None:
                super().__init__()
                self.calls: list = []
                self.info: Any = None

            def create(self, info: Any) -> None:
                self.calls.append(("create", info.tag))
                self.info = info

            def save(self, state_dict: Any, path: str) -> None:
                self.calls.append(("save", os.path.basename(path)))
                torch.save(state_dict, path)

            def load(self, path: str, map_location: Any = None) -> Any:
                self.calls.append(("load", os.path.basename(path)))
                return torch.load(path, map_location=map_location, weights_only=False)

            def commit(self, info: Any) -> bool:
                # rank 0 writes `latest` after its commit (another rank's commit may run later than that)
                self.calls.append(("commit", info.tag,
                                   _latest(info.save_dir) if torch.distributed.get_rank() == 0 else None))
                return True

            def is_decoupled(self) -> bool:
                return decoupled

            def get_commit_info(self) -> Any:
                return self.info

        return Recording()


def user_engine_body(rank: int, world: int, root: str) -> dict:
    """engine.checkpoint_engine: the built-in kinds by config, then a user's engine saving and (decoupled)
    committing at checkpoint_commit, and another engine resuming through a user's engine's load."""
    import deepspeed_c

    res: dict[str, Any] = {}
    engine = deepspeed_c.initialize(model=_net(), config=_config({"type": "python"}))[0]
    res["kinds"] = [type(engine.checkpoint_engine).__name__]
    os.makedirs(root, exist_ok=True)
    if rank == 0:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write("before")
    torch.distributed.barrier()
    engine.checkpoint_engine = mine = RecordingEngine(False)
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(root, tag="u")
    straight = _train(engine, rank, 2, 2)
    res["calls"], res["latest_u"] = mine.calls, _latest(root)
    engine.checkpoint_engine = later = RecordingEngine(True)
    engine.save_checkpoint(root, tag="v")
    res["latest_before_commit"] = _latest(root)
    res["committed"] = engine.checkpoint_commit()
    res["decoupled_calls"], res["latest_v"] = later.calls, _latest(root)
    engine.destroy()
    engine = deepspeed_c.initialize(model=_net(), config=_config(None))[0]
    res["kinds"].append(type(engine.checkpoint_engine).__name__)
    engine.checkpoint_engine = reader = RecordingEngine(False)
    engine.load_checkpoint(root, tag="u")
    res["resumed_equal"] = _train(engine, rank, 2, 2) == straight
    res["loads"] = reader.calls
    engine.destroy()
    return res


def test_user_checkpoint_engine_gets_every_file_and_hook(runs: dict) -> None:
    for rank, res in enumerate(runs["user_engine"]):
        assert res["kinds"] == ["FastCheckpointEngine", "TorchCheckpointEngine"]
        rng = f"dsc_rng_state_rank_{rank:05d}_of_00002.pt"
        mine = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", rng} | (
            {"mp_rank_00_model_states.pt"} if rank == 0 else set())
        calls = res["calls"]
        assert calls[0] == ("create", "u") and calls[-1] == ("commit", "u", "before" if rank == 0 else None)
        assert {c[1] for c in calls[1:-1]} == mine and all(c[0] == "save" for c in calls[1:-1])
        assert res["latest_u"] == "u"
        # decoupled: committed at the commit point, `latest` only then
        assert (res["latest_before_commit"], res["committed"], res["latest_v"]) == ("u", True, "v"), res
        assert res["decoupled_calls"][-1] == ("commit", "v", "u" if rank == 0 else None)
        assert res["resumed_equal"] is True
        # every rank reads the model states, then its own files
        assert {c[1] for c in res["loads"]} == mine | {"mp_rank_00_model_states.pt"}
        assert all(c[0] == "load" for c in res["loads"])


BAD_WRITERS = [{"type": "turbo"}, {"type": "python", "buffer": 1}, {"type": "python", "data_parallel": "rack"}]
CACHES = [16, 1e-6]


def _cases(rank: int, world: int, cases: list) -> dict:
    """Each case (id, body, its args) in turn on the same ranks; each builds its own engines."""
    return {cid: fn(rank, world, *args) for cid, fn, args in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> dict:
    """Every in-process run of the module in one launch: on 2 ranks the writer's run and the datastates runs
    (each in a checkpoint directory of its own), then on 1 rank the configs initialize must refuse. Per id,
    the results of its ranks."""
    root = tmp_path_factory.mktemp("async")
    two = [("async", body, (str(root / "ckpt"),)), ("user_engine", user_engine_body, (str(root / "user"),))]
    two += [(("datastates", c), datastates_body, (str(root / f"ds{i}"), c)) for i, c in enumerate(CACHES)]
    one = [(("bad", repr(w)), _bad_writer, (w,)) for w in BAD_WRITERS] + [("bad_datastates", _bad_datastates, ())]
    out: dict = {}
    for cases, per_rank in zip((two, one), run_worlds([(2, _cases, (two,)), (1, _cases, (one,))], timeout=600)):
        for cid, _, _ in cases:
            out[cid] = [r[cid] for r in per_rank]
    return out


_EXIT_SCRIPT = """
import sys, torch
import deepspeed_c
torch.manual_seed(0)
engine = deepspeed_c.initialize(model=torch.nn.Linear(64, 64), config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "checkpoint": {"writer": {"type": "python"}}})[0]
loss = engine(torch.randn(1, 64)).sum()
engine.backward(loss)
engine.step()
engine.save_checkpoint(sys.argv[1], tag="x")  # the process exits with the save pending
"""


def test_exit_waits_for_and_commits_a_single_process_save(tmp_path: Any) -> None:
    import subprocess
    import sys

    root = str(tmp_path / "ckpt")
    # a process of its own: no launcher variables another test left in this worker's environment
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, root], capture_output=True, text=True, timeout=300,
                         env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr[-3000:]
    assert _latest(root) == "x" and os.path.isfile(os.path.join(root, "x", "dsc_manifest.json"))

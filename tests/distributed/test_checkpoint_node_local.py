"""checkpoint.use_node_local_storage on 4 gloo ranks simulating 2 nodes of 2 (ranks 0,1 on node 0 and
2,3 on node 1: LOCAL_RANK, LOCAL_WORLD_SIZE and torchrun's GROUP_RANK set as a launcher would). Each
node passes a DIFFERENT save_dir (the same path on two machines' local disks), so a rank can only read
what its own node wrote. Per node: `latest`, the model-states file (written by the node's local rank 0),
a manifest that verifies, and exactly that node's ZeRO files; resuming from the node-local dirs gives
the next losses of an uninterrupted run of the same ranks (stages 0, 1 and 2). With the key off
only global rank 0 writes the model file, and with the key on over one shared directory one rank
writes for both nodes (no two writers race over one staging directory)."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.distributed.engine_models import MLP, loss_fn
from tests.harness import run_distributed

WORLD, PER_NODE = 4, 2
STEPS, HALF = 6, 3
STAGES = (0, 1, 2)
MODEL_FILE = "mp_rank_00_model_states.pt"


def _config(stage: int, node_local: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
            "checkpoint": {"use_node_local_storage": node_local}}


def _engine(stage: int, node_local: bool):
    import deepspeed_c

    torch.manual_seed(2)
    engine, *_ = deepspeed_c.initialize(model=MLP(), config=_config(stage, node_local))
    return engine


def _train(engine, rank: int, start: int, stop: int) -> list[float]:
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2 * WORLD, 12, generator=g), torch.randn(2 * WORLD, 3, generator=g)) for _ in range(STEPS)]
    losses = []
    for x, y in data[start:stop]:
        sl = slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(engine(x[sl]), y[sl])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def body(rank: int, world: int, root: str) -> dict:
    from deepspeed_c.checkpoint import store


    node = rank // PER_NODE
    for var in ("CROSS_RANK", "NODE_RANK"):
        os.environ.pop(var, None)
    os.environ.update({"LOCAL_RANK": str(rank % PER_NODE), "LOCAL_WORLD_SIZE": str(PER_NODE),
                       "GROUP_RANK": str(node)})
    written: list[str] = []
    real_save = store.save_file

    def recording_save(obj: dict, path: str) -> dict:
        written.append(os.path.basename(path))
        return real_save(obj, path)

    store.save_file = recording_save
    out: dict = {"written": {}, "reference": {}, "resumed": {}, "loaded_from": {}}
    for stage in STAGES:
        # the uninterrupted reference run saves half way into this node's own directory
        node_dir = os.path.join(root, f"stage{stage}", f"node{node}")
        first = _engine(stage, True)
        losses = _train(first, rank, 0, HALF)
        written.clear()
        assert first.save_checkpoint(node_dir)
        out["written"][stage] = list(written)
        out["reference"][stage] = losses + _train(first, rank, HALF, STEPS)
        # resume in a fresh engine from the node-local directory only
        second = _engine(stage, True)
        path, _ = second.load_checkpoint(node_dir)
        assert second.global_steps == HALF
        out["loaded_from"][stage] = path
        out["resumed"][stage] = _train(second, rank, HALF, STEPS)
    # key off, one shared directory: global rank 0 alone writes the model file
    off = _engine(1, False)
    _train(off, rank, 0, HALF)
    written.clear()
    off.save_checkpoint(os.path.join(root, "off"))
    out["written"]["off"] = list(written)
    # key on over a directory both nodes share: one writer for both, and resume still matches
    shared = _engine(2, True)
    _train(shared, rank, 0, HALF)
    written.clear()
    shared.save_checkpoint(os.path.join(root, "shared"))
    out["written"]["shared"] = list(written)
    again = _engine(2, True)
    again.load_checkpoint(os.path.join(root, "shared"))
    out["resumed"]["shared"] = _train(again, rank, HALF, STEPS)
    out["errors"] = _node_disagreement_raises_everywhere(again, rank, os.path.join(root, "stage2", f"node{node}"))
    return out


def _node_disagreement_raises_everywhere(engine, rank: int, node_dir: str) -> dict:
    """One node's directory lacks what the other's holds: every rank raises (none waits in a collective)."""
    import torch.distributed as dist

    from deepspeed_c.checkpoint import store

    errors = {}
    tag_dir, hidden = os.path.join(node_dir, f"global_step{HALF}"), os.path.join(node_dir, "hidden")
    latest = os.path.join(node_dir, store.LATEST_NAME)
    if rank == PER_NODE:  # node 1's lead: its `latest` names another tag, and its copy of the tag is gone
        store.write_bytes_atomic(latest, b"global_step999")
        os.rename(tag_dir, hidden)
    dist.barrier()
    for case, tag in (("latest", None), ("explicit", f"global_step{HALF}")):
        try:
            engine.load_checkpoint(node_dir, tag=tag)
            errors[case] = None
        except Exception as e:  # noqa: BLE001 (the test compares the kinds and messages)
            errors[case] = f"{type(e).__name__}: {e}"
    dist.barrier()
    if rank == PER_NODE:
        os.rename(hidden, tag_dir)
        store.write_bytes_atomic(latest, f"global_step{HALF}".encode())
    dist.barrier()
    return errors


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nodelocal"))
    return root, run_distributed(body, world_size=WORLD, args=(root,), timeout=240)


ZERO_NAME = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def _zero_ranks(names: list[str]) -> list[int]:
    return sorted(int(m.group(1)) for n in names if (m := ZERO_NAME.match(n)))


def _verify_node_dir(node_dir: str) -> set[str]:
    from deepspeed_c.checkpoint import store

    tag = store.read_latest(node_dir)
    assert tag == f"global_step{HALF}", (node_dir, store.listing(node_dir))
    tag_dir = os.path.join(node_dir, tag)
    manifest = store.read_manifest(tag_dir)
    assert manifest is not None and manifest["tag"] == tag
    on_disk = set(os.listdir(tag_dir)) - {store.MANIFEST_NAME}
    assert set(manifest["files"]) == on_disk  # the manifest covers exactly this directory's files
    for name in on_disk:
        store.load_file(tag_dir, name, manifest)  # size, sha256 and every tensor verify
    assert os.path.isfile(os.path.join(node_dir, "zero_to_fp32.py"))
    assert not [n for n in os.listdir(node_dir) if n.startswith(".")]  # no staging dir or probe left behind
    return on_disk


@pytest.mark.parametrize("stage", STAGES)
def test_each_node_dir_holds_its_own_files(run, stage):
    root, results = run
    for node in range(WORLD // PER_NODE):
        names = _verify_node_dir(os.path.join(root, f"stage{stage}", f"node{node}"))
        assert MODEL_FILE in names
        want = list(range(node * PER_NODE, (node + 1) * PER_NODE)) if stage > 0 else []
        assert _zero_ranks(sorted(names)) == want
        # stage 0 adds each rank's gradient-reducer order (dsc_reducer_order_rank_R_of_W.pt), on its own node
        orders = sorted(int(n.split("_")[4]) for n in names if n.startswith("dsc_reducer_order_rank_"))
        assert orders == (list(range(node * PER_NODE, (node + 1) * PER_NODE)) if stage == 0 else [])
        # and each rank's random generators (dsc_rng_state_rank_R_of_W.pt), on its own node too
        rngs = sorted(int(n.split("_")[4]) for n in names if n.startswith("dsc_rng_state_rank_"))
        assert rngs == list(range(node * PER_NODE, (node + 1) * PER_NODE))
        assert names == {MODEL_FILE} | {n for n in names if n.startswith(("zero_pp_rank_", "dsc_reducer_order_rank_",
                                                                          "dsc_rng_state_rank_"))}
    for rank, res in enumerate(results):
        wrote = res["written"][stage]
        assert (MODEL_FILE in wrote) == (rank % PER_NODE == 0)  # each node's local rank 0
        assert _zero_ranks(wrote) == ([rank] if stage > 0 else [])
        node_dir = os.path.join(root, f"stage{stage}", f"node{rank // PER_NODE}")
        assert res["loaded_from"][stage] == os.path.join(node_dir, f"global_step{HALF}", MODEL_FILE)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_from_node_local_dirs_matches_uninterrupted(run, stage):
    _, results = run
    for res in results:
        assert res["resumed"][stage] == res["reference"][stage][HALF:]


def test_key_off_only_global_rank0_writes_the_model_file(run):
    root, results = run
    assert [MODEL_FILE in r["written"]["off"] for r in results] == [True, False, False, False]
    assert [_zero_ranks(r["written"]["off"]) for r in results] == [[r] for r in range(WORLD)]
    names = _verify_node_dir(os.path.join(root, "off"))
    assert _zero_ranks(sorted(names)) == list(range(WORLD)) and MODEL_FILE in names


def test_key_on_over_a_shared_dir_has_one_writer(run):
    root, results = run
    assert [MODEL_FILE in r["written"]["shared"] for r in results] == [True, False, False, False]
    names = _verify_node_dir(os.path.join(root, "shared"))
    assert _zero_ranks(sorted(names)) == list(range(WORLD))
    for res in results:
        assert res["resumed"]["shared"] == res["reference"][2][HALF:]


def test_manifest_is_json_per_node(run):
    root, _ = run
    from deepspeed_c.checkpoint import store

    for node in range(WORLD // PER_NODE):
        tag_dir = os.path.join(root, "stage2", f"node{node}", f"global_step{HALF}")
        with open(os.path.join(tag_dir, store.MANIFEST_NAME)) as f:
            files = json.load(f)["files"]
        assert _zero_ranks(sorted(files)) == [node * PER_NODE, node * PER_NODE + 1]


def test_nodes_that_disagree_fail_every_rank(run):
    _, results = run
    for rank, res in enumerate(results):
        latest, explicit = res["errors"]["latest"], res["errors"]["explicit"]
        assert latest is not None and "different tags" in latest and "global_step999" in latest
        # node 1 lacks the tag: its ranks name the missing directory, node 0's ranks hear of the failure
        want = "FileNotFoundError" if rank >= PER_NODE else "RankFailed"
        assert explicit is not None and explicit.startswith(want), (rank, explicit)

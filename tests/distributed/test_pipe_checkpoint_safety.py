"""PipelineEngine.load_checkpoint on 2 gloo ranks (2 stages, tied layers) against hostile and damaged
checkpoints:

- a crafted pickle whose unpickling would run os.system (creating a marker file) in the stage file
  mp_rank_00_model_states.pt, in a layer file, in the stage file another pipeline degree reads
  through optim_reshard, and in a ZeRO-1 optimizer file: refused with UntrustedPickleError naming the
  file, without a manifest (as DeepSpeed writes checkpoints) and with a manifest forged to match, and
  the marker never appears;
- a file of one stage corrupted (bytes flipped, size kept): that rank raises CheckpointIntegrityError,
  the other RankFailed, both within seconds (without the collective guard the other rank waits in
  the tied-weight broadcast until the process group times out; the harness's timeout catches that);
- a save with a different tag on each rank raises NotImplementedError on every rank, before writing.

Every rank catches each error and goes on to the next case, as "resume if possible" code does."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any

import torch

from tests.distributed import pipe_models as pm
from tests.harness import DistributedTestError, run_distributed

BOUND_S = 20.0  # a failed load raises on every rank well within this


class _Payload:
    """Unpickling this runs os.system: what a hostile checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _engine(stages: int, zero: int = 0):
    import deepspeed_c as deepspeed
    from deepspeed_c.pipe import PipelineModule

    model = PipelineModule(pm.specs(), num_stages=stages, loss_fn=pm.loss_fn, seed_layers=True)
    dp = 2 // stages
    cfg = {"train_micro_batch_size_per_gpu": pm.MBS, "gradient_accumulation_steps": pm.GAS // dp,
           "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    return engine


def _trained_checkpoint(path: str, zero: int) -> Any:
    engine = _engine(2, zero)
    engine.train_batch(iter(pm.batches(1, 1)[0]))
    engine.save_checkpoint(path, tag="t")
    return engine


def _forge_manifest(tag_dir: str, name: str) -> None:
    """The manifest entry rewritten to match the replaced file: only the loader stands in the way."""
    mpath = os.path.join(tag_dir, "dsc_manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    with open(os.path.join(tag_dir, name), "rb") as f:
        data = f.read()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "tensors": {}}
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _tamper(src: str, dst: str, name: str, how: str, marker: str) -> None:
    """A copy of checkpoint `src` in `dst` with file `name` replaced by a crafted pickle ("crafted":
    manifest removed; "forged": manifest rewritten to match) or with bytes flipped ("corrupt")."""
    shutil.copytree(src, dst)
    tag_dir = os.path.join(dst, "t")
    path = os.path.join(tag_dir, name)
    if how == "corrupt":
        with open(path, "r+b") as f:
            size = f.seek(0, 2)
            f.seek(size // 2)
            chunk = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
        return
    torch.save({"module": _Payload(marker), "global_steps": 1}, path)
    if not os.path.isfile(os.path.join(tag_dir, "dsc_manifest.json")):
        return  # a checkpoint written without one
    if how == "crafted":
        os.remove(os.path.join(tag_dir, "dsc_manifest.json"))
    else:
        _forge_manifest(tag_dir, name)


CASES = [  # (name, file, how, stages of the loading engine, zero stage)
    ("stage_file", "mp_rank_00_model_states.pt", "crafted", 2, 0),
    ("stage_file_forged", "mp_rank_00_model_states.pt", "forged", 2, 0),
    ("layer_file", "layer_05-model_states.pt", "crafted", 2, 0),
    ("reshard_stage_file", "mp_rank_01_model_states.pt", "forged", 1, 0),
    ("zero_file", "zero_pp_rank_0_mp_rank_01_optim_states.pt", "crafted", 2, 1),
    ("corrupt_layer", "layer_05-model_states.pt", "corrupt", 2, 0),
    ("corrupt_stage_file", "mp_rank_01_model_states.pt", "corrupt", 2, 0),
    ("corrupt_zero_file", "zero_pp_rank_0_mp_rank_01_optim_states.pt", "corrupt", 2, 1),
]


def _body(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    good = {z: os.path.join(tmp, f"good_zero{z}") for z in (0, 1)}
    engines = {zero: _trained_checkpoint(path, zero) for zero, path in good.items()}
    out = {}
    # ranks passing different tags (tag_validation WARN, the default): a clear error on every rank, before any
    # file is written (DeepSpeed writes each rank's layer files under its own tag)
    try:
        engines[0].save_checkpoint(os.path.join(tmp, "per_rank_tags"), tag=f"t{rank}")
        out["per_rank_tags"] = ("no error", "")
    except Exception as e:  # noqa: BLE001
        out["per_rank_tags"] = (type(e).__name__, str(e))
    out["per_rank_tags_dir"] = os.path.exists(os.path.join(tmp, "per_rank_tags"))
    for name, file, how, stages, zero in CASES:
        marker = os.path.join(tmp, f"marker_{name}")
        ckpt = os.path.join(tmp, name)
        if rank == 0:
            _tamper(good[zero], ckpt, file, how, marker)
        dist.barrier()
        engine = _engine(stages, zero)
        start = time.monotonic()
        try:
            engine.load_checkpoint(ckpt)
            out[name] = ("no error", "", time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
            out[name] = (type(e).__name__, str(e), time.monotonic() - start)
        out[name + "_marker"] = os.path.exists(marker)
        dist.barrier()
    return out


def test_crafted_and_corrupted_pipeline_files_raise_on_every_rank(tmp_path):
    try:
        results = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout=240)
    except DistributedTestError:
        # a run that failed or hung must still not have run the payload: that is checked first
        ran = [name for name, *_ in CASES if os.path.exists(os.path.join(tmp_path, f"marker_{name}"))]
        assert not ran, f"loading a crafted pickle ran its code (cases {ran})"
        raise
    for res in results:
        kind, msg = res["per_rank_tags"]
        assert kind == "NotImplementedError" and "different tags" in msg and not res["per_rank_tags_dir"], res
    for name, file, how, stages, _ in CASES:
        for rank, res in enumerate(results):
            kind, msg, elapsed = res[name]
            assert not res[name + "_marker"], f"{name}: the crafted pickle ran code on rank {rank}"
            assert elapsed < BOUND_S, f"{name}: rank {rank} raised only after {elapsed:.1f}s"
            # the rank reading the file names it; the other learns another rank failed
            readers = (0, 1) if stages == 1 else ((0,) if file.startswith("mp_rank_00") else (1,))
            if rank in readers:
                want = "UntrustedPickleError" if how != "corrupt" else "CheckpointIntegrityError"
                assert kind == want and file in msg, (name, rank, kind, msg)
            else:
                assert kind == "RankFailed" and "load_checkpoint" in msg, (name, rank, kind, msg)

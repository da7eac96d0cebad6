"""Stage-3 details DeepSpeed's own code relies on, checked without DeepSpeed (the live cross-check,
DeepSpeed's engine loading our stage-3 checkpoints, is scripts/deepspeed_interchange_check.py z3_*):

- a stage-3 model-states file holds every parameter as an empty placeholder in `module`, also where
  the parameter is whole on this rank (one rank, or below the persistence threshold): DeepSpeed's
  stage-3 engine loads `module` into still-partitioned parameters with torch's load_state_dict, and a
  whole value there fails with a size mismatch;
- safe_get_full_fp32_param / safe_get_full_optimizer_state at stage 3 return the parameter's real
  shape (its data is a placeholder; ds_shape is the shape) and equal the gathered weights (fp32, so
  master == weight) and the consolidated checkpoint."""
from __future__ import annotations

import os

import numpy as np
import torch

from tests.distributed.test_checkpoint_zero3 import _model, _train
from tests.harness import run_distributed


def body(rank: int, world: int, ckpt: str, threshold: int) -> dict:
    import deepspeed_c
    from deepspeed_c.checkpoint import safe_load
    from deepspeed_c.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // world,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    engine, *_ = deepspeed_c.initialize(model=_model(), config=cfg)
    _train(engine, rank, world, 0, 2)
    engine.save_checkpoint(ckpt, tag="t")
    out: dict = {}
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    for n, p in params:
        out[n] = safe_get_full_fp32_param(p).numpy()
        out[n + ":exp_avg"] = safe_get_full_optimizer_state(p, "exp_avg").numpy()
        out[n + ":shape"] = np.array(tuple(p.ds_shape))
    with deepspeed_c.zero.GatheredParameters([p for _, p in params]):
        for n, p in params:
            out[n + ":gathered"] = p.detach().float().clone().numpy()
    saved = safe_load.load(os.path.join(ckpt, "t", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))["module"]
    names = dict(engine.module.named_parameters())
    out["placeholders"] = np.array([saved[n].numel() == 0 and saved[n].dtype == p.dtype
                                    for n, p in names.items() if n in saved])
    return out


def _check(results: list[dict], ckpt: str) -> None:
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    for r in results:
        assert r["placeholders"].size > 0 and r["placeholders"].all()
        for k in [k for k in r if k.endswith(":gathered")]:
            n = k[: -len(":gathered")]
            assert tuple(r[n].shape) == tuple(r[n + ":shape"]) == tuple(r[k].shape)
            np.testing.assert_array_equal(r[n], r[k])
            np.testing.assert_array_equal(r[n], consolidated[n].numpy())
            np.testing.assert_array_equal(r[n + ":exp_avg"], results[0][n + ":exp_avg"])  # same on every rank
            assert np.abs(r[n + ":exp_avg"]).sum() > 0


def test_one_rank_whole_params_saved_as_placeholders(tmp_path):
    ckpt = str(tmp_path / "w1")
    _check(run_distributed(body, 1, args=(ckpt, 100000), timeout=300), ckpt)


def test_two_ranks_persistent_params_and_full_accessors(tmp_path):
    ckpt = str(tmp_path / "w2")
    _check(run_distributed(body, 2, args=(ckpt, 30), timeout=300), ckpt)
